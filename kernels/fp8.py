"""Blockwise FP8 (DeepSeek-V3 / vLLM ``block_quant`` style): exact reference ops.

Format
------
* Weights ``W[N, K]``: e4m3 (``torch.float8_e4m3fn``, max 448) with one fp32 scale per 128 x 128
  block: ``ws[ceil(N/128), ceil(K/128)]``; ``W ~= Wq * ws`` (the scale is the *dequantisation*
  factor, "inverse scale" in vLLM's words).
* Activations ``x[..., K]``: quantised at run time per 1 x 128 group of each row:
  ``xs[..., ceil(K/128)]``.

Quantisation (both; one definition for learner and engine, CPU and GPU)::

    amax  = max(|v|) over the block / group                  (exact)
    scale = max(amax, 1e-10) / 448                           (fp32, IEEE division: a tensor divisor,
                                                              since torch on CUDA turns ``t / 448.0``
                                                              into ``t * (1 / 448)``)
    q     = clamp(v / scale, -448, 448) -> e4m3              (IEEE division; round to nearest even)

Every step is exact or correctly rounded, so the GPU quantiser (kernels/triton/fp8.py) produces the
same bits as this one (tested), and a row's quantisation depends only on that row (per-token groups):
batch invariant by construction.

GEMM ``y = x @ W.T`` from the quantised operands, K walked in 128-blocks in ascending order::

    acc = 0
    for kb in K blocks:   d = sum_k xq[m, k] * wq[n, k]      (fp32; products of e4m3 are exact)
                          s = xs[m, kb] * ws[n // 128, kb]   (fp32; one product per row and block)
                          acc = acc + d * s                  (separate multiply and add, no FMA)
    y = (acc + bias).to(out_dtype)

Row-parallel form (``k_segments = s > 1``; docs/tp.md "FP8"): K is cut into ``s`` equal segments whose
width is a multiple of 128 (``K % (s * 128) == 0``); each segment's blocks are chained as above into
their own fp32 partial started from zero (:func:`fp8_gemm_partial`), the ``s`` partials are added in
segment order (``kernels.sum_partials``: ``((p0 + p1) + p2) + ...``), then the bias and one rounding
(``kernels.finish_linear``). A TP rank holding segments ``r*s/t .. (r+1)*s/t - 1`` computes exactly
those partials from its K shard (its 1x128 activation groups and 128x128 weight blocks are the full
tensor's, since the shard width is a multiple of 128), so gathered in rank order they give the
one-rank bits. ``k_segments = 1`` is the single chain above, unchanged. Row-parallel layers use
:func:`row_parallel_k_segments` (``ROW_PARALLEL_K_SEGMENTS`` = 8 when ``K % 1024 == 0``, else 1:
such a layer keeps the single chain and cannot be split over TP ranks).

(``d * (xs * ws)``, as DeepGEMM scales, rather than vLLM's Triton ``(d * xs) * ws``: one multiply per
element less in the kernel's promotion step, which runs on the CUDA cores between tensor-core dots.)

This reference sums ``d`` with the fixed adjacent-pair tree of :func:`~kernels._common.tree_sum`
(batch invariant on CPU, like :func:`~kernels.gemm.linear`). The Triton kernel computes ``d`` with
one tensor-core dot per block (FP8 wgmma: its internal order and accumulator width are the
hardware's), so GPU and CPU agree to FP8-GEMM rounding, not bitwise; each is invariant on its own.

Learner side (fake quantisation, as in FP8 training recipes): :func:`fp8_linear` quantises the
activation exactly as the engine does and multiplies by the same quantised weight; its gradient is
the straight-through estimate (``F.linear`` with the dequantised weight), correct to rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._common import with_reference_grad
from .gemm import ROW_PARALLEL_K_SEGMENTS, finish_linear, partial_fp32, sum_partials

__all__ = [
    "FP8_DTYPE", "FP8_MAX", "BLOCK", "ACT_EPS",
    "quantize_weight_blockwise", "quantize_act_groupwise", "dequantize_weight_blockwise",
    "dequantize_act_groupwise", "fp8_gemm", "fp8_gemm_partial", "fp8_linear", "fake_quant_linear",
    "row_parallel_k_segments", "fp8_segments",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
ACT_EPS = 1e-10


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize(v32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (v32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, eps) / 448`` as a true IEEE division on every device (tensor divisor)."""
    return torch.clamp(amax, min=ACT_EPS) / torch.full_like(amax, FP8_MAX)


def quantize_weight_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[N, K]`` (any float dtype, any device) -> ``(wq e4m3 [N, K], ws fp32 [ceil(N/b), ceil(K/b)])``."""
    if w.dim() != 2:
        raise ValueError("quantize_weight_blockwise: w must be [N, K]")
    N, K = w.shape
    nb, kb = _cdiv(N, block), _cdiv(K, block)
    w32 = w.detach().to(torch.float32)
    pad = F.pad(w32, (0, kb * block - K, 0, nb * block - N))  # zeros do not change the amax
    amax = pad.abs().view(nb, block, kb, block).amax(dim=(1, 3))
    ws = _scale(amax)
    full = ws.repeat_interleave(block, 0).repeat_interleave(block, 1)[:N, :K]
    return _quantize(w32, full), ws


def quantize_act_groupwise(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., K]`` -> ``(xq e4m3 [..., K], xs fp32 [..., ceil(K/group)])``, per row and group."""
    K = x.shape[-1]
    g = _cdiv(K, group)
    x32 = x.detach().to(torch.float32)
    pad = F.pad(x32, (0, g * group - K))
    amax = pad.abs().unflatten(-1, (g, group)).amax(dim=-1)
    xs = _scale(amax)
    full = xs.repeat_interleave(group, -1)[..., :K]
    return _quantize(x32, full), xs


def dequantize_weight_blockwise(wq: torch.Tensor, ws: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    N, K = wq.shape
    return wq.to(torch.float32) * ws.repeat_interleave(block, 0).repeat_interleave(block, 1)[:N, :K]


def dequantize_act_groupwise(xq: torch.Tensor, xs: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    K = xq.shape[-1]
    return xq.to(torch.float32) * xs.repeat_interleave(group, -1)[..., :K]


def row_parallel_k_segments(K: int) -> int:
    """K segments of a row-parallel FP8 layer of width ``K``: ``ROW_PARALLEL_K_SEGMENTS`` (8) when
    each segment holds whole 128-wide blocks (``K % 1024 == 0``), else 1 (the single chain: the layer
    then cannot be split over TP ranks bitwise)."""
    s = ROW_PARALLEL_K_SEGMENTS
    return s if K % (s * BLOCK) == 0 else 1


def fp8_segments(K: int, k_segments: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """``[(k0, k1), ...]`` of the ``k_segments`` equal K segments (each a whole number of blocks)."""
    if k_segments < 1 or K % k_segments or (k_segments > 1 and (K // k_segments) % block):
        raise ValueError(f"fp8_gemm: K={K} does not split into k_segments={k_segments} segments of whole "
                         f"{block}-wide blocks (K must be a multiple of k_segments * {block})")
    w = K // k_segments
    return [(i * w, (i + 1) * w) for i in range(k_segments)]


def _chain(x32, xs32, w32, ws_rows, block: int, M: int, N: int, device) -> torch.Tensor:
    """fp32 ``acc`` of the blocks of this K range, chained in ascending order from zero."""
    K = x32.shape[1]
    acc = torch.zeros(M, N, dtype=torch.float32, device=device)
    for i, k0 in enumerate(range(0, K, block)):
        k1 = min(K, k0 + block)
        d = partial_fp32(x32[:, k0:k1], w32[:, k0:k1])  # [M, N] fixed tree over the block
        acc = acc + d * (xs32[:, i : i + 1] * ws_rows[:, i][None, :])
    return acc


def fp8_gemm_partial(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, *,
                     block: int = BLOCK) -> torch.Tensor:
    """fp32 partial (not rounded, no bias) of one K segment: its 128-blocks chained in ascending
    order from zero. ``xq[M, Ks]``, ``xs[M, Ks/128]``, ``wq[N, Ks]``, ``ws[ceil(N/128), Ks/128]``.
    Combine with ``kernels.sum_partials`` (segment order) and ``kernels.finish_linear``."""
    M = xq.shape[0]
    N = wq.shape[0]
    ws_rows = ws.to(torch.float32).repeat_interleave(block, 0)[:N]
    return _chain(xq.to(torch.float32), xs.to(torch.float32), wq.to(torch.float32), ws_rows, block, M, N,
                  xq.device)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
             bias: Optional[torch.Tensor] = None, *, out_dtype: torch.dtype = torch.bfloat16,
             block: int = BLOCK, k_segments: int = 1) -> torch.Tensor:
    """Reference block-scaled GEMM of already quantised operands (see module docstring).

    ``xq[M, K]`` e4m3, ``xs[M, ceil(K/128)]``, ``wq[N, K]`` e4m3, ``ws[ceil(N/128), ceil(K/128)]``.
    ``k_segments > 1``: the row-parallel form (per-segment chains added in segment order)."""
    M, K = xq.shape
    if k_segments != 1:
        N = wq.shape[0]
        ws_rows = ws.to(torch.float32).repeat_interleave(block, 0)[:N]
        x32, w32, xs32 = xq.to(torch.float32), wq.to(torch.float32), xs.to(torch.float32)
        parts = [_chain(x32[:, a:b], xs32[:, a // block:b // block], w32[:, a:b], ws_rows[:, a // block:b // block],
                        block, M, N, xq.device) for a, b in fp8_segments(K, k_segments, block)]
        return finish_linear(sum_partials(parts), bias, out_dtype)
    N = wq.shape[0]
    x32 = xq.to(torch.float32)
    w32 = wq.to(torch.float32)
    ws_rows = ws.to(torch.float32).repeat_interleave(block, 0)[:N]  # [N, kb]
    xs32 = xs.to(torch.float32)
    acc = torch.zeros(M, N, dtype=torch.float32, device=xq.device)
    for i, k0 in enumerate(range(0, K, block)):
        k1 = min(K, k0 + block)
        d = partial_fp32(x32[:, k0:k1], w32[:, k0:k1])  # [M, N] fixed tree over the block
        acc = acc + d * (xs32[:, i : i + 1] * ws_rows[:, i][None, :])
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               out_dtype: Optional[torch.dtype] = None, weight: Optional[torch.Tensor] = None,
               k_segments: int = 1) -> torch.Tensor:
    """``x[..., K]`` -> quantise per 1x128 group -> block-scaled GEMM with ``(wq, ws)`` -> ``[..., N]``.

    Row invariant. Differentiable w.r.t. ``x`` (and ``bias``): straight-through, i.e. the gradient of
    ``F.linear(x, dequantize(wq, ws))``. ``weight``: the high-precision master weight ``(wq, ws)``
    was quantised from (fake-quant training); it does not enter the forward (same bits with or
    without it) and receives the straight-through gradient ``grad_out^T @ x``, as if the linear had
    used the dequantised weight. ``k_segments``: see :func:`fp8_gemm` (row-parallel layers)."""
    K = x.shape[-1]
    N = wq.shape[0]
    odt = out_dtype or (x.dtype if x.dtype != torch.float32 else torch.float32)
    if k_segments != 1:
        fp8_segments(K, k_segments)  # refuse a bad segmentation before any work

    def fwd(x_, b_, w_=None):
        xq, xs = quantize_act_groupwise(x_.reshape(-1, K))
        return fp8_gemm(xq, xs, wq, ws, b_, out_dtype=odt, k_segments=k_segments).reshape(*x_.shape[:-1], N)

    return with_reference_grad(fwd, ste_reference(wq, ws, odt), x, bias, weight)


def ste_reference(wq: torch.Tensor, ws: torch.Tensor, odt: torch.dtype):
    """The plain-torch function whose autograd is fp8_linear's backward (straight-through): the linear
    with the dequantised weight; a master weight ``w_`` enters as ``deq + (w_ - w_.detach())``, which
    adds nothing to the value and gives ``w_`` the gradient the dequantised weight would get."""

    def ref(x_, b_, w_=None):
        w = dequantize_weight_blockwise(wq, ws)
        if w_ is not None:
            w32 = w_.to(torch.float32)
            w = w + (w32 - w32.detach())
        return F.linear(x_.to(torch.float32), w, None if b_ is None else b_.to(torch.float32)).to(odt)

    return ref


def fake_quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                      out_dtype: Optional[torch.dtype] = None, k_segments: int = 1) -> torch.Tensor:
    """Learner side of blockwise FP8 (fake quantisation): quantise the master ``weight[N, K]`` per
    128x128 block now, then :func:`fp8_linear` -- bitwise what an engine computes from the same
    weight quantised once at load. Straight-through gradients to ``x``, ``bias`` and ``weight``."""
    wq, ws = quantize_weight_blockwise(weight)
    return fp8_linear(x, wq, ws, bias, out_dtype=out_dtype, weight=weight, k_segments=k_segments)
