"""The learner's routed experts: the invariant forward per (token, slot) row, a grouped-GEMM backward.

``expert_rows(x, slots, ids, w_gate_up, w_down, top_k, fwd)``: row ``r`` is expert ``ids[r]``'s
SwiGLU MLP on token ``slots[r] // top_k`` (``slots``: flat ``token * top_k + slot`` positions,
strictly increasing). The forward is ``fwd`` -- the Triton grouped kernels on CUDA
(``kernels.triton.moe.expert_rows``), the per-expert reference on the CPU (``kernels.moe.expert_rows``)
-- so the learner's bits are the rollout engine's. The backward is a linear layer's: the rows sorted
by expert once, then grouped GEMMs (``torch._grouped_mm``: one launch for all experts, fp32
accumulation in the weight dtype, cuBLAS/CUTLASS on Hopper) for the gate/up recompute, the input and
the weight gradients, SwiGLU's derivative in fp32. No host sync on CUDA, nothing of the invariant
forward run again, and deterministic: the input gradient of a token adds its slots' rows in a fixed
order (a [T, k] buffer summed over k), never by atomics.

Replaces a Python loop over experts (one ``nonzero()`` host sync per expert per layer, and three
autograd GEMMs per expert in the backward). Where ``torch._grouped_mm`` does not take the operands
(an old torch, a dtype or layout it refuses), the same products run as one ``torch.mm`` per expert
(``GROUPED_MM["fallback"]`` counts those calls).
"""

from __future__ import annotations

from typing import Callable

import torch

# how many grouped products ran through torch._grouped_mm / the per-expert fallback (benchmarks read it)
GROUPED_MM = {"grouped": 0, "fallback": 0}


def _fallback_3d(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a[R, K]`` rows of group g times ``b[g]`` ([K, N]) -> ``[R, N]``."""
    ends = offs.tolist()
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = torch.mm(a[start:end], b[g])
        start = end
    return out


def _fallback_2d(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a[M, R]`` x ``b[R, N]`` summed over each group's R range -> ``[G, M, N]`` (zeros for empty groups)."""
    ends = offs.tolist()
    out = a.new_zeros(len(ends), a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[g] = torch.mm(a[:, start:end], b[start:end])
        start = end
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: ``a[R, K]`` x ``b[G, K, N]`` -> ``[R, N]`` (rows of group
    g = ``offs[g-1]:offs[g]``), or ``a[M, R]`` x ``b[R, N]`` -> ``[G, M, N]`` (R split by ``offs``)."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is not None:
        try:
            out = fn(a, b, offs=offs)
            GROUPED_MM["grouped"] += 1
            return out
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            pass
    GROUPED_MM["fallback"] += 1
    return _fallback_3d(a, b, offs) if b.dim() == 3 else _fallback_2d(a, b, offs)


def _silu_mul_grad(g: torch.Tensor, u: torch.Tensor, d: torch.Tensor):
    """d/dg and d/du of ``silu(g) * u`` at upstream ``d``, in fp32, rounded to g's dtype."""
    g32, u32, d32 = g.float(), u.float(), d.float()
    s = torch.sigmoid(g32)
    act_g = g32 * s
    du = d32 * act_g
    dg = d32 * u32 * s * (1.0 + g32 * (1.0 - s))
    return dg.to(g.dtype), du.to(u.dtype), (act_g * u32).to(g.dtype)


class _ExpertRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, slots, ids, top_k, fwd):  # type: ignore[override]
        ctx.save_for_backward(x, w_gate_up, w_down, slots, ids)
        ctx.top_k = int(top_k)
        with torch.no_grad():
            return fwd(x, slots, ids, w_gate_up, w_down, int(top_k))

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, w13, w2, slots, ids = ctx.saved_tensors
        k = ctx.top_k
        T, H = x.shape
        E, I2, _ = w13.shape
        I = I2 // 2
        dt = w13.dtype
        ids_l = ids.long()
        order = torch.sort(ids_l, stable=True)[1]
        offs = torch.cumsum(torch.bincount(ids_l, minlength=E), 0).to(torch.int32)
        tok = torch.div(slots.long(), k, rounding_mode="floor")
        xs = x[tok[order]].to(dt)  # [R, H], rows sorted by expert
        dys = dy[order].to(dt)  # [R, H]
        gu = grouped_mm(xs, w13.transpose(1, 2), offs)  # recompute [R, 2I]
        d_act = grouped_mm(dys, w2, offs)  # [R, I]
        dg, du, act = _silu_mul_grad(gu[:, :I], gu[:, I:], d_act)
        d_gu = torch.cat([dg, du], dim=1)  # [R, 2I]
        dw2 = dw13 = dx = None
        if ctx.needs_input_grad[2]:
            dw2 = grouped_mm(dys.t(), act, offs)  # [E, H, I]
        if ctx.needs_input_grad[1]:
            dw13 = grouped_mm(d_gu.t(), xs, offs)  # [E, 2I, H]
        if ctx.needs_input_grad[0]:
            dxs = grouped_mm(d_gu, w13, offs)  # [R, H]
            rows = torch.empty_like(dxs)
            rows[order] = dxs  # back to slot order (a permutation: exact)
            buf = torch.zeros(T * k, H, device=x.device, dtype=torch.float32)
            buf.index_copy_(0, slots.long(), rows.float())  # unique positions: deterministic
            dx = buf.view(T, k, H).sum(1).to(x.dtype)  # a token's slots added in slot order
        return dx, dw13, dw2, None, None, None, None


def expert_rows(x: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, top_k: int, fwd: Callable) -> torch.Tensor:
    """``[R, H]`` routed-expert rows (see the module docstring); differentiable in x and the weights."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w_gate_up, w_down)):
        return _ExpertRows.apply(x, w_gate_up, w_down, slots, ids, top_k, fwd)
    with torch.no_grad():
        return fwd(x, slots, ids, w_gate_up, w_down, int(top_k))
