"""Transformer Engine for the fast learner: which layer spec a learner builds, and the one map
between the parameter names of Megatron's local spec and of its Transformer Engine spec.

Which spec (``resolve_spec``; recipe key ``runtime.te``, recorded as ``learner_spec`` in
summary.json, check.json and the checkpoint):

- ``aligned``: mode=aligned (the local spec with the project's own modules, megatron_rz.learner.aligned_spec),
  and the families with their own learner (DeepSeek-V4, Kimi-K3), whatever runtime.te says;
- ``te``: mode=fast, runtime.te=on, or runtime.te=auto where ``transformer_engine.pytorch`` imports
  and a CUDA device is present: megatron-core's ``get_gpt_layer_with_transformer_engine_spec``
  (TE linears with the RMSNorm fused in, TE RMSNorm, TE attention, grouped-GEMM experts);
- ``local``: mode=fast otherwise (megatron-core's local spec with the stock-numerics RMSNorm and
  attention of megatron_rz.learner.model).

Names (megatron-core 0.16.1, Transformer Engine 2.x; per decoder layer ``decoder.layers.<i>.``).
The TE spec fuses some norms into the linear after them and stores experts as one grouped linear:

| local spec | TE spec | families, layers |
|---|---|---|
| ``input_layernorm.weight`` | ``self_attention.linear_qkv.layer_norm_weight`` | GQA (Qwen2, Qwen3-MoE) |
| ``pre_mlp_layernorm.weight`` | ``mlp.linear_fc1.layer_norm_weight`` | dense layers (Qwen2, DeepSeek-V3's first_k_dense) |
| ``self_attention.q_layernorm.weight`` | ``self_attention.linear_q_up_proj.layer_norm_weight`` | MLA with q_lora_rank |
| ``self_attention.kv_layernorm.weight`` | ``self_attention.linear_kv_up_proj.layer_norm_weight`` | MLA |
| ``mlp.experts.local_experts.<e>.linear_fc1.weight`` | ``mlp.experts.linear_fc1.weight<e>`` | MoE layers (e: this rank's local index) |
| ``mlp.experts.local_experts.<e>.linear_fc2.weight`` | ``mlp.experts.linear_fc2.weight<e>`` | MoE layers |

Every other name is the same in both (MoE layers keep ``pre_mlp_layernorm.weight`` as a TE
RMSNorm, MLA keeps ``input_layernorm.weight``, Qwen3's ``q_layernorm`` / ``k_layernorm`` are TE
RMSNorms under the same names, the router, shared experts, embedding, output layer and final norm
are unchanged). Shapes are the same too, so the Hugging Face conversion (hf_convert), the weight
export to vLLM and the resharded pieces translate a TE name to its local name and apply the local
rules. Checkpoints hold the spec's own (sharded) names: a checkpoint of one spec is refused by a
learner of another (``checkpoint_refusal``), except aligned <-> local (the same modules' names).
"""

from __future__ import annotations

import functools
import re

SPECS = ("aligned", "te", "local")
TE_SETTINGS = ("auto", "on", "off")

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")

_GQA_INPUT = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
_DENSE_PRE_MLP = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
_MLA_Q = ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight")
_MLA_KV = ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight")


# ------------------------------------------------------------------ names


def _family(m):
    from kernels.families import family

    f = family(m.arch)
    if f.learner is not None or not (f.gqa or f.mla):
        raise ValueError(f"model.arch={m.arch} has its own learner (no Megatron layer spec): no TE names")
    return f


def _is_dense(m, layer: int) -> bool:
    """A layer with a dense SwiGLU MLP: every layer of a model without experts, DeepSeek's first_k_dense."""
    return not m.num_experts or layer < m.first_k_dense


def _pairs(m, layer: int) -> list[tuple[str, str]]:
    """(local, TE) name pairs (below ``decoder.layers.<layer>.``) that differ, experts aside."""
    f = _family(m)
    pairs = [_GQA_INPUT] if f.gqa else [_MLA_Q, _MLA_KV]
    if _is_dense(m, layer):
        pairs.append(_DENSE_PRE_MLP)
    return pairs


def local_to_te(name: str, m) -> str:
    """The TE spec's name of a local-spec parameter (or buffer) name of model config ``m`` (a
    ModelConfig: arch, num_experts, first_k_dense); unchanged where both specs agree. ``name`` may
    carry a prefix before ``decoder.layers.`` (e.g. ``module.``)."""
    hit = _LAYER.match(name)
    if not hit:
        _family(m)
        return name
    head, layer, rest = hit.group(1), int(hit.group(2)), hit.group(3)
    for local, te in _pairs(m, layer):
        if rest == local:
            return f"{head}{layer}.{te}"
    ex = _LOCAL_EXPERT.match(rest)
    if ex:
        return f"{head}{layer}.mlp.experts.{ex.group(2)}.weight{ex.group(1)}"
    return name


def te_to_local(name: str, m) -> str:
    """The local spec's name of a TE-spec parameter (or buffer) name: the inverse of local_to_te."""
    hit = _LAYER.match(name)
    if not hit:
        _family(m)
        return name
    head, layer, rest = hit.group(1), int(hit.group(2)), hit.group(3)
    for local, te in _pairs(m, layer):
        if rest == te:
            return f"{head}{layer}.{local}"
    ex = _TE_EXPERT.match(rest)
    if ex:
        return f"{head}{layer}.mlp.experts.local_experts.{ex.group(2)}.{ex.group(1)}.weight"
    return name


def to_local(name: str, m, spec: str) -> str:
    """``name`` of a learner built with ``spec`` as its local-spec name (what hf_convert's rules read)."""
    return te_to_local(name, m) if spec == "te" else name


# ------------------------------------------------------------------ which spec


def resolve_spec(mode: str, te: str, arch: str, te_unavailable_reason=None) -> str:
    """The layer spec a learner of ``mode`` builds under runtime.te=``te`` (see the module doc).

    ``te_unavailable_reason``: a callable returning None when Transformer Engine can run here, else
    why not (default: :func:`te_unavailable`); called only when the answer depends on it. runtime.te=on
    where it cannot run raises ValueError (one line, naming the reason and the fix)."""
    from kernels.families import family

    if te not in TE_SETTINGS:
        raise ValueError(f"runtime.te={te!r}: expected one of {', '.join(TE_SETTINGS)}")
    if mode == "aligned" or family(arch).learner is not None:
        return "aligned"
    if mode != "fast":
        raise ValueError(f"mode must be 'fast' or 'aligned', not {mode!r}")
    if te == "off":
        return "local"
    why = (te_unavailable_reason or te_unavailable)()
    if why is None:
        return "te"
    if te == "on":
        raise ValueError(te_on_refusal(why))
    return "local"


def te_on_refusal(why: str) -> str:
    return (f"runtime.te=on: Transformer Engine cannot run here ({why}); install transformer-engine[pytorch] "
            "on a CUDA machine (docs/gpu.md, \"Transformer Engine\"), or set runtime.te=auto (TE where it "
            "imports, else the local layers) or runtime.te=off")


@functools.lru_cache(maxsize=1)
def te_unavailable() -> str | None:
    """None when the fast learner can build Transformer Engine layers in this process, else why not."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: its layers run on CUDA only"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or the loader's OSError / RuntimeError (cuDNN, CUDA libraries)
        return f"transformer_engine.pytorch does not import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    from megatron.core.extensions import transformer_engine as mc_te

    if not getattr(mc_te, "HAVE_TE", False):
        return "megatron-core's Transformer Engine extension did not find it"
    return None


def te_version() -> str | None:
    """The installed Transformer Engine's version (None when it does not import)."""
    try:
        import transformer_engine

        return getattr(transformer_engine, "__version__", None)
    except Exception:
        return None


# ------------------------------------------------------------------ checkpoints


def checkpoint_refusal(saved: str | None, current: str) -> str | None:
    """None when a checkpoint written by a learner of spec ``saved`` (None: written before the spec
    was recorded, i.e. the local or aligned layers) loads into a learner of spec ``current``; else
    the one-line reason. aligned and local hold the same modules' names and load into each other."""
    same_names = {"aligned": "local", "local": "local", "te": "te", None: "local"}
    if saved not in same_names:
        return f"checkpoint written by an unknown learner spec {saved!r}"
    if same_names[saved] == same_names[current]:
        return None
    fix = "runtime.te=on (or auto on a machine with Transformer Engine)" if saved == "te" else "runtime.te=off"
    return (f"this checkpoint was written by the {saved or 'local'} learner layers and this learner builds the "
            f"{current} ones (Transformer Engine names parameters differently): resume with mode=fast {fix}, "
            "or start a new run from the checkpoint's Hugging Face export (model.pretrained=<run>/hf_final)")
