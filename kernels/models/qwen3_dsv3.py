"""Qwen3-MoE, dense Qwen2 and DeepSeek-V3 (MLA): the aligned per-layer functions both engines run, and a full-sequence reference.

``reference_logprobs(hf_dir_or_state_dict, config, input_ids[B, S], temperature) -> [B, S]`` with
``out[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` and ``out[:, 0] = 0``. Sequences are
right padded (token i at position i); entries at padded positions are meaningless, the entries of
real tokens do not depend on the padding (causal attention, row-invariant kernels).

This module is the contract of "Trainer-Inference Invariance": the vLLM model classes of
``vllm_bridge.aligned`` call *the same* per-layer functions defined here (``qwen3_qkv``,
``dsv3_qkv``, ``moe_qwen3``, ``moe_dsv3``, ``dense_mlp``, ``final_logits``, ...) and differ only in
where the attention keys/values come from (vLLM's paged KV cache, one sequence at a time, via
``kernels.attention``) -- ``kernels.attention`` is bitwise independent of whether the keys are the
prefix only (decode), a chunk's prefix (chunked prefill) or the whole padded sequence (here). So the
logprob vLLM reports for a sampled token is ``torch.equal`` to ``out[:, t]`` of this function.
The CUDA engine's fast path runs :func:`layer_forward_fast` instead of :func:`layer_forward`: the
same values, each residual add merged into the launch of the norm after it (the end-of-layer add
carried into the next layer), so it too is ``torch.equal`` to this reference's.

Numerics (fp32 or bf16 weights, see kernels/README.md): embeddings are a gather; every projection
is ``kernels.linear`` rounded to the activation dtype; norms ``kernels.rms_norm``; RoPE tables in
float64 rounded once (``kernels.rope_cos_sin``); attention ``kernels.attention`` /
``kernels.causal_attention``; routers ``kernels.route``; experts ``kernels.expert_mlp`` and
``kernels.moe_combine`` (slot order); logits ``kernels.linear(..., out_dtype=float32)``, then
``(logits / T).log_softmax(-1, dtype=float32)`` -- the call vLLM's sampler makes with
``logprobs_mode="processed_logprobs"`` (``kernels.logprobs_from_logits``).

Architecture semantics are Hugging Face's (transformers 5.19 Qwen3MoeForCausalLM, Qwen2ForCausalLM
and DeepseekV3ForCausalLM): checked against the transformers forward to ~1e-6 by the tests.

Qwen2 (``arch="qwen2"``, e.g. DeepSeek-R1-Distill-Qwen): dense SwiGLU MLP in every layer, q/k/v
projections WITH biases, no q/k norm, neox RoPE, tied or untied embeddings, head_dim =
hidden_size / num_attention_heads. The bias contract (both engines): ``kernels.linear(x, W, b)``,
i.e. the fp32 K-reduction of the row, plus the bias converted to fp32, rounded once to the
activation dtype -- the GEMM epilogue of every aligned linear (:func:`qwen2_qkv`). o_proj and the
MLP have no bias.

DeepSeek-V3 RoPE layout: with ``rope_interleave=True`` HF rotates the adjacent pairs of the rope
dims and returns them *de-interleaved* (``[o1 (pairs' first), o2 (pairs' second)]``); the q.k dot
product's summation order follows that layout, so we use exactly HF's layout: de-interleave q_pe and
k_pe first (an exact permutation), then the ``"neox"`` rotation. (vLLM's own MLA keeps the
interleaved layout -- same math, different bits.) The learner must use the same layout.
Only ``rope_type: default`` is supported (no YaRN mscale) -- ``arch_config`` raises otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch

import kernels
from kernels.families import FAMILIES, Family, family, hf_family

from .trace import tap, tracing

__all__ = [
    "ArchConfig",
    "arch_config",
    "load_state_dict",
    "reference_logprobs",
    "reference_logits",
    "qwen3_qkv",
    "qwen2_qkv",
    "dsv3_qkv",
    "moe_qwen3",
    "moe_dsv3",
    "dense_mlp",
    "final_logits",
    "layer_forward",
    "layer_forward_fast",
    "carried_residual",
    "final_norm_carried",
    "ExpertShard",
    "FP8_CONFIG_KEY",
    "FP8_SUFFIX",
    "FP8WeightCache",
    "project",
]

# Blockwise FP8 (aligned mode): the checkpoint config key (or hf_overrides entry) that switches it
# on, and the getter suffix under which per-layer functions ask for a projection's quantised
# weight: ``w("self_attn.q_proj.weight" + FP8_SUFFIX) -> (wq e4m3 [N, K], ws fp32 [N/128, K/128])``.
FP8_CONFIG_KEY = "rz_fp8"
FP8_SUFFIX = "#fp8"

Getter = Callable[[str], torch.Tensor]

# the families whose reference numerics this module is (kernels.families: reference)
_OWN_FAMILIES = tuple(f for f in FAMILIES if f.reference == __name__)


@dataclass
class ArchConfig:
    """The fields of a Hugging Face config that the aligned forward needs, normalised."""

    arch: str  # "qwen3_moe" | "qwen2" | "deepseek_v3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    # attention
    head_dim: int = 0  # qwen3: head dim of q/k/v
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # mlp / moe
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    num_experts: int = 0
    top_k: int = 0
    norm_topk_prob: bool = False
    moe_layers: list = field(default_factory=list)  # bool per layer
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    score: str = "softmax"
    has_expert_bias: bool = False
    # "blockwise": every attention projection and dense / shared / routed expert linear is a
    # blockwise FP8 GEMM (kernels.fp8_linear); router gate, lm_head, embeddings and norms are not.
    fp8: str = "none"

    @property
    def family(self) -> Family:
        """The registry entry (kernels.families) of this config's architecture."""
        return family(self.arch)

    @property
    def mla(self) -> bool:
        return self.family.mla

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def attn_v_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def attn_kv_heads(self) -> int:
        """KV heads of the per-head K/V cache (DeepSeek MLA: K/V are expanded per query head)."""
        return self.num_heads if self.mla else self.num_kv_heads

    @property
    def rope_dim(self) -> int:
        """Rotated channels per head (MLA: the rope part only)."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def attn_scale(self) -> float:
        return float(self.qk_head_dim ** (-0.5))


def config_get(cfg: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` set (not None) in a config dict or object, else ``default``."""
    for n in names:
        if isinstance(cfg, Mapping):
            if n in cfg and cfg[n] is not None:
                return cfg[n]
        elif getattr(cfg, n, None) is not None:
            return getattr(cfg, n)
    return default


def _rope(cfg: Any) -> float:
    rp = config_get(cfg, "rope_parameters", "rope_scaling", default=None) or {}
    if isinstance(rp, Mapping):
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype not in (None, "default"):
            raise NotImplementedError(f"aligned forward: rope_type {rtype!r} is not supported (default only)")
        theta = rp.get("rope_theta")
        if theta is not None:
            return float(theta)
    return float(config_get(cfg, "rope_theta", default=10000.0))


def _fp8_mode(config: Any) -> str:
    mode = str(config_get(config, FP8_CONFIG_KEY, default="none"))
    if mode not in ("none", "blockwise"):
        raise ValueError(f"{FP8_CONFIG_KEY}={mode!r}: expected 'none' or 'blockwise'")
    return mode


def arch_config(config: Any) -> ArchConfig:
    """ArchConfig from a transformers PretrainedConfig, a dict (config.json) or a checkpoint dir."""
    if isinstance(config, ArchConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(os.path.join(config, "config.json")) as f:
            config = json.load(f)
    model_type = config_get(config, "model_type", default="")
    archs = config_get(config, "architectures", default=[]) or []
    fam = hf_family(model_type, archs, _OWN_FAMILIES)
    if fam is None:
        raise NotImplementedError(f"aligned forward: unsupported model_type {model_type!r} / {archs}")
    arch = fam.name
    n_layers = int(config_get(config, "num_hidden_layers"))
    common = dict(
        arch=arch,
        hidden_size=int(config_get(config, "hidden_size")),
        num_layers=n_layers,
        num_heads=int(config_get(config, "num_attention_heads")),
        num_kv_heads=int(config_get(config, "num_key_value_heads", "num_attention_heads")),
        vocab_size=int(config_get(config, "vocab_size")),
        rms_norm_eps=float(config_get(config, "rms_norm_eps", default=1e-6)),
        rope_theta=_rope(config),
        tie_word_embeddings=bool(config_get(config, "tie_word_embeddings", default=False)),
        fp8=_fp8_mode(config),
        intermediate_size=int(config_get(config, "intermediate_size", default=0)),
        moe_intermediate_size=int(config_get(config, "moe_intermediate_size", default=0)),
        top_k=int(config_get(config, "num_experts_per_tok", default=0)),
        norm_topk_prob=bool(config_get(config, "norm_topk_prob", default=False)),
    )
    if fam.gqa and fam.moe:  # Qwen3-MoE
        n_exp = int(config_get(config, "num_experts", "num_local_experts", default=0))
        mlp_only = set(config_get(config, "mlp_only_layers", default=[]) or [])
        step = int(config_get(config, "decoder_sparse_step", default=1) or 1)
        moe = [(i not in mlp_only) and n_exp > 0 and (i + 1) % step == 0 for i in range(n_layers)]
        hd = config_get(config, "head_dim", default=None)
        return ArchConfig(
            **common,
            head_dim=int(hd) if hd else common["hidden_size"] // common["num_heads"],
            num_experts=n_exp,
            moe_layers=moe,
            score="softmax",
        )
    if fam.gqa:  # dense Qwen2
        if bool(config_get(config, "use_sliding_window", default=False)):
            raise NotImplementedError("aligned Qwen2: use_sliding_window=true is not supported (full attention only)")
        return ArchConfig(
            **common,
            head_dim=common["hidden_size"] // common["num_heads"],
            moe_layers=[False] * n_layers,
        )
    # deepseek_v3
    topk_method = config_get(config, "topk_method", default="noaux_tc")
    scoring = config_get(config, "scoring_func", default="sigmoid")
    if topk_method != "noaux_tc" or scoring != "sigmoid":
        raise NotImplementedError(f"aligned DeepSeek-V3: topk_method={topk_method}, scoring={scoring} unsupported")
    n_exp = int(config_get(config, "n_routed_experts", default=0))
    first_dense = int(config_get(config, "first_k_dense_replace", default=0))
    moe = [n_exp > 0 and i >= first_dense for i in range(n_layers)]
    return ArchConfig(
        **common,
        q_lora_rank=config_get(config, "q_lora_rank", default=None),
        kv_lora_rank=int(config_get(config, "kv_lora_rank")),
        qk_nope_head_dim=int(config_get(config, "qk_nope_head_dim")),
        qk_rope_head_dim=int(config_get(config, "qk_rope_head_dim")),
        v_head_dim=int(config_get(config, "v_head_dim")),
        rope_interleave=bool(config_get(config, "rope_interleave", default=True)),
        num_experts=n_exp,
        moe_layers=moe,
        n_shared_experts=int(config_get(config, "n_shared_experts", default=0) or 0),
        n_group=int(config_get(config, "n_group", default=1) or 1),
        topk_group=config_get(config, "topk_group", default=None),
        routed_scaling_factor=float(config_get(config, "routed_scaling_factor", default=1.0)),
        score="sigmoid",
        has_expert_bias=True,
    )


# --------------------------------------------------------------------------------------------------
# Per-layer building blocks, shared verbatim with the vLLM model classes.
# `w(name)` returns the layer's weight called `name` (HF name relative to "model.layers.{i}.").
# Activations are [T, H] (tokens flattened); every op below is row-invariant.
# --------------------------------------------------------------------------------------------------


class FP8WeightCache:
    """Blockwise-quantised weights keyed by name, recomputed only when the weight changes: new
    storage, or an in-place op on the tensor (it bumps ``_version``). Writes through ``.data`` do not
    bump it (vLLM's layerwise reload copies that way), so the aligned model also clears the cache in
    ``load_weights``. The engine therefore quantises each weight once per load / in-place update."""

    def __init__(self) -> None:
        self._d: dict = {}

    def get(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stamp = (w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device)
        hit = self._d.get(name)
        if hit is None or hit[0] != stamp:
            with torch.no_grad():
                hit = (stamp, kernels.quantize_weight_blockwise(w.detach()))
            self._d[name] = hit
        return hit[1]

    def clear(self) -> None:
        self._d.clear()

    def getter(self, w: Getter, prefix: str = "") -> Getter:
        """``w`` extended with ``name + FP8_SUFFIX`` -> the cached ``(wq, ws)`` of ``w(name)``."""

        def get(name: str):
            if name.endswith(FP8_SUFFIX):
                base = name[: -len(FP8_SUFFIX)]
                return self.get(prefix + base, w(base))
            return w(name)

        return get


def project(c: ArchConfig, w: Getter, x: torch.Tensor, name: str, *, k_segments: int = 1,
            bias: Optional[str] = None) -> torch.Tensor:
    """``x @ w(name).T`` rounded to ``x.dtype``: one of the projections a block-FP8 checkpoint keeps in
    FP8 (attention projections, dense / shared / routed expert linears). ``c.fp8 == "blockwise"``:
    ``kernels.fp8_linear`` with the quantised weight ``w(name + FP8_SUFFIX)`` (activations quantised
    per 1x128 group inside); a row-parallel caller (``k_segments > 1``) gets the FP8 row-parallel
    form, ``kernels.fp8.row_parallel_k_segments(K)`` chains (8 when K % 1024 == 0, else the single
    chain; docs/tp.md "FP8"); otherwise ``kernels.linear(..., k_segments)``. ``bias``: the name of a bias added in fp32 after
    the K reduction, before the one rounding (Qwen2's q/k/v)."""
    b = None if bias is None else w(bias)
    if c.fp8 == "blockwise":
        wq, ws = w(name + FP8_SUFFIX)
        segs = 1 if k_segments == 1 else fp8_row_segments(x.shape[-1])
        return kernels.fp8_linear(x, wq, ws, b, out_dtype=x.dtype, k_segments=segs)
    return kernels.linear(x, w(name), b, k_segments=k_segments)


def fp8_row_segments(K: int) -> int:
    """K segments of a row-parallel FP8 projection (o_proj, dense-layer down_proj) of width ``K``."""
    from kernels.fp8 import row_parallel_k_segments

    return row_parallel_k_segments(K)


def rope_tables(c: ArchConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.rope_cos_sin(positions, c.rope_dim, c.rope_theta)


def qwen3_qkv(c: ArchConfig, w: Getter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Qwen3(-MoE) attention input: ``x[T, H]`` (already input-layernormed) ->
    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (q/k normed per head, then neox RoPE)."""
    T = x.shape[0]
    D = c.head_dim
    q = project(c, w, x, "self_attn.q_proj.weight").view(T, c.num_heads, D)
    k = project(c, w, x, "self_attn.k_proj.weight").view(T, c.num_kv_heads, D)
    v = project(c, w, x, "self_attn.v_proj.weight").view(T, c.num_kv_heads, D)
    q = kernels.rms_norm(q, w("self_attn.q_norm.weight"), c.rms_norm_eps)
    k = kernels.rms_norm(k, w("self_attn.k_norm.weight"), c.rms_norm_eps)
    q = kernels.apply_rope(q, cos, sin, "neox")
    k = kernels.apply_rope(k, cos, sin, "neox")
    return q, k, v


def qwen2_qkv(c: ArchConfig, w: Getter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Qwen2 attention input: ``x[T, H]`` (already input-layernormed) -> q [T, Hq, D], k [T, Hkv, D],
    v [T, Hkv, D]: biased projections (fp32 accumulate + fp32 bias, one rounding), no q/k norm,
    neox RoPE on q and k."""
    T = x.shape[0]
    D = c.head_dim
    q = project(c, w, x, "self_attn.q_proj.weight", bias="self_attn.q_proj.bias").view(T, c.num_heads, D)
    k = project(c, w, x, "self_attn.k_proj.weight", bias="self_attn.k_proj.bias").view(T, c.num_kv_heads, D)
    v = project(c, w, x, "self_attn.v_proj.weight", bias="self_attn.v_proj.bias").view(T, c.num_kv_heads, D)
    q = kernels.apply_rope(q, cos, sin, "neox")
    k = kernels.apply_rope(k, cos, sin, "neox")
    return q, k, v


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def dsv3_qkv(c: ArchConfig, w: Getter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """DeepSeek-V3 MLA, computed in its expanded (per-head) form: ``x[T, H]`` ->
    q [T, Hq, nope+rope], k [T, Hq, nope+rope], v [T, Hq, v_head_dim]."""
    T = x.shape[0]
    H = c.num_heads
    nope, rope, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    if c.q_lora_rank is None:
        q = project(c, w, x, "self_attn.q_proj.weight")
    else:
        qa = project(c, w, x, "self_attn.q_a_proj.weight")
        qa = kernels.rms_norm(qa, w("self_attn.q_a_layernorm.weight"), c.rms_norm_eps)
        q = project(c, w, qa, "self_attn.q_b_proj.weight")
    q = q.view(T, H, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    ckv = project(c, w, x, "self_attn.kv_a_proj_with_mqa.weight")
    latent, k_pe = ckv[:, : c.kv_lora_rank], ckv[:, c.kv_lora_rank :]
    latent = kernels.rms_norm(latent, w("self_attn.kv_a_layernorm.weight"), c.rms_norm_eps)
    kv = project(c, w, latent, "self_attn.kv_b_proj.weight").view(T, H, nope + dv)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k_pe = k_pe.view(T, 1, rope)
    if c.rope_interleave:
        q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
    q_pe = kernels.apply_rope(q_pe, cos, sin, "neox")
    k_pe = kernels.apply_rope(k_pe, cos, sin, "neox")
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(T, H, rope)], dim=-1)
    return q, k, v.contiguous()


def attn_output(c: ArchConfig, w: Getter, o: torch.Tensor) -> torch.Tensor:
    """o [T, Hq, Dv] -> o_proj -> [T, H]."""
    # o_proj is row-parallel under TP: fixed K segmentation shared with the learner.
    return project(c, w, o.reshape(o.shape[0], -1), "self_attn.o_proj.weight",
                   k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)


def dense_mlp(w: Getter, x: torch.Tensor, prefix: str = "mlp.", c: Optional[ArchConfig] = None, *,
              row_parallel: bool = False) -> torch.Tensor:
    """SwiGLU MLP. ``row_parallel``: this is a dense layer's MLP, whose down_proj is TP row-parallel
    (only matters in FP8, which then uses the row-parallel FP8 form; routed experts are split whole
    over ranks and shared experts replicated, so their FP8 down_proj keeps the single chain)."""
    if c is not None and c.fp8 == "blockwise":  # the same SwiGLU with the three linears in FP8
        g = project(c, w, x, prefix + "gate_proj.weight")
        u = project(c, w, x, prefix + "up_proj.weight")
        return project(c, w, kernels.swiglu(g, u), prefix + "down_proj.weight",
                       k_segments=kernels.ROW_PARALLEL_K_SEGMENTS if row_parallel else 1)
    return kernels.expert_mlp(
        x, w(prefix + "gate_proj.weight"), w(prefix + "up_proj.weight"), w(prefix + "down_proj.weight")
    )


@dataclass
class ExpertShard:
    """Expert parallelism inside one model replica (the aligned vLLM class at tensor parallel > 1):
    this rank holds the experts in ``local``; ``reduce`` sums the ``[T, k, H]`` slot outputs over
    the ranks. Every (token, slot) is computed on exactly one rank and is an exact zero elsewhere,
    so that sum is exact in any order."""

    local: range
    reduce: Callable[[torch.Tensor], torch.Tensor]


def _routed_experts(c: ArchConfig, w: Getter, x: torch.Tensor, ids: torch.Tensor,
                    ep: Optional[ExpertShard] = None) -> torch.Tensor:
    """[T, k, H]: slot j of token t = expert ids[t, j] applied to x[t] (each token an independent row).
    With ``ep`` only the local experts are computed here, then ``ep.reduce`` fills the other slots."""
    T, H = x.shape
    k = ids.shape[1]
    flat = ids.reshape(-1)
    y = x.new_zeros(T * k, H)
    for e in torch.unique(flat).tolist():
        if ep is not None and e not in ep.local:
            continue
        sel = (flat == e).nonzero().squeeze(1)
        tok = torch.div(sel, k, rounding_mode="floor")
        y[sel] = dense_mlp(w, x[tok], f"mlp.experts.{e}.", c)
    y = y.view(T, k, H)
    return y if ep is None else ep.reduce(y)


def moe_qwen3(c: ArchConfig, w: Getter, x: torch.Tensor, ep: Optional[ExpertShard] = None) -> torch.Tensor:
    """Qwen3-MoE sparse block: softmax router (logits rounded like HF's nn.Linear), top-k, optional
    renormalisation; experts combined in slot order."""
    logits = kernels.router_logits(x, w("mlp.gate.weight"), out_dtype=x.dtype)
    ids, wts = kernels.route(logits, c.top_k, score="softmax", norm_topk_prob=c.norm_topk_prob)
    # HF casts the routing weights to the activation dtype before weighting the experts.
    wts = wts.to(x.dtype)
    return kernels.moe_combine(_routed_experts(c, w, x, ids, ep), wts, out_dtype=x.dtype)


def moe_dsv3(c: ArchConfig, w: Getter, x: torch.Tensor, ep: Optional[ExpertShard] = None) -> torch.Tensor:
    """DeepSeek-V3 MoE: fp32 router logits, sigmoid noaux_tc grouped top-k with the score-correction
    bias, renormalised weights times routed_scaling_factor, plus the shared experts."""
    logits = kernels.router_logits(x, w("mlp.gate.weight"), out_dtype=torch.float32)
    ids, wts = kernels.route(
        logits,
        c.top_k,
        score="sigmoid",
        expert_bias=w("mlp.gate.e_score_correction_bias"),
        num_groups=c.n_group,
        group_topk=c.topk_group,
        norm_topk_prob=c.norm_topk_prob,
        scaling_factor=c.routed_scaling_factor,
    )
    shared = dense_mlp(w, x, "mlp.shared_experts.", c) if c.n_shared_experts else None
    return kernels.moe_combine(_routed_experts(c, w, x, ids, ep), wts, shared, out_dtype=x.dtype)


def mlp_forward(c: ArchConfig, w: Getter, layer: int, x: torch.Tensor, ep: Optional[ExpertShard] = None) -> torch.Tensor:
    if not c.moe_layers[layer]:
        return dense_mlp(w, x, c=c, row_parallel=True)
    return moe_qwen3(c, w, x, ep) if c.family.router == "softmax" else moe_dsv3(c, w, x, ep)


def qkv_forward(c: ArchConfig, w: Getter, x: torch.Tensor, cos, sin):
    f = c.family
    if f.qkv_bias:
        return qwen2_qkv(c, w, x, cos, sin)
    return qwen3_qkv(c, w, x, cos, sin) if f.qk_norm else dsv3_qkv(c, w, x, cos, sin)


def layer_forward(
    c: ArchConfig,
    w: Getter,
    layer: int,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    o_proj: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    mlp: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    qkv: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]] = None,
) -> torch.Tensor:
    """One decoder layer on ``h[T, H]``. ``attend(q, k, v) -> o [T, Hq, Dv]`` is the only part that
    differs between this reference (full sequences) and the vLLM model (paged KV cache).

    ``o_proj(o) -> [T, H]`` and ``mlp(x) -> [T, H]`` replace :func:`attn_output` and
    :func:`mlp_forward` (the tensor-parallel vLLM class: row-parallel o_proj, expert-parallel MoE,
    both bitwise these functions); then ``c`` holds the rank's local head counts.
    ``qkv(x, cos, sin) -> (q, k, v)`` replaces :func:`qkv_forward` (the GPU engine's one fused
    q/k/v GEMM: the same K order per element, so the same bits)."""
    x = tap(f"layer{layer}.attn_norm", kernels.rms_norm(h, w("input_layernorm.weight"), c.rms_norm_eps))
    q, k, v = qkv_forward(c, w, x, cos, sin) if qkv is None else qkv(x, cos, sin)
    o = tap(f"layer{layer}.attention", attend(q, k, v))
    delta = tap(f"layer{layer}.attn_out", attn_output(c, w, o) if o_proj is None else o_proj(o))
    # the residual add and the MLP's norm: one launch on the GPU, bitwise the two ops
    h, x = kernels.add_rms_norm(h, delta, w("post_attention_layernorm.weight"), c.rms_norm_eps)
    x = tap(f"layer{layer}.mlp_norm", x)
    y = mlp_forward(c, w, layer, x) if mlp is None else mlp(x)
    return tap(f"layer{layer}.output", h + tap(f"layer{layer}.mlp", y))


Delta = Union[torch.Tensor, "kernels.Unreduced"]


def _tap_delta(name: str, d: Delta) -> None:
    if tracing():  # an unreduced delta is finished for the trace only (the same bits: finish_unreduced)
        tap(name, kernels.finish_unreduced(d))


def layer_forward_fast(
    c: ArchConfig,
    w: Getter,
    layer: int,
    h: torch.Tensor,
    pending: Optional[Delta],
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    o_proj: Optional[Callable[[torch.Tensor], Delta]] = None,
    mlp: Optional[Callable[[torch.Tensor], Delta]] = None,
    qkv: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]] = None,
) -> tuple[torch.Tensor, Delta]:
    """:func:`layer_forward` with the residual add at its end carried into the next layer (the
    CUDA engine's fast path; the learner and the reference run :func:`layer_forward`).

    The layer's input residual is ``h + pending``: ``pending`` is the previous layer's MLP output,
    not yet added (a tensor, or a ``kernels.Unreduced``: a split-mode row-parallel GEMM's partials),
    or None when ``h`` is the residual itself (a stage's first layer). Returns ``(h, y)``: the
    layer's output residual is ``h + y``, left undone. So each residual add is one launch with the
    norm after it (``kernels.add_rms_norm``): the previous layer's ``h + y`` with this layer's input
    norm, and o_proj's output (``kernels.linear_unreduced``, row-parallel segments) with the
    post-attention norm; an unreduced delta's segment sum and bias go into that launch too.
    :func:`carried_residual` and :func:`final_norm_carried` finish the last pending add.

    Bitwise a chain of :func:`layer_forward` calls: every value is the same ops on the same inputs
    (the add: fp32 sum rounded once, as torch's ``h + y``; the norm of the rounded sum; a delta
    summed in segment order as its GEMM's reduce kernel sums it), only the launches merge. ``o_proj``
    / ``mlp`` / ``qkv`` replace the defaults as in :func:`layer_forward` (``o_proj`` and ``mlp``
    may return an Unreduced). The taps record the same names and values (unreduced deltas are
    finished for the trace, only while tracing)."""
    eps = c.rms_norm_eps
    if pending is None:
        x = kernels.rms_norm(h, w("input_layernorm.weight"), eps)
    else:  # the previous layer's last add and this layer's input norm: one launch
        h, x = kernels.add_rms_norm(h, pending, w("input_layernorm.weight"), eps)
    x = tap(f"layer{layer}.attn_norm", x)
    q, k, v = qkv_forward(c, w, x, cos, sin) if qkv is None else qkv(x, cos, sin)
    o = tap(f"layer{layer}.attention", attend(q, k, v))
    if o_proj is not None:
        delta = o_proj(o)
    elif c.fp8 == "none":  # attn_output's linear, its segment sum left to the norm below
        delta = kernels.linear_unreduced(o.reshape(o.shape[0], -1), w("self_attn.o_proj.weight"),
                                         k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)
    else:
        delta = attn_output(c, w, o)
    _tap_delta(f"layer{layer}.attn_out", delta)
    h, x = kernels.add_rms_norm(h, delta, w("post_attention_layernorm.weight"), eps)
    x = tap(f"layer{layer}.mlp_norm", x)
    y = mlp_forward(c, w, layer, x) if mlp is None else mlp(x)
    if tracing():
        yf = kernels.finish_unreduced(y)
        tap(f"layer{layer}.mlp", yf)
        tap(f"layer{layer}.output", h + yf)
    return h, y


def carried_residual(h: torch.Tensor, pending: Optional[Delta]) -> torch.Tensor:
    """The plain residual ``h + pending`` (:func:`layer_forward_fast`'s undone add), e.g. what a
    pipeline stage sends to the next: torch's add of the finished delta, as in :func:`layer_forward`."""
    return h if pending is None else h + kernels.finish_unreduced(pending)


def final_norm_carried(c: ArchConfig, norm_weight: torch.Tensor, h: torch.Tensor,
                       pending: Optional[Delta]) -> torch.Tensor:
    """``final_norm(c, norm_weight, carried_residual(h, pending))`` with the add and the norm in one
    launch (``kernels.add_rms_norm``: bitwise the two ops)."""
    if pending is None:
        return final_norm(c, norm_weight, h)
    return tap("final_norm", kernels.add_rms_norm(h, pending, norm_weight, c.rms_norm_eps)[1])


def final_norm(c: ArchConfig, norm_weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return tap("final_norm", kernels.rms_norm(h, norm_weight, c.rms_norm_eps))


def final_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[T, V]`` (what the aligned vLLM model's compute_logits returns)."""
    return kernels.lm_head_logits(hidden, lm_head_weight, out_dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# The full-sequence reference
# --------------------------------------------------------------------------------------------------


def load_state_dict(hf_dir_or_state_dict: Union[str, os.PathLike, Mapping[str, torch.Tensor]]) -> dict:
    """HF-named tensors (cloned: fresh, aligned storage)."""
    if isinstance(hf_dir_or_state_dict, Mapping):
        return {k: v.detach().clone() for k, v in hf_dir_or_state_dict.items()}
    from safetensors.torch import load_file

    d = os.fspath(hf_dir_or_state_dict)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    sd: dict = {}
    for f in files:
        sd.update({k: v.clone() for k, v in load_file(os.path.join(d, f)).items()})
    return sd


def _lm_head(c: ArchConfig, sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
    if "lm_head.weight" in sd and not c.tie_word_embeddings:
        return sd["lm_head.weight"]
    return sd["model.embed_tokens.weight"]


@torch.no_grad()
def reference_hidden(c: ArchConfig, sd: Mapping[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states [B, S, H] of right-padded sequences."""
    B, S = input_ids.shape
    emb = sd["model.embed_tokens.weight"]
    h = emb[input_ids.reshape(-1).long()]  # [B*S, H], exact gather
    pos = torch.arange(S, device=input_ids.device).repeat(B)  # on the GPU for CUDA inputs (RoPE tables)
    cos, sin = rope_tables(c, pos)
    scale = c.attn_scale

    def attend(q, k, v):
        q4 = q.view(B, S, *q.shape[1:])
        k4 = k.reshape(B, S, *k.shape[1:])
        v4 = v.reshape(B, S, *v.shape[1:])
        return kernels.causal_attention(q4, k4, v4, scale).reshape(B * S, q.shape[1], v.shape[-1])

    fp8 = FP8WeightCache()  # quantised once per call (the engine: once per weight load)
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        w = fp8.getter(lambda n, pre=pre: sd[pre + n], pre)
        h = layer_forward(c, w, i, h, cos, sin, attend)
    h = final_norm(c, sd["model.norm.weight"], h)
    return h.view(B, S, -1)


@torch.no_grad()
def reference_logits(hf_dir_or_state_dict, config, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, S, V]; logits[:, t] predict token t+1."""
    sd = load_state_dict(hf_dir_or_state_dict) if not isinstance(hf_dir_or_state_dict, dict) else hf_dir_or_state_dict
    if config is None and isinstance(hf_dir_or_state_dict, (str, os.PathLike)):
        config = hf_dir_or_state_dict
    c = arch_config(config)
    hidden = reference_hidden(c, sd, input_ids)
    return final_logits(hidden.reshape(-1, hidden.shape[-1]), _lm_head(c, sd)).view(*input_ids.shape, -1)


@torch.no_grad()
def reference_logprobs(
    hf_dir_or_state_dict, config, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """[B, S] fp32: out[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) at ``temperature``
    (log_softmax(logits / T), the sampler's processed logprobs); out[:, 0] = 0.

    ``config``: transformers config, config.json dict, ArchConfig, or None (read from the dir)."""
    input_ids = torch.as_tensor(input_ids).long()
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    logits = reference_logits(hf_dir_or_state_dict, config, input_ids)  # [B, S, V]
    B, S = input_ids.shape
    out = torch.zeros(B, S, dtype=torch.float32, device=logits.device)
    if S > 1:
        lp = kernels.logprobs_from_logits(
            logits[:, :-1].reshape(B * (S - 1), -1), input_ids[:, 1:].reshape(-1), temperature
        )
        out[:, 1:] = lp.view(B, S - 1)
    return out
