"""One entry point per op: the Triton kernel for CUDA tensors, the exact CPU reference otherwise.

``kernels.linear``, ``kernels.rms_norm``, ... resolve to the functions here (kernels/__init__.py).
Signatures are those of the reference ops. For tensors on the CPU (or any non-CUDA device), for
inputs the Triton kernels do not take (float64, mixed operand dtypes), when Triton or CUDA is
missing, or under :func:`set_backend` ``("reference")`` (kernels/settings.py), the call goes to
the reference op unchanged -- so CPU results are bit for bit what they always were.

GPU numerics differ from the CPU reference (other reduction trees), but follow the same contract:
batch invariant on their own. Both sides of a learner/engine pair on GPU must call these same
functions. Differences to keep in mind on CUDA:

* ``linear(..., k_segments=s)`` uses exactly ``s`` K segments on GPU too (never the (K, N)-dependent
  default of ``kernels.triton.default_k_segments``): the segmentation must not depend on N, or a
  column-parallel shard / a merged gate_up weight would change the bits.
* MoE: ``moe_experts`` runs the grouped Triton kernels (gate/up one K segment, down
  ``ROW_PARALLEL_K_SEGMENTS``, 8, the row-parallel contract of docs/tp.md): bitwise the per-expert
  ``expert_mlp`` of this module.
* Gradients: correct to rounding, not invariant. RMSNorm, RoPE, SwiGLU, the MoE combine and the
  token log-probs have closed-form backwards (kernels/grads.py); the linears have their backward
  GEMMs (``kernels.triton.gemm.LinearGrad``), attention FlashAttention's (``_CausalAttention``), the
  grouped MoE grouped GEMMs (kernels/moe_grad.py); the rest (single-sequence ``attention``) the
  autograd of the plain-torch reference (``_common.with_reference_grad``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import os

import torch
import torch.nn.functional as F

from . import attn as _attn
from . import fp8 as _fp8
from . import gemm as _gemm
from . import grads as _grads
from . import logprobs as _lp
from . import moe as _moe
from . import norm as _norm
from . import rope as _rope
from . import router as _router
from ._common import with_reference_grad
from .gemm import ROW_PARALLEL_K_SEGMENTS
from .settings import backend, set_backend

__all__ = [
    "set_backend", "backend", "use_triton",
    "linear", "linear_partial", "linear_unreduced", "finish_unreduced", "Unreduced", "row_partials", "rms_norm",
    "qk_rms_norm",
    "add_rms_norm", "apply_rope", "attention", "causal_attention",
    "varlen_attention", "router_logits", "route", "swiglu", "expert_mlp", "expert_mlp_merged",
    "moe_combine", "moe_experts", "moe_expert_rows", "lm_head_logits", "logprobs_from_logits", "log_softmax",
    "token_logprobs",
    "quantize_act_groupwise", "fp8_gemm", "fp8_gemm_partial", "fp8_row_partials", "fp8_linear",
    "fake_quant_linear",
]

_TRITON_OK: Optional[bool] = None
_GPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _triton_ok() -> bool:
    global _TRITON_OK
    if _TRITON_OK is None:
        from . import triton as _kt

        _TRITON_OK = _kt.available()
    return _TRITON_OK


# Diagnosis only: with TRITON_INTERPRET=1 and RZ_TRITON_ON_CPU=1 every op takes its GPU (Triton) path
# on CPU tensors too, interpreted, in every process that inherits the environment (a CPU `rz check`
# then runs the GPU's kernels on both sides, learner and vLLM worker; slow).
_TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("RZ_TRITON_ON_CPU") == "1"


def use_triton(*tensors: Optional[torch.Tensor]) -> bool:
    """True when the first tensor is on CUDA, the backend is auto and Triton is usable."""
    if backend() != "auto":
        return False
    t = next((t for t in tensors if t is not None), None)
    if t is None:
        return False
    if _TRITON_ON_CPU:
        return True
    return t.is_cuda and _triton_ok()


def _needs_grad(*ts: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _same_float(*ts: Optional[torch.Tensor]) -> bool:
    ds = {t.dtype for t in ts if t is not None}
    return len(ds) == 1 and next(iter(ds)) in _GPU_DTYPES


# --------------------------------------------------------------------------------------- GEMM


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           out_dtype: Optional[torch.dtype] = None, k_segments: int = 1) -> torch.Tensor:
    if not (use_triton(x) and _same_float(x, weight)):
        return _gemm.linear(x, weight, bias, out_dtype=out_dtype, k_segments=k_segments)
    from .triton.gemm import linear as tlinear

    return tlinear(x, weight, bias, out_dtype=out_dtype, k_segments=int(k_segments))


class Unreduced(NamedTuple):
    """A linear layer's output whose K-segment sum is not done yet (:func:`linear_unreduced`):
    ``parts`` the fp32 partials ``[S, M, N]`` of its S segments (contiguous), ``bias`` ([N] or None,
    not yet added), ``dtype`` the output dtype. :func:`add_rms_norm` finishes it inside its own
    launch, :func:`finish_unreduced` on its own; either way bitwise the :func:`linear` output."""

    parts: torch.Tensor
    bias: Optional[torch.Tensor]
    dtype: torch.dtype


def linear_unreduced(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                     k_segments: int = 1) -> Union[torch.Tensor, Unreduced]:
    """``linear(x[M, K], weight, bias, k_segments=k_segments)``, or the same not yet reduced: on
    CUDA, when the GEMM's config for this M is split mode (one program per tile and K segment, then
    a reduce kernel), the partials come back as an :class:`Unreduced` and the reduce launch is left
    to the consumer (``add_rms_norm``: a row-parallel projection feeding a residual add and a norm).
    Otherwise the finished tensor. No autograd (the GPU engine's fast path)."""
    if x.dim() != 2 or not (use_triton(x) and _same_float(x, weight)) or _needs_grad(x, weight, bias):
        return linear(x, weight, bias, k_segments=k_segments)
    from .triton.gemm import matmul_partials

    x2 = x if x.stride(-1) == 1 else x.contiguous()
    with torch.no_grad():
        y, is_parts = matmul_partials(x2, weight, bias, k_segments=int(k_segments))
    return Unreduced(y, bias, x.dtype) if is_parts else y


def finish_unreduced(d: Union[torch.Tensor, Unreduced]) -> torch.Tensor:
    """The finished output of :func:`linear_unreduced`: on CUDA the GEMM's own reduce kernel; for
    partials of the reference backend (none are made in production; tests build them from
    ``row_partials``) the reference ``linear``'s sum, ``finish_linear(sum_partials(parts), bias)``."""
    if not isinstance(d, Unreduced):
        return d
    if use_triton(d.parts):
        from .triton.gemm import reduce_partials

        return reduce_partials(d.parts, d.bias, out_dtype=d.dtype)
    return _gemm.finish_linear(_gemm.sum_partials(list(d.parts.unbind(0))), d.bias, d.dtype)


def linear_partial(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if not (use_triton(x) and _same_float(x, weight)):
        return _gemm.linear_partial(x, weight)
    from .triton.gemm import matmul

    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    with torch.no_grad():
        out = matmul(x2, weight.contiguous() if weight.stride(-1) != 1 else weight, out_dtype=torch.float32,
                     k_segments=1)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def router_logits(hidden: torch.Tensor, gate_weight: torch.Tensor, *,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return linear(hidden, gate_weight, out_dtype=out_dtype)


def lm_head_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, *,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return linear(hidden, lm_head_weight, out_dtype=out_dtype)


# ------------------------------------------------------------------------------------ RMSNorm


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    if not (use_triton(x) and x.dtype in _GPU_DTYPES):
        return _norm.rms_norm(x, weight, eps)
    from .triton.backward import rms_norm_backward
    from .triton.rmsnorm import rms_norm as trms

    if not _needs_grad(x, weight):
        with torch.no_grad():
            return trms(x, weight, eps)
    return _grads.rms_norm(lambda x_, w_: trms(x_, w_, eps), x, weight, eps, bwd=rms_norm_backward)


def qk_rms_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                eps: float = 1e-6) -> torch.Tensor:
    """Qwen3's per-head q and k norms over one ``[T, Hq + Hkv, D]`` view (heads ``< num_q_heads``
    with ``q_weight``): bitwise ``cat(rms_norm(q, q_weight), rms_norm(k, k_weight), dim=1)``; on CUDA
    without gradients one launch (``kernels.triton.rmsnorm.qk_rms_norm``)."""
    if use_triton(qk) and qk.dtype in _GPU_DTYPES and qk.dim() == 3 and qk.stride(-1) == 1 \
            and not _needs_grad(qk, q_weight, k_weight):
        from .triton.rmsnorm import qk_rms_norm as tqk

        with torch.no_grad():
            return tqk(qk, q_weight, k_weight, num_q_heads, eps)
    return torch.cat([rms_norm(qk[:, :num_q_heads], q_weight, eps), rms_norm(qk[:, num_q_heads:], k_weight, eps)], 1)


def add_rms_norm(x: torch.Tensor, delta: Union[torch.Tensor, Unreduced], weight: Optional[torch.Tensor],
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h, weight, eps))`` with ``h = x + delta``: a residual add and the norm after it.
    Bitwise the two ops; on CUDA without gradients one fused launch (``kernels.triton.rmsnorm``).
    ``delta`` may be an :class:`Unreduced` (:func:`linear_unreduced` on CUDA): its segment sum and
    bias are then done in the same launch, bitwise ``x + finish_unreduced(delta)``."""
    if isinstance(delta, Unreduced):
        if (use_triton(x) and x.dtype in _GPU_DTYPES and delta.dtype == x.dtype
                and not _needs_grad(x, weight)):
            from .triton.rmsnorm import add_partials_rms_norm

            with torch.no_grad():
                return add_partials_rms_norm(x, delta.parts, delta.bias, weight, eps)
        delta = finish_unreduced(delta).reshape(x.shape)
    if (use_triton(x) and x.dtype in _GPU_DTYPES and delta.dtype == x.dtype and delta.shape == x.shape
            and not _needs_grad(x, delta, weight)):
        from .triton.rmsnorm import add_rms_norm as tadd

        with torch.no_grad():
            return tadd(x, delta, weight, eps)
    h = x + delta
    return h, rms_norm(h, weight, eps)


# --------------------------------------------------------------------------------------- RoPE


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox") -> torch.Tensor:
    if not (use_triton(x) and x.dtype in _GPU_DTYPES and cos.is_cuda and sin.is_cuda):
        return _rope.apply_rope(x, cos, sin, style)
    from .triton.rope import apply_rope as trope

    if not _needs_grad(x):
        with torch.no_grad():
            return trope(x, cos, sin, style)
    return _grads.apply_rope(lambda x_, c_, s_: trope(x_, c_, s_, style), x, cos, sin)


# ---------------------------------------------------------------------------------- attention


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_positions: torch.Tensor,
              scale: float, *, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if not (use_triton(q) and _same_float(q, k_cache, v_cache)):
        return _attn.attention(q, k_cache, v_cache, q_positions, scale, out_dtype=out_dtype)
    from .triton.attn import attention as tattn

    _attn.check_inputs(q, k_cache, v_cache, q_positions)
    odt = out_dtype or q.dtype
    pos = q_positions.to(torch.long)

    def fwd(q_, k_, v_):
        c = lambda t: t if t.stride(-1) == 1 else t.contiguous()  # noqa: E731
        return tattn(c(q_), c(k_), c(v_), pos, scale, out_dtype=odt)

    return with_reference_grad(fwd, lambda q_, k_, v_: _attn.attention_reference(q_, k_, v_, pos, scale, odt),
                               q, k_cache, v_cache)


def _causal_ref(q, k, v, scale, odt):
    B, S, Hq, D = q.shape
    G = Hq // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(G, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(G, dim=2).transpose(1, 2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
    p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
    return torch.matmul(p, vf).transpose(1, 2).to(odt)


def _causal_grad_ref(q, k, v, scale, odt):
    """The function whose autograd gives causal_attention's backward on the GPU: the same attention
    through torch's fused SDPA in the inputs' dtype (bf16: FlashAttention's forward and backward,
    what a stock trainer runs; fp32: the memory-efficient kernel). O(S) memory instead of the S x S
    probabilities _causal_ref keeps. The forward values the loss sees come from the invariant Triton
    kernel; this recompute only feeds the gradient (run under torch's deterministic mode, so the
    gradient is the same bits run to run: _CausalAttention.backward)."""
    G = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = (k.repeat_interleave(G, dim=2) if G > 1 else k).transpose(1, 2)
    vt = (v.repeat_interleave(G, dim=2) if G > 1 else v).transpose(1, 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    return out.transpose(1, 2).to(odt)


class _CausalAttention(torch.autograd.Function):
    """Forward: the invariant Triton attention. Backward: autograd of :func:`_causal_grad_ref`
    under ``torch.use_deterministic_algorithms(True)`` (FlashAttention's deterministic backward:
    no atomics across key blocks), the global setting restored afterwards."""

    @staticmethod
    def forward(ctx, q, k, v, fwd, scale, odt):  # type: ignore[override]
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.odt = scale, odt
        return fwd(q, k, v)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            with torch.enable_grad():
                ins = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
                out = _causal_grad_ref(*ins, ctx.scale, ctx.odt)
                wrt = [t for t in ins if t.requires_grad]
                grads = iter(torch.autograd.grad(out, wrt, g) if wrt else ())
        finally:
            torch.use_deterministic_algorithms(det, warn_only=warn)
        return (*[next(grads) if t.requires_grad else None for t in ins], None, None, None)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if not (use_triton(q) and _same_float(q, k, v)):
        return _attn.causal_attention(q, k, v, scale, out_dtype=out_dtype)
    from .triton.attn import attention_batched

    B, S, Hq, D = q.shape
    odt = out_dtype or q.dtype
    if B == 0 or S == 0:
        return q.new_empty(B, S, Hq, v.shape[-1], dtype=odt)

    def fwd(q_, k_, v_):
        c = lambda t: t if t.stride(-1) == 1 else t.contiguous()  # noqa: E731
        qq = c(q_).reshape(B * S, Hq, D)
        cu = torch.arange(0, B * S + 1, S, device=q.device, dtype=torch.int32)
        pos = torch.arange(S, device=q.device, dtype=torch.int32).repeat(B)
        o = attention_batched(qq, c(k_), c(v_), cu, pos, scale, max_q_len=S, out_dtype=odt)
        return o.reshape(B, S, Hq, v.shape[-1])

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _CausalAttention.apply(q, k, v, fwd, float(scale), odt)
    with torch.no_grad():
        return fwd(q, k, v)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, scale: float, *,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if not (use_triton(q) and _same_float(q, k, v)):
        return _attn.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out_dtype=out_dtype)
    cq = [int(c) for c in cu_seqlens_q]
    ck = [int(c) for c in cu_seqlens_k]
    outs = []
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if nq > nk:
            raise ValueError(f"varlen_attention: sequence {b} has more queries ({nq}) than keys ({nk})")
        pos = torch.arange(nk - nq, nk, device=q.device)
        outs.append(attention(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], pos, scale,
                              out_dtype=out_dtype))
    if not outs:
        return q.new_empty(0, q.shape[1], v.shape[-1], dtype=out_dtype or q.dtype)
    return torch.cat(outs, dim=0)


# ------------------------------------------------------------------------------------- router


class _RouteWeights(torch.autograd.Function):
    """Forward: the Triton weights; backward: autograd of the reference weight formula at the same ids."""

    @staticmethod
    def forward(ctx, logits, w_fwd, ids, score, norm, sf):  # type: ignore[override]
        ctx.save_for_backward(logits, ids)
        ctx.cfg = (score, norm, sf)
        return w_fwd

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        logits, ids = ctx.saved_tensors
        score, norm, sf = ctx.cfg
        with torch.enable_grad():
            x = logits.detach().float().requires_grad_(True)
            if score == "softmax":
                s = _router.softmax_scores(x)
            elif score == "sigmoid":
                s = _router.sigmoid_scores(x)
            else:  # sqrtsoftplus (DeepSeek-V4)
                from .dsv4 import sqrtsoftplus

                s = sqrtsoftplus(x)
            w = s.gather(1, ids)
            if norm:  # the reference's normaliser (kernels/router.py: + 1e-20 except for softmax)
                d = w.sum(-1, keepdim=True) + (0.0 if score == "softmax" else 1e-20)
                w = w / d
            w = w * sf
            (gx,) = torch.autograd.grad(w, x, g)
        return gx.to(logits.dtype), None, None, None, None, None


def route(logits: torch.Tensor, top_k: int, *, score: str = "softmax", expert_bias: Optional[torch.Tensor] = None,
          num_groups: int = 1, group_topk: Optional[int] = None, norm_topk_prob: bool = False,
          scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(logits):
        return _router.route(logits, top_k, score=score, expert_bias=expert_bias, num_groups=num_groups,
                             group_topk=group_topk, norm_topk_prob=norm_topk_prob, scaling_factor=scaling_factor)
    from .triton.router import route as troute

    ids, w = troute(logits.detach(), top_k, score=score, expert_bias=expert_bias, num_groups=num_groups,
                    group_topk=group_topk, norm_topk_prob=norm_topk_prob, scaling_factor=scaling_factor)
    if torch.is_grad_enabled() and logits.requires_grad:
        w = _RouteWeights.apply(logits, w, ids, score, norm_topk_prob, float(scaling_factor))
    return ids, w


# ---------------------------------------------------------------------------------------- MoE


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not (use_triton(gate) and _same_float(gate, up)):
        return _moe.swiglu(gate, up)
    from .triton.backward import swiglu_backward
    from .triton.moe import swiglu as tswiglu

    if not _needs_grad(gate, up):
        with torch.no_grad():
            return tswiglu(gate, up)
    return _grads.swiglu(tswiglu, gate, up, bwd=swiglu_backward)


def swiglu_merged(h: torch.Tensor) -> torch.Tensor:
    """``swiglu(h[..., :i], h[..., i:])`` of a merged ``[gate | up]`` tensor (``i`` half its last dim):
    the same forward bits; on the GPU path its gradient is one tensor, both halves written by one
    fused launch (kernels.grads.swiglu_merged)."""
    i = h.shape[-1] // 2
    if not (use_triton(h) and _same_float(h)):
        return _moe.swiglu(h[..., :i], h[..., i:])
    from .triton.backward import swiglu_backward
    from .triton.moe import swiglu as tswiglu

    if not _needs_grad(h):
        with torch.no_grad():
            return tswiglu(h[..., :i], h[..., i:])
    return _grads.swiglu_merged(tswiglu, h, bwd=swiglu_backward)


def expert_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return _moe.expert_mlp(x, w_gate, w_up, w_down)
    return linear(swiglu(linear(x, w_gate), linear(x, w_up)), w_down, k_segments=ROW_PARALLEL_K_SEGMENTS)


def expert_mlp_merged(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return _moe.expert_mlp_merged(x, w_gate_up, w_down)
    gu = linear(x, w_gate_up)
    i = w_gate_up.shape[0] // 2
    return linear(swiglu(gu[..., :i], gu[..., i:]), w_down, k_segments=ROW_PARALLEL_K_SEGMENTS)


def moe_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor,
                shared_out: Union[None, torch.Tensor, Sequence[torch.Tensor]] = None, *,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if not use_triton(expert_out):
        return _moe.moe_combine(expert_out, topk_weights, shared_out, out_dtype=out_dtype)
    from .triton.moe import moe_combine as tcombine

    shared = [] if shared_out is None else ([shared_out] if isinstance(shared_out, torch.Tensor) else list(shared_out))

    def fwd(y_, w_, *s_):
        return tcombine(y_, w_, list(s_) if s_ else None, out_dtype=out_dtype)

    if not _needs_grad(expert_out, topk_weights, *shared):
        with torch.no_grad():
            return fwd(expert_out, topk_weights, *shared)
    return _grads.moe_combine(fwd, expert_out, topk_weights, shared)


def moe_experts(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared: Optional[Sequence[Sequence[torch.Tensor]]] = None) -> torch.Tensor:
    if not (use_triton(x) and _same_float(x, w_gate, w_up, w_down)):
        return _moe.moe_experts(x, w_gate, w_up, w_down, topk_ids, topk_weights, shared)
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, w_gate, w_up, w_down, topk_weights))
    shared_out = [expert_mlp(x, *ws) for ws in shared] if shared else None
    if needs_grad:  # differentiable composition of the same per-row chains (bitwise the grouped path)
        T, H = x.shape
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        y = x.new_zeros(T * k, H)
        for e in torch.unique(flat).tolist():
            sel = (flat == e).nonzero().squeeze(1)
            y = y.index_copy(0, sel, expert_mlp(x[sel // k], w_gate[e], w_up[e], w_down[e]))
        return moe_combine(y.view(T, k, H), topk_weights, shared_out, out_dtype=x.dtype)
    from .triton.moe import moe_experts as tmoe

    return tmoe(x, w_gate, w_up, w_down, topk_ids, topk_weights, shared_out, k_segments_down=ROW_PARALLEL_K_SEGMENTS)


def moe_expert_rows(x: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, top_k: int) -> torch.Tensor:
    """Routed-expert outputs per (token, slot) row before the combine (the learner's MoE): row ``r``
    is expert ``ids[r]`` on token ``slots[r] // top_k``; ``w_gate_up[E, 2I, H]``, ``w_down[E, H, I]``.
    Forward: the grouped Triton kernels on CUDA (bitwise the per-expert chains the engine's
    ``moe_experts`` runs), the per-expert reference otherwise. Backward: grouped GEMMs
    (kernels/moe_grad.py)."""
    from . import moe_grad

    if use_triton(x) and _same_float(x, w_gate_up, w_down):
        from .triton.moe import expert_rows as trows

        def fwd(x_, s_, i_, w13_, w2_, k_):
            return trows(x_, torch.div(s_, k_, rounding_mode="floor"), i_, w13_, w2_,
                         k_segments_down=ROW_PARALLEL_K_SEGMENTS)
    else:
        fwd = _moe.expert_rows
    return moe_grad.expert_rows(x, slots, ids, w_gate_up, w_down, top_k, fwd)


# ------------------------------------------------------------------------------------ logprobs


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    if not (use_triton(logits) and logits.dtype in _GPU_DTYPES):
        return _lp.logprobs_from_logits(logits, targets, temperature)
    from .triton.logprobs import logprobs_from_logits as tlp

    if not _needs_grad(logits):
        with torch.no_grad():
            return tlp(logits, targets, temperature)
    return _grads.logprobs_from_logits(lambda l_: tlp(l_, targets, temperature), logits, targets, temperature)


def row_temperature_supported(logits: torch.Tensor) -> bool:
    """Can :func:`log_softmax` / :func:`logprobs_from_logits` take one temperature per row (an fp32
    tensor) with the bits of the float path? On the Triton path yes (the kernels load the row's
    value and divide with ``div_rn``); on the CPU no (torch's scalar and tensor divisions are
    different kernels), so callers group rows by temperature there."""
    return use_triton(logits) and logits.dtype in _GPU_DTYPES


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-probabilities of every column, ``log_softmax(logits.float() / T)``; element [r, t]
    is bitwise :func:`logprobs_from_logits` of target t (CPU: torch's log_softmax; CUDA: the Triton
    kernel with the same reduction). What the aligned engine's sampler reports (no autograd)."""
    if not (use_triton(logits) and logits.dtype in _GPU_DTYPES):
        if not temperature > 0:
            raise ValueError("temperature must be > 0")
        return (logits.to(torch.float32) / temperature).log_softmax(dim=-1, dtype=torch.float32)
    from .triton.logprobs import log_softmax as tlsm

    return tlsm(logits, temperature)


def token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0, *, logits_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if not use_triton(hidden):
        return _lp.token_logprobs(hidden, lm_head_weight, targets, temperature, logits_dtype=logits_dtype)
    logits = lm_head_logits(hidden, lm_head_weight, out_dtype=logits_dtype)
    return logprobs_from_logits(logits, targets, temperature)


# ---------------------------------------------------------------------------------------- FP8


def quantize_act_groupwise(x: torch.Tensor, group: int = _fp8.BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    if not (use_triton(x) and x.dtype in _GPU_DTYPES and group == _fp8.BLOCK):
        return _fp8.quantize_act_groupwise(x, group)
    from .triton.fp8 import quantize_act_groupwise as tq

    return tq(x, group)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
             bias: Optional[torch.Tensor] = None, *, out_dtype: torch.dtype = torch.bfloat16,
             k_segments: int = 1) -> torch.Tensor:
    if not use_triton(xq):
        return _fp8.fp8_gemm(xq, xs, wq, ws, bias, out_dtype=out_dtype, k_segments=k_segments)
    from .triton.fp8 import fp8_gemm as tg

    return tg(xq, xs, wq, ws, bias, out_dtype=out_dtype, k_segments=k_segments)


def fp8_gemm_partial(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """fp32 partial of one K segment (its 128-blocks chained from zero; not rounded, no bias)."""
    if not use_triton(xq):
        return _fp8.fp8_gemm_partial(xq, xs, wq, ws)
    from .triton.fp8 import fp8_gemm as tg

    return tg(xq, xs, wq, ws, None, out_dtype=torch.float32)  # fp32 out, no bias: the chain itself


def row_partials(x: torch.Tensor, weight: torch.Tensor, n_segments: int) -> torch.Tensor:
    """One TP rank of a row-parallel linear (docs/tp.md): ``x[..., Kr]`` the rank's K shard, ``weight``
    its ``[N, Kr]`` shard; the fp32 partials (``linear_partial``) of its ``n_segments`` equal K
    segments, ``[n_segments, ..., N]``, to be gathered in rank order, added with ``sum_partials`` and
    rounded with ``finish_linear``. The unquantised twin of ``fp8_row_partials``."""
    step = x.shape[-1] // n_segments
    return torch.stack([linear_partial(x[..., j * step:(j + 1) * step], weight[:, j * step:(j + 1) * step])
                        for j in range(n_segments)], dim=0)


def fp8_row_partials(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, n_segments: int) -> torch.Tensor:
    """One TP rank of a row-parallel FP8 linear (docs/tp.md "FP8"): ``x[..., Kr]`` (the rank's K shard)
    quantised per 1x128 group, ``(wq, ws)`` the rank's quantised weight shard ``[N, Kr]``; returns the
    fp32 partials of its ``n_segments`` K segments, ``[n_segments, ..., N]``, to be gathered in rank
    order, added with ``sum_partials`` and rounded with ``finish_linear``. No autograd."""
    K = x.shape[-1]
    N = wq.shape[0]
    B = _fp8.BLOCK
    with torch.no_grad():
        xq, xs = quantize_act_groupwise(x.detach().reshape(-1, K))
        parts = [fp8_gemm_partial(xq[:, a:b], xs[:, a // B:b // B], wq[:, a:b], ws[:, a // B:b // B])
                 for a, b in _fp8.fp8_segments(K, n_segments)]
    return torch.stack(parts, dim=0).reshape(n_segments, *x.shape[:-1], N)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               out_dtype: Optional[torch.dtype] = None, weight: Optional[torch.Tensor] = None,
               k_segments: int = 1) -> torch.Tensor:
    if not (use_triton(x) and x.dtype in _GPU_DTYPES):
        return _fp8.fp8_linear(x, wq, ws, bias, out_dtype=out_dtype, weight=weight, k_segments=k_segments)
    from .triton.fp8 import fp8_linear as tl8

    return tl8(x, wq, ws, bias, out_dtype=out_dtype, weight=weight, k_segments=k_segments)


def fake_quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                      out_dtype: Optional[torch.dtype] = None, k_segments: int = 1) -> torch.Tensor:
    """Fake-quant FP8 linear (learner): the master weight quantised per 128x128 block now (the same
    bits on every device), then :func:`fp8_linear`; straight-through gradients to x and the weight.
    ``k_segments``: the row-parallel form (``kernels.fp8.row_parallel_k_segments``)."""
    wq, ws = _fp8.quantize_weight_blockwise(weight)
    return fp8_linear(x, wq, ws, bias, out_dtype=out_dtype, weight=weight, k_segments=k_segments)
