"""Kimi-Linear / Kimi-K3 class: reference numerics of the whole model (KDA + NoPE MLA + MoE).

Contract (both engines): ``reference_logprobs(weights, config, token_ids)`` is the logprob of every
token under one full prefill; :func:`forward` / :func:`decode_step` carrying the per-layer state
(KDA: short-conv window + fp32 recurrent state; MLA: the compressed KV, i.e. the normed latent
``c_kv [S, kv_lora_rank]`` and the shared key part ``k_pe [S, qk_rope_head_dim]``, as vLLM's MLA
cache and transformers' cache hold it) gives **bitwise** the same logits for a prompt prefilled in
chunks at any boundaries and then decoded token by token; a sequence's bits do not depend on the
other sequences of the batch.

Semantics read (not copied) from transformers 5.19 ``models/kimi_linear`` and vLLM 0.32
``vllm/models/kimi_k3`` (``nvidia/model.py``, ``nvidia/mla.py``, ``ops/attn_res.py``):

* **Layer schedule** (:func:`kimi_config`): transformers' ``layer_types`` (``"linear_attention"`` =
  KDA, ``"full_attention"`` = MLA) if given, else the checkpoint's 1-indexed
  ``linear_attn_config.kda_layers / full_attn_layers``, else transformers' default (MLA at
  ``i > 0 and i % 4 == 0``). MLP: ``mlp_layer_types`` (``"dense"`` / ``"sparse"``) if given, else
  vLLM's rule (MoE iff ``num_experts`` and ``i >= first_k_dense_replace`` and
  ``i % moe_layer_freq == 0``).
* **Decoder layer**: ``h += mixer(rms_norm(h))``; ``h += mlp(rms_norm(h))``; final ``model.norm``;
  ``lm_head`` (or the tied embedding), fp32 logits; ``log_softmax(logits / T)``.
  K3 with ``attn_res_block_size`` replaces the two residual adds by *block attention residuals*
  (:func:`attn_res_mix`, below).
* **KDA layers**: :func:`kernels.models.kda.kda_layer_forward` (chunked prefill == decode bitwise).
* **MLA layers** (:func:`mla_nope_forward`), NoPE: no rotary embedding at all, but the
  ``qk_rope_head_dim`` part of q and the shared ``k_pe`` stay in the q.k product *unrotated*, in
  transformers' layout ``q = [q_nope | q_pe]``, ``k = [k_nope | k_pe]`` (no permutation); scale
  ``(qk_nope + qk_rope) ** -0.5``. q: ``q_proj`` (Kimi-Linear) or ``q_b_proj(rms_norm(q_a_proj))``
  (K3's q-LoRA); ``kv_a_proj_with_mqa -> [c_kv | k_pe]``, ``c_kv = rms_norm(c_kv)``,
  ``kv_b_proj(c_kv) -> [k_nope | v]`` per head. The two latent norms use ``rms_norm_eps`` as vLLM
  does (``mla_norm_eps`` overrides it: transformers' ``KimiLinearAttention`` builds them with its
  RMSNorm default ``1e-6``, which differs from the checkpoints' ``rms_norm_eps = 1e-5``).
  Attention: ``kernels.causal_attention`` (full prefill) / ``kernels.attention`` over the cache
  (chunks, decode) -- bitwise the same rows.
  K3's output gate (``mla_use_output_gate``): ``o = o * sigmoid(g_proj(h))`` in fp32 (sigmoid as
  ``1 / (1 + exp(-x))``), rounded once, before ``o_proj``. ``o_proj`` with
  ``kernels.ROW_PARALLEL_K_SEGMENTS`` (row-parallel under TP, as in ``qwen3_dsv3.attn_output``).
* **MoE** (:func:`kimi_moe_forward`): fp32 router logits (``kernels.router_logits``), ``sigmoid``
  (or ``softmax``, vLLM's ``moe_router_activation_func``) scores, choice on ``score +
  e_score_correction_bias``, grouped top-k (``num_expert_group`` / ``topk_group``, group score =
  top-2 sum), weights = unbiased scores renormalised (``moe_renormalize``, +1e-20) times
  ``routed_scaling_factor`` (applied to the top-k weights: vLLM's default, and transformers) --
  all ``kernels.route``. Shared experts: one MLP of width ``moe_intermediate_size *
  num_shared_experts`` on the layer input. Without a latent: ``kernels.moe_combine`` order (fp32,
  slot order, then the shared output), rounded once.
  **K3 latent MoE** (``routed_expert_hidden_size`` = L): routed experts run on
  ``z = routed_expert_down_proj(x)`` ``[T, L]``; ``r = fold_slots(w_j * expert_j(z))`` in fp32,
  rounded to the activation dtype; optional ``routed_expert_norm`` (``latent_moe_use_norm``,
  ``kernels.rms_norm``); ``u = routed_expert_up_proj(r)``; out = ``u + shared(x)`` in fp32,
  rounded once. (vLLM: the latent combine output is an activation-dtype tensor, then norm, up-proj,
  + shared -- the same sequence.)
* **Activations**: ``silu`` = ``kernels.swiglu`` bits (``x / (1 + exp(-x)) * up`` in fp32, rounded
  once); K3 ``situ``: ``beta * tanh(g / beta) * sigmoid(g) * up`` with the optional soft clip
  ``up = linear_beta * tanh(up / linear_beta)`` (vLLM ``SituAndMul``), fp32, rounded once.
  Expert / dense / shared MLPs: gate and up ``kernels.linear`` rounded to the activation dtype,
  down with ``kernels.ROW_PARALLEL_K_SEGMENTS`` (= ``kernels.expert_mlp`` for silu, bitwise).
* **K3 block attention residuals** (``attn_res_block_size`` = bs; vLLM ``attn_res``): instead of a
  residual stream the model keeps the completed block sums ``b_0, b_1, ...`` (``b_0`` = the
  embedding) and the running partial sum ``p`` of the current block. Before every sublayer the
  input is ``rms_norm_w(mix(b_0, ..., b_n, p))`` where ``mix`` is a softmax over the sources of
  ``logit_i = tree(v_i * (n * q)) * (1 / sqrt(tree(v_i * v_i) / D + eps))`` (``n``: the
  ``*_res_norm`` weight, ``q``: the ``*_res_proj [1, D]`` row, folded in fp32 as vLLM's kernel),
  ``e_i = exp(logit_i - max)``, ``mix = fold_i(e_i * v_i) / fold_i(e_i)`` (left folds in source
  order: blocks, then ``p``), fp32, then the sublayer's own RMSNorm (``input_layernorm`` /
  ``post_attention_layernorm``) on the fp32 mix, rounded once. Updates: each sublayer output is
  added to ``p`` (rounded to the activation dtype); at layer ``i % bs == 0`` the ``p`` before the
  attention is stored as a new block and the attention output starts a new ``p``. After the last
  layer, ``mix`` with ``model.output_attn_res_norm / _proj`` (no output norm), then ``model.norm``.
  Per token only: no state across tokens.

Weights: a mapping of full names (``model.layers.{i}.…``, ``model.embed_tokens.weight``,
``model.norm.weight``, ``lm_head.weight``; an optional ``language_model.`` prefix is accepted).
Per layer, transformers' names and the Kimi checkpoint names vLLM loads are both accepted:
``self_attn.*`` (KDA: see ``kda.py``; MLA: ``q_proj`` or ``q_a_proj / q_a_layernorm / q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, K3 ``g_proj``), the MLP under
``mlp.`` or ``block_sparse_moe.``: ``gate.weight``, ``gate.e_score_correction_bias``, experts as
transformers' fused ``experts.gate_up_proj [E, 2I, H]`` (gate rows first) / ``experts.down_proj
[E, H, I]`` or per expert ``experts.{e}.w1 / w3 / w2.weight`` (gate / up / down) or
``experts.{e}.gate_proj / up_proj / down_proj.weight``; ``shared_experts.{gate,up,down}_proj``;
K3 ``routed_expert_down_proj``, ``routed_expert_norm``, ``routed_expert_up_proj``; AttnRes
``self_attention_res_norm``, ``self_attention_res_proj``, ``mlp_res_norm``, ``mlp_res_proj``,
``model.output_attn_res_norm``, ``model.output_attn_res_proj``.

Float64 inputs/weights run in float64 where this module does the arithmetic (the tests' exact
reference); ``kernels.route`` always routes in fp32 (weights then converted).

Imports torch and ``kernels`` only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch

import kernels
from kernels import tree_sum

from . import kda as _kda
from .qwen3_dsv3 import config_get

__all__ = [
    "KimiConfig",
    "kimi_config",
    "mla_nope_forward",
    "kimi_moe_forward",
    "dense_mlp_forward",
    "glu",
    "attn_res_mix",
    "decoder_layer_forward",
    "empty_state",
    "forward",
    "decode_step",
    "reference_logits",
    "reference_logprobs",
    "mla_nope_qkv",
    "mla_nope_output",
    "decoder_layer_apply",
    "embed_stream",
    "final_hidden",
    "parameter_shapes",
    "moe_prefix",
    "routed_slots",
    "fold_combine",
]

Getter = Callable[[str], Optional[torch.Tensor]]


@dataclass
class KimiConfig:
    hidden_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_types: List[str]  # per layer: "kda" | "mla"
    mlp_types: List[str]  # per layer: "dense" | "moe"
    kda: Optional[_kda.KDAConfig]
    # MLA
    num_heads: int = 0
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_output_gate: bool = False
    # eps of q_a_layernorm / kv_a_layernorm: None = rms_norm_eps (vLLM's Kimi MLA); transformers'
    # KimiLinearAttention builds both norms with its RMSNorm default 1e-6 whatever rms_norm_eps is.
    mla_norm_eps: Optional[float] = None
    # MLP / MoE
    hidden_act: str = "silu"
    situ_beta: float = 1.0
    situ_linear_beta: Optional[float] = None
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    num_experts: int = 0
    top_k: int = 0
    num_shared_experts: int = 0
    score: str = "sigmoid"
    num_groups: int = 1
    topk_group: Optional[int] = None
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: Optional[int] = None
    latent_norm: bool = False
    # K3 block attention residuals
    attn_res_block_size: Optional[int] = None
    extra: dict = field(default_factory=dict)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_eps(self) -> float:
        return self.rms_norm_eps if self.mla_norm_eps is None else self.mla_norm_eps

    @property
    def attn_scale(self) -> float:
        return float(self.qk_head_dim ** (-0.5))


def kimi_config(config: Any) -> KimiConfig:
    """KimiConfig from a config.json dict (Kimi-Linear / K3 checkpoint keys, or a K3 dict with a
    ``text_config``), a transformers ``KimiLinearConfig`` (or its ``to_dict()``), a checkpoint dir,
    or a KimiConfig."""
    if isinstance(config, KimiConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(os.path.join(config, "config.json")) as f:
            config = json.load(f)
    tc = config_get(config, "text_config")
    if tc is not None:
        config = tc
    n_layers = int(config_get(config, "num_hidden_layers"))
    lac = config_get(config, "linear_attn_config", default={}) or {}

    lt = config_get(config, "layer_types")
    if lt is not None:
        layer_types = ["kda" if t == "linear_attention" else "mla" for t in lt]
        bad = [t for t in lt if t not in ("linear_attention", "full_attention")]
        if bad:
            raise ValueError(f"kimi_config: unknown layer types {bad}")
    elif lac.get("kda_layers") is not None and lac.get("full_attn_layers") is not None:
        kda_set = {int(i) - 1 for i in lac["kda_layers"]}
        layer_types = ["kda" if i in kda_set else "mla" for i in range(n_layers)]
    else:
        layer_types = ["mla" if i and i % 4 == 0 else "kda" for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise ValueError(f"kimi_config: {len(layer_types)} layer types for {n_layers} layers")

    n_exp = int(config_get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    mt = config_get(config, "mlp_layer_types")
    if mt is not None:
        mlp_types = ["moe" if t == "sparse" else "dense" for t in mt]
    else:
        first = int(config_get(config, "first_k_dense_replace", default=0) or 0)
        freq = int(config_get(config, "moe_layer_freq", default=1) or 1)
        mlp_types = ["moe" if n_exp and i >= first and i % freq == 0 else "dense" for i in range(n_layers)]

    hidden = int(config_get(config, "hidden_size"))
    eps = float(config_get(config, "rms_norm_eps", default=1e-5))
    if "mla" in layer_types and config_get(config, "mla_use_nope", default=True) is False:
        raise NotImplementedError("kimi_config: MLA with rotary embeddings (mla_use_nope=false) is not supported")
    act = str(config_get(config, "hidden_act", default="silu"))
    if act not in ("silu", "situ"):
        raise NotImplementedError(f"kimi_config: hidden_act {act!r} (silu or situ)")
    grouped = bool(config_get(config, "use_grouped_topk", default=True))
    score = str(config_get(config, "moe_router_activation_func", default="sigmoid"))
    if score not in ("sigmoid", "softmax"):
        raise NotImplementedError(f"kimi_config: router activation {score!r}")
    lb = config_get(config, "activation_situ_linear_beta")
    latent = config_get(config, "routed_expert_hidden_size")
    arb = config_get(config, "attn_res_block_size")
    kda_cfg = _kda.kda_config(config) if "kda" in layer_types else None
    return KimiConfig(
        hidden_size=hidden,
        num_layers=n_layers,
        vocab_size=int(config_get(config, "vocab_size")),
        rms_norm_eps=eps,
        tie_word_embeddings=bool(config_get(config, "tie_word_embeddings", default=False)),
        layer_types=layer_types,
        mlp_types=mlp_types,
        kda=kda_cfg,
        num_heads=int(config_get(config, "num_attention_heads", default=0) or 0),
        q_lora_rank=config_get(config, "q_lora_rank"),
        kv_lora_rank=int(config_get(config, "kv_lora_rank", default=0) or 0),
        qk_nope_head_dim=int(config_get(config, "qk_nope_head_dim", default=0) or 0),
        qk_rope_head_dim=int(config_get(config, "qk_rope_head_dim", default=0) or 0),
        v_head_dim=int(config_get(config, "v_head_dim", default=0) or 0),
        mla_output_gate=bool(config_get(config, "mla_use_output_gate", default=False)),
        mla_norm_eps=config_get(config, "mla_norm_eps"),
        hidden_act=act,
        situ_beta=float(config_get(config, "activation_situ_beta", default=1.0) or 1.0),
        situ_linear_beta=None if lb is None else float(lb),
        intermediate_size=int(config_get(config, "intermediate_size", default=0) or 0),
        moe_intermediate_size=int(config_get(config, "moe_intermediate_size", default=0) or 0),
        num_experts=n_exp,
        top_k=int(config_get(config, "num_experts_per_token", "num_experts_per_tok", default=0) or 0),
        num_shared_experts=int(config_get(config, "num_shared_experts", "n_shared_experts", default=0) or 0),
        score=score,
        num_groups=int(config_get(config, "num_expert_group", "n_group", default=1) or 1) if grouped else 1,
        topk_group=config_get(config, "topk_group") if grouped else None,
        norm_topk_prob=bool(config_get(config, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling_factor=float(config_get(config, "routed_scaling_factor", default=1.0)),
        latent_size=None if latent is None else int(latent),
        latent_norm=bool(config_get(config, "latent_moe_use_norm", default=False)),
        attn_res_block_size=None if arb is None else int(arb),
    )


# ------------------------------------------------------------------------------------ small pieces


def _f(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float32)


_sigmoid = _kda.sigmoid  # fp32 1 / (1 + exp(-x)), the same op as KDA's gates


def _first(get: Getter, *names: str) -> torch.Tensor:
    for n in names:
        t = get(n)
        if t is not None:
            return t
    raise KeyError(f"Kimi weights: none of {names}")


def _sub(get: Getter, prefix: str) -> Getter:
    return lambda n: get(prefix + n)


def glu(c: KimiConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation, fp32 (float64 for float64 inputs), rounded once to ``gate.dtype``.
    ``silu``: bitwise ``kernels.swiglu``; ``situ``: vLLM ``SituAndMul``."""
    g, u = _f(gate), _f(up)
    if c.hidden_act == "silu":
        a = g / (1.0 + torch.exp(-g))
    else:
        b = c.situ_beta
        a = b * torch.tanh(g / b) * _sigmoid(g)
        if c.situ_linear_beta is not None:
            lb = c.situ_linear_beta
            u = lb * torch.tanh(u / lb)
    return (a * u).to(gate.dtype)


def _mlp(c: KimiConfig, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor):
    lin = kernels.linear
    return lin(glu(c, lin(x, w_gate), lin(x, w_up)), w_down, k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)


def dense_mlp_forward(c: KimiConfig, get: Getter, x: torch.Tensor, prefix: str = "mlp.") -> torch.Tensor:
    """Dense SwiGLU / SituGLU MLP ``prefix{gate,up,down}_proj.weight`` (vLLM's merged ``gate_up_proj``
    is accepted: the linear is invariant in N, so splitting changes no bits)."""
    gu = get(prefix + "gate_up_proj.weight")
    if gu is not None and get(prefix + "gate_proj.weight") is None:
        i = gu.shape[0] // 2
        wg, wu = gu[:i], gu[i:]
    else:
        wg, wu = get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")
    return _mlp(c, x, wg, wu, get(prefix + "down_proj.weight"))


def _fold_combine(y: torch.Tensor, w: torch.Tensor, extra: Optional[torch.Tensor], odt: torch.dtype) -> torch.Tensor:
    """``kernels.moe_combine``'s order (fp32 left fold over slots, then ``extra``), in float64 for
    float64 inputs; bitwise ``kernels.moe_combine`` in fp32."""
    dt = torch.float64 if y.dtype == torch.float64 else torch.float32
    w = w.to(dt)
    acc = w[:, 0:1] * y[:, 0].to(dt)
    for j in range(1, y.shape[1]):
        acc = acc + w[:, j:j + 1] * y[:, j].to(dt)
    if extra is not None:
        acc = acc + extra.to(dt)
    return acc.to(odt)


# -------------------------------------------------------------------------------------------- MoE


def _expert_weights(get: Getter, e: int, inter: int):
    fused = get("experts.gate_up_proj")
    if fused is not None:
        gu = fused[e]
        return gu[:inter], gu[inter:], get("experts.down_proj")[e]
    for g, u, d in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        wg = get(f"experts.{e}.{g}.weight")
        if wg is not None:
            return wg, get(f"experts.{e}.{u}.weight"), get(f"experts.{e}.{d}.weight")
    raise KeyError(f"Kimi weights: expert {e} not found")


def _routed(c: KimiConfig, get: Getter, x: torch.Tensor, ids: torch.Tensor, owned=None) -> torch.Tensor:
    """``[T, k, D]``: slot j of token t = expert ``ids[t, j]`` on ``x[t]`` (independent rows);
    ``owned``: only these experts' slots (the others exact zeros: an expert-parallel rank's share)."""
    T, D = x.shape
    k = ids.shape[1]
    flat = ids.reshape(-1)
    y = x.new_zeros(T * k, D)
    for e in torch.unique(flat).tolist():
        if owned is not None and e not in owned:
            continue
        sel = (flat == e).nonzero().squeeze(1)
        tok = torch.div(sel, k, rounding_mode="floor")
        y[sel] = _mlp(c, x[tok], *_expert_weights(get, e, c.moe_intermediate_size))
    return y.view(T, k, D)


def routed_slots(c: KimiConfig, get: Getter, x: torch.Tensor, ids: torch.Tensor, owned=None) -> torch.Tensor:
    """The routed experts' outputs ``[T, k, D]`` of rows ``x [T, D]`` (the MoE input, or the latent)
    for the routing ``ids [T, k]``, as :func:`kimi_moe_forward` computes them; ``owned`` (a
    container of expert ids): only those experts' slots, the others exact zeros."""
    return _routed(c, get, x, ids, owned)


def fold_combine(y: torch.Tensor, w: torch.Tensor, extra: Optional[torch.Tensor], odt: torch.dtype) -> torch.Tensor:
    """:func:`kimi_moe_forward`'s combine: fp32 left fold of ``w[:, j] * y[:, j]`` in slot order,
    then ``extra`` (the shared expert, or None), rounded once to ``odt``."""
    return _fold_combine(y, w, extra, odt)


def route_and_shared(c: KimiConfig, get: Getter, x: torch.Tensor):
    """The sparse MLP's routing and shared expert on ``x [T, H]``: ``(ids [T, k], fp32 weights
    [T, k] incl. the scaling factor, shared expert output or None)``."""
    logits = kernels.router_logits(x, get("gate.weight"), out_dtype=torch.float32)
    ids, wts = kernels.route(
        logits, c.top_k, score=c.score, expert_bias=get("gate.e_score_correction_bias"),
        num_groups=c.num_groups, group_topk=c.topk_group, norm_topk_prob=c.norm_topk_prob,
        scaling_factor=c.routed_scaling_factor)
    shared = None
    if c.num_shared_experts and get("shared_experts.down_proj.weight") is not None:
        shared = dense_mlp_forward(c, get, x, "shared_experts.")
    return ids, wts, shared


def kimi_moe_forward(c: KimiConfig, get: Getter, x: torch.Tensor) -> Tuple[torch.Tensor, dict]:
    """The sparse MLP on ``x [T, H]`` (post-norm); ``get`` relative to the MoE prefix (``mlp.`` /
    ``block_sparse_moe.``). Returns ``(out [T, H] in x.dtype, aux)`` with ``aux = {"ids", "weights"}``
    (the routing, fp32 weights incl. the scaling factor)."""
    ids, wts, shared = route_and_shared(c, get, x)
    if c.latent_size is None:
        y = _routed(c, get, x, ids)
        return _fold_combine(y, wts, shared, x.dtype), {"ids": ids, "weights": wts}
    z = kernels.linear(x, get("routed_expert_down_proj.weight"))
    r = _fold_combine(_routed(c, get, z, ids), wts, None, x.dtype)
    if c.latent_norm:
        r = kernels.rms_norm(r, get("routed_expert_norm.weight"), c.rms_norm_eps)
    u = kernels.linear(r, get("routed_expert_up_proj.weight"))
    out = _f(u) if shared is None else _f(u) + _f(shared)
    return out.to(x.dtype), {"ids": ids, "weights": wts}


def _mlp_block(c: KimiConfig, get: Getter, layer: int, x: torch.Tensor) -> torch.Tensor:
    if c.mlp_types[layer] == "dense":
        pre = "mlp." if get("mlp.down_proj.weight") is not None or get("mlp.gate_up_proj.weight") is not None \
            else "block_sparse_moe."
        return dense_mlp_forward(c, get, x, pre)
    pre = "mlp." if get("mlp.gate.weight") is not None else "block_sparse_moe."
    return kimi_moe_forward(c, _sub(get, pre), x)[0]


# -------------------------------------------------------------------------------------------- MLA


def mla_nope_forward(c: KimiConfig, get: Getter, x: torch.Tensor, cache: Optional[dict] = None
                     ) -> Tuple[torch.Tensor, dict]:
    """NoPE MLA on ``x [B, T, H]`` (post-norm); ``get`` relative to ``self_attn.``.

    ``cache``: ``{"latent": [B, S, kv_lora_rank], "k_pe": [B, S, qk_rope_head_dim]}`` of the previous
    tokens (None = none: full causal attention with ``kernels.causal_attention``); the new tokens
    sit at positions ``S .. S + T - 1`` and attend through ``kernels.attention`` over the expanded
    cache (bitwise the same rows). Returns ``(out [B, T, H], new_cache)``.
    """
    B, T, _ = x.shape
    H, nope, rope, dv, r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    lin = kernels.linear
    if c.q_lora_rank is None:
        q = lin(x, get("q_proj.weight"))
    else:
        q = lin(kernels.rms_norm(lin(x, get("q_a_proj.weight")), get("q_a_layernorm.weight"), c.mla_eps),
                get("q_b_proj.weight"))
    q = q.view(B, T, H, nope + rope)
    ckv = lin(x, get("kv_a_proj_with_mqa.weight"))
    latent = kernels.rms_norm(ckv[..., :r], get("kv_a_layernorm.weight"), c.mla_eps)
    k_pe = ckv[..., r:]
    if cache is not None:
        latent = torch.cat([cache["latent"], latent], dim=1)
        k_pe = torch.cat([cache["k_pe"], k_pe], dim=1)
    S = latent.shape[1]
    kv = lin(latent, get("kv_b_proj.weight")).view(B, S, H, nope + dv)
    k = torch.cat([kv[..., :nope], k_pe.unsqueeze(2).expand(B, S, H, rope)], dim=-1)
    v = kv[..., nope:].contiguous()
    if cache is None:
        o = kernels.causal_attention(q, k, v, c.attn_scale)
    else:
        pos = torch.arange(S - T, S, device=x.device)
        o = torch.stack([kernels.attention(q[b], k[b], v[b], pos, c.attn_scale) for b in range(B)])
    o = o.reshape(B, T, H * dv)
    g = get("g_proj.weight")
    if c.mla_output_gate or g is not None:
        o = (_f(o) * _sigmoid(lin(x, g))).to(o.dtype)
    out = lin(o, get("o_proj.weight"), k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)
    return out, {"latent": latent, "k_pe": k_pe}


# ------------------------------------------------------------------------- block attention residuals


def attn_res_mix(sources: List[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float
                 ) -> torch.Tensor:
    """Softmax mix of the sources ``[..., D]`` (K3 AttnRes), fp32 (float64 for float64 sources),
    order fixed by the list (see the module docstring). One source returns it exactly."""
    dt = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    D = sources[0].shape[-1]
    vs = [s.to(dt) for s in sources]
    if len(vs) == 1:
        return vs[0]
    wq = norm_w.to(dt) * proj_w.reshape(-1).to(dt)
    logits = [tree_sum(v * wq, dim=-1, keepdim=True)
              * (1.0 / torch.sqrt(tree_sum(v * v, dim=-1, keepdim=True) / D + eps)) for v in vs]
    m = logits[0]
    for lg in logits[1:]:
        m = torch.maximum(m, lg)
    es = [torch.exp(lg - m) for lg in logits]
    num, den = es[0] * vs[0], es[0]
    for e, v in zip(es[1:], vs[1:]):
        num = num + e * v
        den = den + e
    return num / den


def _res_input(c: KimiConfig, get: Getter, kind: str, res: dict, out_norm: str) -> torch.Tensor:
    mixed = attn_res_mix(res["blocks"] + ([] if res["p"] is None else [res["p"]]),
                         get(f"{kind}_res_norm.weight"), get(f"{kind}_res_proj.weight"), c.rms_norm_eps)
    return kernels.rms_norm(mixed, get(out_norm), c.rms_norm_eps).to(res["dtype"])


# ---------------------------------------------------------------------------------- decoder layers


def decoder_layer_forward(c: KimiConfig, get: Getter, layer: int, h: Any, state: Optional[dict] = None, *,
                          chunk_size: Optional[int] = 64) -> Tuple[Any, dict]:
    """One decoder layer. ``get`` relative to ``model.layers.{layer}.``.

    ``h``: the residual stream ``[B, T, H]``, or with AttnRes the dict ``{"blocks": [...], "p",
    "delta", "dtype"}`` (:func:`forward` builds it). ``state``: the layer's incoming sequence state
    (KDA ``{"conv", "recurrent"}`` / MLA ``{"latent", "k_pe"}``; None = start). Returns
    ``(h_new, state_new)``.
    """
    def mixer(x):
        if c.layer_types[layer] == "kda":
            return _kda.kda_layer_forward(x, _sub(get, "self_attn."), c.kda, state, chunk_size=chunk_size)
        return mla_nope_forward(c, _sub(get, "self_attn."), x, state)

    def mlp(x):
        B, T, D = x.shape
        return _mlp_block(c, get, layer, x.reshape(B * T, D)).view(B, T, D)

    if c.attn_res_block_size is None:
        a, new_state = mixer(kernels.rms_norm(h, get("input_layernorm.weight"), c.rms_norm_eps))
        h = h + a
        h = h + mlp(kernels.rms_norm(h, get("post_attention_layernorm.weight"), c.rms_norm_eps))
        return h, new_state

    res = dict(h)
    res["blocks"] = list(res["blocks"])
    dt = res["dtype"]
    if res["delta"] is not None:
        res["p"] = (res["p"] + res["delta"]).to(dt)
    write = layer % c.attn_res_block_size == 0
    if write:
        res["blocks"].append(res["p"])
        res["p"] = None  # the block just written is the current prefix
    a, new_state = mixer(_res_input(c, get, "self_attention", res, "input_layernorm.weight"))
    res["p"] = a if write else (res["p"] + a).to(dt)
    res["delta"] = mlp(_res_input(c, get, "mlp", res, "post_attention_layernorm.weight"))
    return res, new_state


# ------------------------------------------------------------------------------------ whole model


def _model_getter(weights: Mapping[str, torch.Tensor]) -> Getter:
    def get(name: str):
        t = weights.get(name)
        if t is None:
            t = weights.get("language_model." + name)
        return t
    return get


def empty_state(config: Any, batch: int = 1) -> dict:
    """Start of the sequences: ``{"pos": 0, "layers": [None] * num_layers}``."""
    c = kimi_config(config)
    return {"pos": 0, "layers": [None] * c.num_layers}


def forward(weights: Mapping[str, torch.Tensor], config: Any, token_ids: torch.Tensor,
            state: Optional[dict] = None, *, chunk_size: Optional[int] = 64,
            return_hidden: bool = False) -> Tuple[torch.Tensor, dict]:
    """``token_ids [B, T]`` (every sequence at the same position ``state["pos"]``) -> ``(logits fp32
    [B, T, V], new_state)``. ``state`` None = a full prefill (MLA: ``kernels.causal_attention``);
    otherwise the tokens continue the cached sequences (a prefill chunk or a decode step).
    ``chunk_size``: the KDA prefill chunk (None = per-token recurrence; same bits)."""
    c = kimi_config(config)
    get = _model_getter(weights)
    token_ids = torch.as_tensor(token_ids).long()
    if token_ids.dim() == 1:
        token_ids = token_ids[None]
    B, T = token_ids.shape
    emb = get("model.embed_tokens.weight")
    h = emb[token_ids.reshape(-1)].view(B, T, -1)
    layers_in = [None] * c.num_layers if state is None else state["layers"]
    new_layers = []
    if c.attn_res_block_size is not None:
        h = {"blocks": [], "p": h, "delta": None, "dtype": h.dtype}
    for i in range(c.num_layers):
        lget = _sub(get, f"model.layers.{i}.")
        h, st = decoder_layer_forward(c, lget, i, h, layers_in[i], chunk_size=chunk_size)
        new_layers.append(st)
    if c.attn_res_block_size is not None:
        res = h
        p = (res["p"] + res["delta"]).to(res["dtype"])
        h = attn_res_mix(res["blocks"] + [p], get("model.output_attn_res_norm.weight"),
                         get("model.output_attn_res_proj.weight"), c.rms_norm_eps).to(res["dtype"])
    h = kernels.rms_norm(h, get("model.norm.weight"), c.rms_norm_eps)
    head = get("lm_head.weight")
    if head is None or c.tie_word_embeddings:
        head = emb
    odt = torch.float64 if h.dtype == torch.float64 else torch.float32  # float64: the tests' reference
    logits = kernels.lm_head_logits(h.reshape(B * T, -1), head, out_dtype=odt).view(B, T, -1)
    new_state = {"pos": (0 if state is None else state["pos"]) + T, "layers": new_layers}
    if return_hidden:
        new_state["hidden"] = h
    return logits, new_state


def decode_step(weights: Mapping[str, torch.Tensor], config: Any, token_ids: torch.Tensor, state: dict, *,
                chunk_size: Optional[int] = 64) -> Tuple[torch.Tensor, dict]:
    """Continue the sequences of ``state`` by ``token_ids [B, T]`` (T = 1: one decode step; T > 1: a
    prefill chunk). ``state`` from :func:`empty_state` or a previous call. Returns ``(logits fp32
    [B, T, V], new_state)``, bitwise the rows of one full :func:`forward` over the whole sequence."""
    if state["pos"] == 0 and all(s is None for s in state["layers"]):
        return forward(weights, config, token_ids, None, chunk_size=chunk_size)
    return forward(weights, config, token_ids, state, chunk_size=chunk_size)


@torch.no_grad()
def reference_logits(weights: Mapping[str, torch.Tensor], config: Any, token_ids: torch.Tensor, *,
                     chunk_size: Optional[int] = 64) -> torch.Tensor:
    """fp32 logits ``[B, S, V]`` of one full prefill (``logits[:, t]`` predict token t + 1)."""
    return forward(weights, config, token_ids, None, chunk_size=chunk_size)[0]


@torch.no_grad()
def reference_logprobs(weights: Mapping[str, torch.Tensor], config: Any, token_ids: torch.Tensor,
                       temperature: float = 1.0, *, chunk_size: Optional[int] = 64) -> torch.Tensor:
    """``[B, S]`` fp32: ``out[:, t] = log p(token_ids[:, t] | token_ids[:, :t])`` at ``temperature``
    (``kernels.logprobs_from_logits``, the sampler's processed logprobs); ``out[:, 0] = 0``."""
    token_ids = torch.as_tensor(token_ids).long()
    if token_ids.dim() == 1:
        token_ids = token_ids[None]
    logits = reference_logits(weights, config, token_ids, chunk_size=chunk_size)
    return logprobs_of(logits, token_ids, temperature)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, S]`` logprobs of ``token_ids[:, 1:]`` under ``logits[:, :-1]`` (``out[:, 0] = 0``)."""
    B, S = token_ids.shape
    out = torch.zeros(B, S, dtype=torch.float32, device=logits.device)
    if S > 1:
        lp = kernels.logprobs_from_logits(logits[:, :-1].reshape(B * (S - 1), -1), token_ids[:, 1:].reshape(-1),
                                          temperature)
        out[:, 1:] = lp.view(B, S - 1)
    return out


# ------------------------------------------------------- per-token pieces for engines with own caches
# Additive helpers for an engine that keeps the sequence state itself (the aligned vLLM class:
# vllm_bridge/aligned/kimi_k3.py): the same ops as :func:`mla_nope_forward` /
# :func:`decoder_layer_forward` / :func:`forward`, split where the engine's caches sit.


def mla_nope_qkv(c: KimiConfig, get: Getter, x: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NoPE MLA q and the *expanded* per-head k, v of the tokens ``x [..., H]`` (post-norm); ``get``
    relative to ``self_attn.``. Returns ``q, k [..., Hn, qk_nope + qk_rope]``, ``v [..., Hn, v_head_dim]``:
    exactly the rows :func:`mla_nope_forward` attends with (its ops, row by row; ``kernels.linear`` is
    invariant in the number of rows), so a paged per-head K/V cache of them gives its bits."""
    lead = x.shape[:-1]
    H, nope, rope, dv, r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    lin = kernels.linear
    if c.q_lora_rank is None:
        q = lin(x, get("q_proj.weight"))
    else:
        q = lin(kernels.rms_norm(lin(x, get("q_a_proj.weight")), get("q_a_layernorm.weight"), c.mla_eps),
                get("q_b_proj.weight"))
    q = q.view(*lead, H, nope + rope)
    ckv = lin(x, get("kv_a_proj_with_mqa.weight"))
    latent = kernels.rms_norm(ckv[..., :r], get("kv_a_layernorm.weight"), c.mla_eps)
    k_pe = ckv[..., r:]
    kv = lin(latent, get("kv_b_proj.weight")).view(*lead, H, nope + dv)
    k = torch.cat([kv[..., :nope], k_pe.unsqueeze(-2).expand(*lead, H, rope)], dim=-1)
    v = kv[..., nope:].contiguous()
    return q, k, v


def mla_nope_output(c: KimiConfig, get: Getter, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The attention output ``o [..., Hn * v_head_dim]`` of the tokens ``x [..., H]`` -> K3's output
    gate (if configured) and ``o_proj``, as :func:`mla_nope_forward`."""
    g = get("g_proj.weight")
    if c.mla_output_gate or g is not None:
        o = (_f(o) * _sigmoid(kernels.linear(x, g))).to(o.dtype)
    return kernels.linear(o, get("o_proj.weight"), k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)


def decoder_layer_apply(c: KimiConfig, get: Getter, layer: int, h: Any,
                        mixer: Callable[[torch.Tensor], torch.Tensor],
                        mlp_rows: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Any:
    """:func:`decoder_layer_forward` with the token mixer supplied by the caller: ``mixer(x [B, T, H])
    -> [B, T, H]`` (the engine's KDA / MLA over its own caches). Same ops, same order; returns the
    new ``h`` (the residual stream, or the AttnRes dict). ``mlp_rows(x [N, H]) -> [N, H]``: the
    layer's MLP / MoE supplied by the caller too (the learner's expert-parallel MoE); None = the
    layer's own weights through ``get`` (:func:`dense_mlp_forward` / :func:`kimi_moe_forward`)."""
    def mlp(x):
        B, T, D = x.shape
        rows = x.reshape(B * T, D)
        out = _mlp_block(c, get, layer, rows) if mlp_rows is None else mlp_rows(rows)
        return out.view(B, T, D)

    if c.attn_res_block_size is None:
        a = mixer(kernels.rms_norm(h, get("input_layernorm.weight"), c.rms_norm_eps))
        h = h + a
        h = h + mlp(kernels.rms_norm(h, get("post_attention_layernorm.weight"), c.rms_norm_eps))
        return h

    res = dict(h)
    res["blocks"] = list(res["blocks"])
    dt = res["dtype"]
    if res["delta"] is not None:
        res["p"] = (res["p"] + res["delta"]).to(dt)
    write = layer % c.attn_res_block_size == 0
    if write:
        res["blocks"].append(res["p"])
        res["p"] = None
    a = mixer(_res_input(c, get, "self_attention", res, "input_layernorm.weight"))
    res["p"] = a if write else (res["p"] + a).to(dt)
    res["delta"] = mlp(_res_input(c, get, "mlp", res, "post_attention_layernorm.weight"))
    return res


def embed_stream(c: KimiConfig, h: torch.Tensor) -> Any:
    """The stream :func:`decoder_layer_apply` takes for the embeddings ``h`` (the AttnRes dict, if any)."""
    if c.attn_res_block_size is not None:
        return {"blocks": [], "p": h, "delta": None, "dtype": h.dtype}
    return h


def final_hidden(c: KimiConfig, get: Getter, h: Any) -> torch.Tensor:
    """After the last layer: the AttnRes output mix (if any), then ``model.norm``, as :func:`forward`
    (``get``: the model getter, full names). The input of ``kernels.lm_head_logits``."""
    if c.attn_res_block_size is not None:
        res = h
        p = (res["p"] + res["delta"]).to(res["dtype"])
        h = attn_res_mix(res["blocks"] + [p], get("model.output_attn_res_norm.weight"),
                         get("model.output_attn_res_proj.weight"), c.rms_norm_eps).to(res["dtype"])
    return kernels.rms_norm(h, get("model.norm.weight"), c.rms_norm_eps)


# ------------------------------------------------------------------------------- the weight names


def moe_prefix(c: KimiConfig, layer: int) -> str:
    """The MLP's name prefix in the Kimi checkpoints: ``block_sparse_moe.`` (MoE) / ``mlp.`` (dense)."""
    return "block_sparse_moe." if c.mlp_types[layer] == "moe" else "mlp."


def parameter_shapes(c: KimiConfig, full_rank_gate: bool = False) -> dict:
    """``{name: (shape, kind)}`` of every tensor of the model in the Kimi checkpoint names vLLM loads
    (the tree of the aligned vLLM class): ``kind`` is ``"param"`` (model dtype, trained) or
    ``"fp32_buffer"`` (``gate.e_score_correction_bias``: fp32, set by load balancing, not by the
    loss). KDA: separate ``q/k/v_conv1d [P, 1, W]``, ``A_log [H]``, ``dt_bias [P]``; the output
    gate ``g_proj`` (``full_rank_gate``: K3's ``linear_attn_config.use_full_rank_gate``) or
    ``g_a_proj / g_b_proj``. Experts per expert as ``w1 / w3 / w2`` (gate / up / down)."""
    H, V = c.hidden_size, c.vocab_size
    out: dict = {"model.embed_tokens.weight": ((V, H), "param")}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), "param")
        out[p + "post_attention_layernorm.weight"] = ((H,), "param")
        if c.attn_res_block_size is not None:
            for kind in ("self_attention", "mlp"):
                out[p + f"{kind}_res_norm.weight"] = ((H,), "param")
                out[p + f"{kind}_res_proj.weight"] = ((1, H), "param")
        a = p + "self_attn."
        if c.layer_types[i] == "kda":
            kc = c.kda
            P, D, nh, W = kc.proj_dim, kc.head_dim, kc.num_heads, kc.conv_kernel
            for n in "qkv":
                out[a + f"{n}_proj.weight"] = ((P, H), "param")
                out[a + f"{n}_conv1d.weight"] = ((P, 1, W), "param")
            out[a + "f_a_proj.weight"] = ((D, H), "param")
            out[a + "f_b_proj.weight"] = ((P, D), "param")
            out[a + "dt_bias"] = ((P,), "param")
            out[a + "A_log"] = ((nh,), "param")
            out[a + "b_proj.weight"] = ((nh, H), "param")
            if full_rank_gate:
                out[a + "g_proj.weight"] = ((P, H), "param")
            else:
                out[a + "g_a_proj.weight"] = ((D, H), "param")
                out[a + "g_b_proj.weight"] = ((P, D), "param")
            out[a + "o_norm.weight"] = ((D,), "param")
            out[a + "o_proj.weight"] = ((H, P), "param")
        else:
            nh = c.num_heads
            if c.q_lora_rank is None:
                out[a + "q_proj.weight"] = ((nh * c.qk_head_dim, H), "param")
            else:
                out[a + "q_a_proj.weight"] = ((c.q_lora_rank, H), "param")
                out[a + "q_a_layernorm.weight"] = ((c.q_lora_rank,), "param")
                out[a + "q_b_proj.weight"] = ((nh * c.qk_head_dim, c.q_lora_rank), "param")
            out[a + "kv_a_proj_with_mqa.weight"] = ((c.kv_lora_rank + c.qk_rope_head_dim, H), "param")
            out[a + "kv_a_layernorm.weight"] = ((c.kv_lora_rank,), "param")
            out[a + "kv_b_proj.weight"] = ((nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), "param")
            if c.mla_output_gate:
                out[a + "g_proj.weight"] = ((nh * c.v_head_dim, H), "param")
            out[a + "o_proj.weight"] = ((H, nh * c.v_head_dim), "param")
        m = p + moe_prefix(c, i)
        if c.mlp_types[i] == "dense":
            I = c.intermediate_size
            for n in ("gate_proj", "up_proj"):
                out[m + f"{n}.weight"] = ((I, H), "param")
            out[m + "down_proj.weight"] = ((H, I), "param")
            continue
        E, I = c.num_experts, c.moe_intermediate_size
        hin = H if c.latent_size is None else c.latent_size
        out[m + "gate.weight"] = ((E, H), "param")
        out[m + "gate.e_score_correction_bias"] = ((E,), "fp32_buffer")
        for e in range(E):
            out[m + f"experts.{e}.w1.weight"] = ((I, hin), "param")
            out[m + f"experts.{e}.w3.weight"] = ((I, hin), "param")
            out[m + f"experts.{e}.w2.weight"] = ((hin, I), "param")
        if c.num_shared_experts:
            Is = I * c.num_shared_experts
            out[m + "shared_experts.gate_proj.weight"] = ((Is, H), "param")
            out[m + "shared_experts.up_proj.weight"] = ((Is, H), "param")
            out[m + "shared_experts.down_proj.weight"] = ((H, Is), "param")
        if c.latent_size is not None:
            out[m + "routed_expert_down_proj.weight"] = ((c.latent_size, H), "param")
            if c.latent_norm:
                out[m + "routed_expert_norm.weight"] = ((c.latent_size,), "param")
            out[m + "routed_expert_up_proj.weight"] = ((H, c.latent_size), "param")
    out["model.norm.weight"] = ((H,), "param")
    if c.attn_res_block_size is not None:
        out["model.output_attn_res_norm.weight"] = ((H,), "param")
        out["model.output_attn_res_proj.weight"] = ((1, H), "param")
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ((V, H), "param")
    return out
