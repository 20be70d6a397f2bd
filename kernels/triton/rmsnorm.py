"""Batch-invariant RMSNorm on the GPU (Triton): one program per row, reduction fixed by D alone.

Same formula as the CPU reference (kernels/norm.py, HF Qwen3/Llama order):

    x32 = x.float(); ms = sum(x32 * x32) / D; inv = 1 / sqrt(ms + eps)      (IEEE div_rn / sqrt_rn)
    y = (x32 * inv).to(x.dtype); out = (y.float() * w.float()).to(x.dtype)

The sum is Triton's tree reduction over one BLOCK_D = next_pow2(D) vector, masked lanes are exact
zeros; BLOCK_D and num_warps are functions of D only, so a row's bits never depend on the number of
rows or on its position. (Not bitwise equal to the CPU tree_sum: the trees differ.)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm"]


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps,
                    HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    ss = tl.sum(x32 * x32, axis=0)
    ms = tl.math.div_rn(ss, D.to(tl.float32))
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
    y = (x32 * inv).to(out_ptr.dtype.element_ty)
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _num_warps(block_d: int) -> int:
    return max(1, min(16, block_d // 512))


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (fp32/bf16/fp16, any leading shape); no autograd."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    R = x2.shape[0]
    if R and D:
        block_d = triton.next_power_of_2(D)
        _rmsnorm_kernel[(R,)](
            x2, weight if weight is not None else x2, out, D, x2.stride(0), out.stride(0), float(eps),
            HAS_W=weight is not None, BLOCK_D=block_d, num_warps=_num_warps(block_d))
    return out.reshape(x.shape)
