"""Shared building blocks of the exact CPU reference kernels.

Everything here is built from operations whose per-element result does not depend on the shape,
memory layout, thread count or position of the element in its tensor:

* elementwise ``+ - * /``, ``sqrt``, ``exp``, ``log``, ``cos``/``sin`` (float64): IEEE basic ops,
  or transcendental functions whose vectorised and scalar CPU code paths were checked to agree
  bitwise (see README: ``torch.sigmoid``, ``F.silu`` and ``F.softplus`` do NOT agree in fp32 -- up
  to 1 ulp on ~4% of inputs -- and are never used);
* exact selections (``max``, ``sort``, ``gather``, masking);
* :func:`tree_sum`, a reduction whose addition order is fixed by the reduction length alone.

No BLAS call is used in a forward pass: a CPU GEMM's internal order depends on M, N, the thread count
and (for one row) on the weight's alignment.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

# Upper bound on the number of elements of one temporary product tensor (fp32: 16 MiB).
PRODUCT_BUDGET = 1 << 22


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` with a fixed binary tree of adjacent pairs.

    Level by level, element ``2i`` is added to element ``2i+1`` (an odd last element is carried up
    unchanged). The order of additions therefore depends only on the reduction length, and the tree
    is *zero-extension invariant*: appending zeros to the reduced dimension does not change the result
    (up to the sign of an exact zero). That is what makes attention over a prefix equal whether the
    masked keys beyond it are present (prefill) or absent (decode).

    The result keeps ``x.dtype``; call it on fp32 tensors.
    """
    dim = dim % x.dim() if x.dim() else 0
    n = x.shape[dim]
    if n == 0:
        shape = list(x.shape)
        if keepdim:
            shape[dim] = 1
        else:
            shape.pop(dim)
        return x.new_zeros(shape)
    y = x
    while y.shape[dim] > 1:
        m = y.shape[dim]
        even = m - (m % 2)
        pairs = y.narrow(dim, 0, even).unflatten(dim, (even // 2, 2))  # always a view
        s = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
        if m % 2:
            s = torch.cat([s, y.narrow(dim, even, 1)], dim=dim)
        y = s
    return y if keepdim else y.squeeze(dim)


def fold_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Left fold ``((p0 + p1) + p2) + ...`` in list order."""
    if len(parts) == 0:
        raise ValueError("fold_sum needs at least one tensor")
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


class _ReferenceGrad(torch.autograd.Function):
    """Forward = an invariant kernel; backward = autograd of a plain-torch reference."""

    @staticmethod
    def forward(ctx, fwd, ref, *tensors):  # type: ignore[override]
        ctx.ref = ref
        ctx.save_for_backward(*tensors)
        return fwd(*tensors)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            inputs = []
            for t, need in zip(saved, needs):
                if t is None:
                    inputs.append(None)
                else:
                    inputs.append(t.detach().requires_grad_(bool(need)))
            out = ctx.ref(*inputs)
            wrt = [t for t, need in zip(inputs, needs) if t is not None and need]
            grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True) if wrt else ()
        it = iter(grads)
        result = [next(it) if (t is not None and need) else None for t, need in zip(inputs, needs)]
        return (None, None, *result)


def with_reference_grad(
    fwd: Callable[..., torch.Tensor],
    ref: Callable[..., torch.Tensor],
    *tensors: Optional[torch.Tensor],
) -> torch.Tensor:
    """Run ``fwd(*tensors)``; if a gradient is needed, differentiate ``ref`` instead.

    ``ref`` must compute the same function with plain (differentiable) torch ops and return the same
    dtype; gradients are correct to rounding but not batch invariant (they need not be).
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _ReferenceGrad.apply(fwd, ref, *tensors)
    with torch.no_grad():
        return fwd(*tensors)
