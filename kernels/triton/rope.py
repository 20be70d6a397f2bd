"""Rotary position embedding on the GPU (Triton): elementwise, so exactly per token.

``apply_rope(x[..., H, D], cos, sin, style)`` with ``cos``/``sin`` broadcastable to
``x.shape[:-2] + (r/2,)``; same contract and formula as the CPU reference (kernels/rope.py):

    o1 = x1*c - x2*s ;  o2 = x2*c + x1*s       (fp32, separate IEEE multiplies and adds)

``"neox"``: ``x1 = x[..., :r/2]``, ``x2 = x[..., r/2:r]``; ``"interleaved"``: ``x1 = x[..., 0:r:2]``,
``x2 = x[..., 1:r:2]`` and the output keeps the interleaved layout (vLLM's ``is_neox_style=False``,
MLA's decoupled rope key/query part). Dimensions ``r..D`` pass through unchanged. The result is
rounded once to ``x.dtype``.

The kernel is compiled with ``enable_fp_fusion=False`` (no FMA contraction), so every output element
is the same sequence of correctly rounded fp32 operations as on the CPU: **bitwise equal to the CPU
reference** for the same cos/sin tables (tested), and trivially batch invariant (no reduction).
``rope_cos_sin`` itself is plain float64 torch (per element) and runs on either device.

Any head-strided input is read in place (only the last dim must be contiguous), e.g. the q and k
column blocks of a packed q/k/v GEMM output viewed together as one ``[T, Hq + Hkv, D]`` tensor:
rotating them in one launch is bitwise the two separate calls (each element is its own formula
whatever the grid), which the GPU engine's fast path uses for Qwen2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_rope"]


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, H, HALF, D,
                 sx_t, sx_h, sc_t, so_t, so_h,
                 INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    rj = tl.arange(0, BLOCK_HALF)
    mh = rh < H
    mj = rj < HALF
    c = tl.load(cos_ptr + t * sc_t + rj, mask=mj, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sc_t + rj, mask=mj, other=0.0).to(tl.float32)
    if INTERLEAVED:
        i1 = 2 * rj
        i2 = 2 * rj + 1
    else:
        i1 = rj
        i2 = rj + HALF
    m2 = mh[:, None] & mj[None, :]
    xb = x_ptr + t * sx_t + rh[:, None] * sx_h
    ob = o_ptr + t * so_t + rh[:, None] * so_h
    x1 = tl.load(xb + i1[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(xb + i2[None, :], mask=m2, other=0.0).to(tl.float32)
    o1 = x1 * c[None, :] - x2 * s[None, :]
    o2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(ob + i1[None, :], o1.to(o_ptr.dtype.element_ty), mask=m2)
    tl.store(ob + i2[None, :], o2.to(o_ptr.dtype.element_ty), mask=m2)
    if BLOCK_P > 0:  # pass-through dims r..D
        rp = 2 * HALF + tl.arange(0, BLOCK_P)
        mp = mh[:, None] & (rp[None, :] < D)
        xp = tl.load(xb + rp[None, :], mask=mp, other=0.0)
        tl.store(ob + rp[None, :], xp.to(o_ptr.dtype.element_ty), mask=mp)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox") -> torch.Tensor:
    """Rotate ``x[..., H, D]`` (any strides with a contiguous last dim) -> new tensor, ``x.dtype``.

    No autograd here (``kernels.apply_rope`` adds the reference gradient)."""
    if style not in ("neox", "interleaved"):
        raise ValueError(f"apply_rope: unknown style {style!r} (use 'neox' or 'interleaved')")
    half = cos.shape[-1]
    H, D = x.shape[-2], x.shape[-1]
    if 2 * half > D:
        raise ValueError(f"apply_rope: rotary dim {2 * half} > head dim {D}")
    lead = x.shape[:-2]
    x3 = x.reshape(-1, H, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    T = x3.shape[0]
    c2 = cos.expand(*lead, half).reshape(-1, half)
    s2 = sin.expand(*lead, half).reshape(-1, half)
    if c2.stride(-1) != 1 or s2.stride() != c2.stride():
        c2, s2 = c2.contiguous(), s2.contiguous()
    out = torch.empty(T, H, D, device=x.device, dtype=x.dtype)
    if T and H and D:
        block_half = max(1, triton.next_power_of_2(half))
        block_h = max(1, min(triton.next_power_of_2(H), max(1, 4096 // block_half)))
        p = D - 2 * half
        block_p = triton.next_power_of_2(p) if p > 0 else 0
        grid = (T, triton.cdiv(H, block_h))
        _rope_kernel[grid](x3, c2, s2, out, H, half, D, x3.stride(0), x3.stride(1), c2.stride(0),
                           out.stride(0), out.stride(1), INTERLEAVED=style == "interleaved",
                           BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_P=block_p, num_warps=4,
                           enable_fp_fusion=False)
    return out.reshape(*lead, H, D)
