"""Closed-form backwards of the small ops whose forward is an invariant Triton kernel.

The learner's loss sees the forward values of the Triton kernels (kernels/dispatch.py); their
gradients need not be invariant, only correct to rounding. ``_common.with_reference_grad`` gets them
by re-running a plain-torch reference under autograd in the backward pass: a second forward of
every op plus the autograd graph of it, dozens of small launches per call. The functions here
write each gradient down instead, from the tensors the forward already had:

* ``rms_norm``: ``n = x * r`` with ``r = rsqrt(mean(x^2) + eps)``, ``y = w * n``:
  ``dn = g * w``, ``dx = r * (dn - n * mean(dn * n))``, ``dw = sum(g * n)`` over the rows;
* ``apply_rope``: a rotation is orthogonal, its transpose is the rotation by ``-sin``: the backward
  is the same forward kernel on ``g`` with ``-sin`` (one launch on the GPU);
* ``swiglu``: ``out = silu(a) * b``: ``da = g * b * s * (1 + a * (1 - s))`` with
  ``s = 1 / (1 + exp(-a))``, ``db = g * silu(a)``; ``swiglu_merged`` the same on the two halves of
  one ``[gate | up]`` tensor, its gradient one tensor;
* ``moe_combine``: ``out = sum_j w_j y_j (+ shared)``: ``dy_j = g * w_j``, ``dw_j = <g, y_j>``,
  ``dshared = g``;
* ``logprobs_from_logits``: ``lp = log_softmax(l / T)[target]``:
  ``dl = g / T * (onehot(target) - softmax(l / T))``.

Every backward computes in fp32 and rounds once to the input's dtype (what autograd of the fp32
references returns). ``rms_norm`` and ``swiglu(_merged)`` take an optional ``bwd``: the same formula
fused into one launch (kernels/triton/backward.py, the GPU path), in place of the torch ops. ``fwd`` is the caller's forward (the Triton kernel on the GPU); the tests pass
the CPU references and compare with their autograd (tests/unit/test_grads.py).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["rms_norm", "apply_rope", "swiglu", "swiglu_merged", "moe_combine", "logprobs_from_logits"]

_F32 = torch.float32


def _leading_sum(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, fwd, eps, bwd):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.bwd = eps, bwd
        return fwd(x, weight)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        if ctx.bwd is not None:
            dx, dw = ctx.bwd(x, weight, g, ctx.eps, need_dx=ctx.needs_input_grad[0],
                             need_dw=weight is not None and ctx.needs_input_grad[1])
            return dx, dw, None, None, None
        x32 = x.to(_F32)
        r = torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + ctx.eps)
        n = x32 * r
        g32 = g.to(_F32)
        dw = None
        if weight is not None:
            dn = g32 * weight.to(_F32)
            if ctx.needs_input_grad[1]:  # the forward multiplies w with n rounded to x's dtype
                dw = _leading_sum(g32 * n.to(x.dtype).to(_F32)).to(weight.dtype)
        else:
            dn = g32
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (r * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None, None, None


def rms_norm(fwd: Callable, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
             bwd: Optional[Callable] = None) -> torch.Tensor:
    """``fwd(x, weight)`` (RMSNorm over the last dim) with the closed-form backward; ``bwd``: a fused
    form of it, ``bwd(x, weight, g, eps, need_dx=, need_dw=) -> (dx, dw)`` (the GPU's:
    kernels.triton.backward.rms_norm_backward), else the torch ops above."""
    return _RMSNorm.apply(x, weight, fwd, float(eps), bwd)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, cos, sin):  # type: ignore[override]
        ctx.fwd, ctx.cos, ctx.sin = fwd, cos, sin
        return fwd(x, cos, sin)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return ctx.fwd(g.contiguous(), ctx.cos, -ctx.sin), None, None, None


def apply_rope(fwd: Callable, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``fwd(x, cos, sin)`` (a rotation, identity past the rotary dims); backward ``fwd(g, cos, -sin)``.
    ``cos`` / ``sin`` take no gradient (tables)."""
    return _Rope.apply(x, fwd, cos, sin)


def _swiglu_grads(a, b, g, need_da: bool, need_db: bool):
    a32, b32, g32 = a.to(_F32), b.to(_F32), g.to(_F32)
    s = 1.0 / (1.0 + torch.exp(-a32))
    da = (g32 * b32 * s * (1.0 + a32 * (1.0 - s))).to(a.dtype) if need_da else None
    db = (g32 * (a32 * s)).to(b.dtype) if need_db else None
    return da, db


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, fwd, bwd):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.bwd = bwd
        return fwd(a, b)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        a, b = ctx.saved_tensors
        need = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.bwd is not None:
            da, db = ctx.bwd(a, b, g, need_da=need[0], need_db=need[1])
        else:
            da, db = _swiglu_grads(a, b, g, *need)
        return da, db, None, None


def swiglu(fwd: Callable, gate: torch.Tensor, up: torch.Tensor, bwd: Optional[Callable] = None) -> torch.Tensor:
    """``fwd(gate, up)`` = ``silu(gate) * up`` with the closed-form backward; ``bwd``: a fused form of
    it, ``bwd(a, b, g, da=None, db=None, need_da=, need_db=) -> (da, db)`` (the GPU's:
    kernels.triton.backward.swiglu_backward), else the torch ops above."""
    return _SwiGLU.apply(gate, up, fwd, bwd)


class _SwiGLUMerged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, fwd, bwd):  # type: ignore[override]
        ctx.save_for_backward(h)
        ctx.bwd = bwd
        i = h.shape[-1] // 2
        return fwd(h[..., :i], h[..., i:])

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (h,) = ctx.saved_tensors
        i = h.shape[-1] // 2
        if ctx.bwd is None:
            return torch.cat(_swiglu_grads(h[..., :i], h[..., i:], g, True, True), dim=-1), None, None
        dh = torch.empty(h.shape, device=h.device, dtype=h.dtype)
        ctx.bwd(h[..., :i], h[..., i:], g, dh[..., :i], dh[..., i:])
        return dh, None, None


def swiglu_merged(fwd: Callable, h: torch.Tensor, bwd: Optional[Callable] = None) -> torch.Tensor:
    """``fwd(h[..., :i], h[..., i:])`` (``silu(gate) * up`` of a merged ``[gate | up]`` tensor, ``i``
    half its last dim) with the closed-form backward as ONE gradient of ``h``: ``bwd`` writes both
    halves in place (no slice backward: a zero fill, a copy and an add of the whole ``h`` per half)."""
    return _SwiGLUMerged.apply(h, fwd, bwd)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, fwd, *shared):  # type: ignore[override]
        ctx.save_for_backward(y, w)
        ctx.shared_dtypes = [s.dtype for s in shared]
        return fwd(y, w, *shared)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        y, w = ctx.saved_tensors
        g32 = g.to(_F32)
        dy = dw = None
        if ctx.needs_input_grad[0]:
            dy = (g32.unsqueeze(1) * w.to(_F32).unsqueeze(2)).to(y.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.einsum("th,tkh->tk", g32, y.to(_F32)).to(w.dtype)
        ds = [g32.to(dt) if need else None for dt, need in zip(ctx.shared_dtypes, ctx.needs_input_grad[3:])]
        return (dy, dw, None, *ds)


def moe_combine(fwd: Callable, expert_out: torch.Tensor, topk_weights: torch.Tensor,
                shared: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """``fwd(expert_out[T, k, H], topk_weights[T, k], *shared[T, H])`` = the weighted slot sum plus
    the shared outputs, with the closed-form backward."""
    return _Combine.apply(expert_out, topk_weights, fwd, *shared)


class _Logprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, fwd, temperature):  # type: ignore[override]
        ctx.save_for_backward(logits, targets)
        ctx.t = temperature
        return fwd(logits)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        logits, targets = ctx.saved_tensors
        t = ctx.t
        z = logits.to(_F32) / t
        p = torch.softmax(z, dim=-1)
        gt = g.to(_F32).unsqueeze(-1) / t
        d = p.mul_(-gt)
        d.scatter_add_(-1, targets.to(torch.long).unsqueeze(-1), gt)
        return d.to(logits.dtype), None, None, None


def logprobs_from_logits(fwd: Callable, logits: torch.Tensor, targets: torch.Tensor,
                         temperature: float) -> torch.Tensor:
    """``fwd(logits)`` = fp32 ``log_softmax(logits / T)[targets]`` with the closed-form backward."""
    return _Logprobs.apply(logits, targets, fwd, float(temperature))
