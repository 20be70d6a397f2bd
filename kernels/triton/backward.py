"""Fused backwards on the GPU (Triton) of the row / elementwise ops whose closed form is in
kernels/grads.py: one launch each, instead of a dozen fp32 elementwise launches and their
temporaries.

* :func:`swiglu_backward`: ``out = silu(a) * b``; per element, in fp32,
  ``s = 1 / (1 + exp(-a))``, ``da = g * b * s * (1 + a * (1 - s))``, ``db = g * (a * s)``, each
  rounded once to its output's dtype. ``a`` / ``b`` / ``da`` / ``db`` are read and written through
  their row strides, so the two halves of a merged ``[gate | up]`` GEMM output, and of its gradient,
  need no copy and no slice backward (:func:`kernels.grads.swiglu_merged`).
* :func:`rms_norm_backward`: ``n = x * r``, ``r = 1 / sqrt(mean(x^2) + eps)``, ``y = w * n``:
  ``dn = g * w``, ``dx = r * (dn - n * mean(dn * n))`` per row; ``dw = sum_rows(g * n_rounded)``
  (the forward multiplies ``w`` with ``n`` rounded to x's dtype). Each program takes a fixed run of
  rows and writes its fp32 partial of ``dw``; the partials are summed by one ``torch.sum`` over a
  fixed number of programs.

Gradients need not be batch invariant (only the forward feeds the rollout's bits); they are
deterministic: the grid, the rows per program and every reduction order are functions of the
shapes alone, and no atomics are used. They agree with the torch closed forms to fp32 rounding
(tests/unit/test_triton_interpret.py, tests/gpu/test_grads_gpu.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["swiglu_backward", "rms_norm_backward"]

# rows of the RMSNorm backward per program: about this many programs, whatever the row count
_RMS_PROGRAMS = 1024


@triton.jit
def _swiglu_bwd_kernel(a_ptr, b_ptr, g_ptr, da_ptr, db_ptr, N, sa, sb, sg, sda, sdb,
                       NEED_DA: tl.constexpr, NEED_DB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    a = tl.load(a_ptr + row * sa + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * sg + offs, mask=m, other=0.0).to(tl.float32)
    # tl.exp, not the forwards' libdevice exp: a gradient needs fp32 accuracy, not the forward's bits
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-a))
    if NEED_DA:
        b = tl.load(b_ptr + row * sb + offs, mask=m, other=0.0).to(tl.float32)
        da = g * b * s * (1.0 + a * (1.0 - s))
        tl.store(da_ptr + row * sda + offs, da.to(da_ptr.dtype.element_ty), mask=m)
    if NEED_DB:
        db = g * (a * s)
        tl.store(db_ptr + row * sdb + offs, db.to(db_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, last]`` view with unit column stride (a copy only where no such view exists)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _out_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """An output as a 2-D row-strided VIEW (the kernel writes through it): refused where none exists."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.numel() and (t2.stride(-1) != 1 or t2.data_ptr() != t.data_ptr()):
        raise ValueError(f"swiglu_backward: {name} must be viewable as rows with a unit column stride")
    return t2


def swiglu_backward(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, da: Optional[torch.Tensor] = None,
                    db: Optional[torch.Tensor] = None, *, need_da: bool = True,
                    need_db: bool = True) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of ``silu(a) * b`` for the output gradient ``g`` (same shape as ``a``). ``da`` /
    ``db``: where to write them (any row-strided 2-D-viewable tensors of ``a``'s shape, e.g. the halves
    of one merged gradient buffer); allocated like ``a`` / ``b`` when None. Returns ``(da, db)``,
    None for a gradient not asked for."""
    N = a.shape[-1]
    a2, b2, g2 = _rows(a), _rows(b), _rows(g)
    if need_da and da is None:
        da = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    if need_db and db is None:
        db = torch.empty(b.shape, device=b.device, dtype=b.dtype)
    da2 = _out_rows(da, "da") if need_da else a2
    db2 = _out_rows(db, "db") if need_db else a2
    R = a2.shape[0]
    if R and N and (need_da or need_db):
        block = min(1024, triton.next_power_of_2(N))
        _swiglu_bwd_kernel[(R, triton.cdiv(N, block))](
            a2, b2, g2, da2, db2, N, a2.stride(0), b2.stride(0), g2.stride(0), da2.stride(0), db2.stride(0),
            NEED_DA=need_da, NEED_DB=need_db, BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return (da if need_da else None), (db if need_db else None)


@triton.jit
def _rms_bwd_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, dwp_ptr, R, D, sx, sg, eps, ROWS,
                    HAS_W: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    cm = offs < D
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=cm, other=0.0).to(tl.float32)
    else:
        w = tl.full((BLOCK_D,), 1.0, tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    d32 = D.to(tl.float32)
    for i in range(0, ROWS):
        row = pid * ROWS + i
        m = offs < tl.where(row < R, D, 0)  # the columns of a real row, none past the last row
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
        x32 = x.to(tl.float32)
        g = tl.load(g_ptr + row * sg + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(x32 * x32, axis=0), d32) + eps))
        n = x32 * r
        if NEED_DW:
            dw += g * n.to(x.dtype).to(tl.float32)
        if NEED_DX:
            dn = g * w
            c = tl.math.div_rn(tl.sum(dn * n, axis=0), d32)
            dx = r * (dn - n * c)
            tl.store(dx_ptr + row * D + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
    if NEED_DW:
        tl.store(dwp_ptr + pid * D + offs, dw, mask=cm)


def rms_norm_backward(x: torch.Tensor, weight: Optional[torch.Tensor], g: torch.Tensor, eps: float, *,
                      need_dx: bool = True, need_dw: bool = True) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dx, dw)`` of RMSNorm over the last dim (``dw`` None without a weight or when not asked for)."""
    D = x.shape[-1]
    x2, g2 = _rows(x), _rows(g)
    R = x2.shape[0]
    need_dw = need_dw and weight is not None
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype) if need_dx else None
    if not (R and D) or not (need_dx or need_dw):
        dw = torch.zeros_like(weight) if need_dw else None
        return dx, dw
    rows = triton.cdiv(R, _RMS_PROGRAMS)
    progs = triton.cdiv(R, rows)
    dwp = torch.empty(progs, D, device=x.device, dtype=torch.float32) if need_dw else x2
    block_d = triton.next_power_of_2(D)
    _rms_bwd_kernel[(progs,)](
        x2, weight if weight is not None else x2, g2, dx if need_dx else x2, dwp, R, D, x2.stride(0), g2.stride(0),
        float(eps), rows, HAS_W=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw, BLOCK_D=block_d,
        num_warps=max(4, min(16, block_d // 256)), enable_fp_fusion=False)
    dw = dwp.sum(0).to(weight.dtype) if need_dw else None
    return dx, dw
