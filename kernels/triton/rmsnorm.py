"""Batch-invariant RMSNorm on the GPU (Triton): one program per row, reduction fixed by D alone.

Same formula as the CPU reference (kernels/norm.py, HF Qwen3/Llama order):

    x32 = x.float(); ms = sum(x32 * x32) / D; inv = 1 / sqrt(ms + eps)      (IEEE div_rn / sqrt_rn)
    y = (x32 * inv).to(x.dtype); out = (y.float() * w.float()).to(x.dtype)

The sum is Triton's tree reduction over one BLOCK_D = next_pow2(D) vector, masked lanes are exact
zeros; BLOCK_D and num_warps are functions of D only, so a row's bits never depend on the number of
rows or on its position. (Not bitwise equal to the CPU tree_sum: the trees differ.) A ``[T, H, D]``
input is read through its strides (e.g. the q / k heads sliced from a fused q/k/v GEMM output), so
no copy is made first; the output is contiguous.

Fused forms (one launch each, no autograd), bitwise the ops they replace:

* :func:`qk_rms_norm`: the q heads and the k heads of one strided ``[T, Hq + Hkv, D]`` view, each
  set with its own weight (Qwen3's q_norm / k_norm), in one launch instead of two;
* :func:`add_rms_norm`: ``h = x + delta`` (fp32 add, one rounding: torch's add), stored, and the
  norm of the rounded ``h``;
* :func:`add_partials_rms_norm`: the same with ``delta`` still the fp32 K-segment partials of a
  row-parallel GEMM in split mode (``kernels.triton.gemm.matmul_partials``): the row's delta is first
  made exactly as the GEMM's reduce kernel makes it (``((0 + p0) + p1) + ...``, ``+ bias`` in fp32,
  one rounding to the dtype), then the add and the norm as :func:`add_rms_norm`.

Every value is the same sequence of IEEE operations as in the unfused kernels: the adds are plain
fp32 adds (nothing to contract into an FMA: no product feeds them), the roundings happen at the same
points, and the norm is one shared row function (:func:`_norm_row`) compiled with the same options,
block and warp count. All three kernels keep Triton's default FMA contraction, so a contraction
inside the norm (the squares feeding the sum) is the same in each.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "qk_rms_norm", "add_rms_norm", "add_partials_rms_norm"]


@triton.jit
def _norm_row(x32, w_ptr, offs, mask, D, eps, out_ty: tl.constexpr, HAS_W: tl.constexpr):
    """The normed row (``out_ty``) of one fp32 row: the whole formula, shared by both kernels."""
    ss = tl.sum(x32 * x32, axis=0)
    ms = tl.math.div_rn(ss, D.to(tl.float32))
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
    y = (x32 * inv).to(out_ty)
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * w).to(out_ty)
    return y


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, N1, stride_x1,
                    HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    # input row ``row`` = (row // N1, row % N1) of a [.., N1, D] view with strides (stride_x, stride_x1)
    x = tl.load(x_ptr + (row // N1) * stride_x + (row % N1) * stride_x1 + offs, mask=mask, other=0.0)
    y = _norm_row(x.to(tl.float32), w_ptr, offs, mask, D, eps, out_ptr.dtype.element_ty, HAS_W)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


@triton.jit
def _qk_rmsnorm_kernel(x_ptr, wq_ptr, wk_ptr, out_ptr, D, stride_x, stride_o, eps, N1, stride_x1, NQ,
                       BLOCK_D: tl.constexpr):
    """_rmsnorm_kernel over the q and k heads of one ``[T, NQ + NK, D]`` view, q heads normed with
    ``wq``, k heads with ``wk``: each row through the same row function, block and warp count."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    head = row % N1
    x = tl.load(x_ptr + (row // N1) * stride_x + head * stride_x1 + offs, mask=mask, other=0.0)
    if head < NQ:
        y = _norm_row(x.to(tl.float32), wq_ptr, offs, mask, D, eps, out_ptr.dtype.element_ty, True)
    else:
        y = _norm_row(x.to(tl.float32), wk_ptr, offs, mask, D, eps, out_ptr.dtype.element_ty, True)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, out_ptr, D, stride_x, stride_d, eps,
                        HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """h = x + d (fp32 add, rounded once to the dtype: torch's ``x + d``), stored; out = the norm
    of the ROUNDED h through the same row function as _rmsnorm_kernel."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
    h = (x.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * D + offs, h, mask=mask)
    y = _norm_row(h.to(tl.float32), w_ptr, offs, mask, D, eps, out_ptr.dtype.element_ty, HAS_W)
    tl.store(out_ptr + row * D + offs, y, mask=mask)


@triton.jit
def _partials_add_rmsnorm_kernel(x_ptr, p_ptr, b_ptr, w_ptr, h_ptr, out_ptr, D, stride_x, stride_ps, stride_pr, eps,
                                 NUM_SEGS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_W: tl.constexpr,
                                 BLOCK_D: tl.constexpr):
    """delta = ((0 + p0) + p1) + ... (+ bias), rounded once to the dtype: what the GEMM's
    _reduce_segments_kernel stores; then _add_rmsnorm_kernel's h = x + delta and its norm."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # unrolled (static_range): every segment's load is in flight at once, where a loop waited for each
    # in turn (8 round trips to memory: 4.6 us a row at batch 1 on an H100); the adds are the same
    # fp32 adds in the same order, ((0 + p0) + p1) + ...
    for s in tl.static_range(0, NUM_SEGS):
        total = total + tl.load(p_ptr + s * stride_ps + row * stride_pr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = total.to(h_ptr.dtype.element_ty)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    h = (x.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * D + offs, h, mask=mask)
    y = _norm_row(h.to(tl.float32), w_ptr, offs, mask, D, eps, out_ptr.dtype.element_ty, HAS_W)
    tl.store(out_ptr + row * D + offs, y, mask=mask)


def _num_warps(block_d: int) -> int:
    return max(1, min(16, block_d // 512))


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (fp32/bf16/fp16, any leading shape); no autograd."""
    D = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1 and x.shape[1] > 0:
        # [T, H, D] heads of a wider row (q / k slices of a fused q/k/v output): read in place, no copy
        x2, n1, s1 = x, x.shape[1], x.stride(1)
    else:
        x2 = x.reshape(-1, D)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n1, s1 = 1, 0
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    R = x.numel() // D if D else 0
    if R and D:
        block_d = triton.next_power_of_2(D)
        _rmsnorm_kernel[(R,)](
            x2, weight if weight is not None else x2, out, D, x2.stride(0), D, float(eps), n1, s1,
            HAS_W=weight is not None, BLOCK_D=block_d, num_warps=_num_warps(block_d))
    return out


def qk_rms_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMSNorm of q and k in one launch: ``qk[T, Hq + Hkv, D]`` (any head/token strides, last
    dim contiguous: the q and k column blocks of a packed q/k/v GEMM output), heads ``< num_q_heads``
    with ``q_weight``, the rest with ``k_weight`` -> a contiguous ``[T, Hq + Hkv, D]``. Bitwise
    ``cat(rms_norm(q, q_weight), rms_norm(k, k_weight), 1)``: the same row function, ``BLOCK_D`` and
    warps as :func:`rms_norm`. No autograd."""
    if qk.dim() != 3 or qk.stride(-1) != 1:
        raise ValueError(f"qk_rms_norm: expected [T, H, D] with a contiguous last dim, got {tuple(qk.shape)} "
                         f"strides {qk.stride()}")
    T, n1, D = qk.shape
    if not 0 < num_q_heads < n1 or q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"qk_rms_norm: {num_q_heads} q heads of {n1}, weights {tuple(q_weight.shape)} / "
                         f"{tuple(k_weight.shape)} for head dim {D}")
    out = torch.empty(T, n1, D, device=qk.device, dtype=qk.dtype)
    if T and D:
        block_d = triton.next_power_of_2(D)
        _qk_rmsnorm_kernel[(T * n1,)](
            qk, q_weight, k_weight, out, D, qk.stride(0), D, float(eps), n1, qk.stride(1), int(num_q_heads),
            BLOCK_D=block_d, num_warps=_num_warps(block_d))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: Optional[torch.Tensor],
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h, weight))`` with ``h = x + delta`` in one launch (a residual add and the next
    norm): bitwise ``h = x + delta`` then :func:`rms_norm` (the same row function over the rounded
    ``h``); one read of each input, no second pass over ``h``. No autograd."""
    if x.shape != delta.shape or x.dtype != delta.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and delta {tuple(delta.shape)} {delta.dtype}")
    D = x.shape[-1]
    x2, d2 = x.reshape(-1, D), delta.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if d2.stride(-1) != 1:
        d2 = d2.contiguous()
    h = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    R = x2.shape[0]
    if R and D:
        block_d = triton.next_power_of_2(D)
        _add_rmsnorm_kernel[(R,)](x2, d2, weight if weight is not None else x2, h, out, D, x2.stride(0), d2.stride(0),
                                  float(eps), HAS_W=weight is not None, BLOCK_D=block_d, num_warps=_num_warps(block_d))
    return h, out


def add_partials_rms_norm(x: torch.Tensor, parts: torch.Tensor, bias: Optional[torch.Tensor],
                          weight: Optional[torch.Tensor], eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` with ``delta`` given as a split-mode GEMM's fp32 partials
    ``parts[nseg, R, D]`` (``kernels.triton.gemm.matmul_partials``; bias not yet added) and its
    ``bias`` ([D] or None): bitwise ``add_rms_norm(x, reduce_partials(parts, bias,
    out_dtype=x.dtype), weight, eps)``, in one launch. ``x``: ``[..., D]`` with ``R`` rows. No autograd."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    if parts.dim() != 3 or tuple(parts.shape[1:]) != (R, D) or parts.dtype != torch.float32 or parts.stride(-1) != 1:
        raise ValueError(f"add_partials_rms_norm: x {tuple(x.shape)} and partials {tuple(parts.shape)} {parts.dtype} "
                         f"(expected fp32 [nseg, {R}, {D}])")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"add_partials_rms_norm: bias {tuple(bias.shape)}, expected ({D},)")
    h = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if R and D:
        block_d = triton.next_power_of_2(D)
        _partials_add_rmsnorm_kernel[(R,)](
            x2, parts, bias if bias is not None else parts, weight if weight is not None else x2, h, out, D,
            x2.stride(0), parts.stride(0), parts.stride(1), float(eps), NUM_SEGS=parts.shape[0],
            HAS_BIAS=bias is not None, HAS_W=weight is not None, BLOCK_D=block_d, num_warps=_num_warps(block_d))
    return h, out
