"""The closed-form backwards on the GPU (kernels/grads.py behind kernels.rms_norm, apply_rope, swiglu,
moe_combine, logprobs_from_logits on CUDA tensors): forward values are the Triton kernels' (the
no-grad call's bits), gradients agree with autograd through the plain-torch references to bf16 /
fp32 rounding, and each backward is the same bits run to run.

    PYTHONPATH=. python -m pytest tests/gpu/test_grads_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import logprobs as _lp
from kernels import moe as _moe
from kernels import norm as _norm
from kernels import rope as _rope

pytestmark = pytest.mark.gpu


def _r(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


def _grads(fn, inputs, g):
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    out.backward(g)
    return out.detach(), [t.grad for t in ins if t.requires_grad]


def _check(op, ref, inputs, g, dtype):
    with torch.no_grad():
        plain = op(*inputs)
    out, got = _grads(op, inputs, g)
    assert torch.equal(out, plain)  # the Triton forward, whether or not a gradient is taken
    _, again = _grads(op, inputs, g)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    _, want = _grads(ref, inputs, g)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rope_swiglu(dtype):
    T, H, D, I = 300, 1024, 128, 768
    x, w = _r(T, H, dtype=dtype, seed=0, scale=2), _r(H, dtype=dtype, seed=1) + 1
    _check(lambda x_, w_: kernels.rms_norm(x_, w_, 1e-6), lambda x_, w_: _norm.rms_norm(x_, w_, 1e-6), [x, w],
           _r(T, H, dtype=dtype, seed=2), dtype)
    q = _r(T, 8, D, dtype=dtype, seed=3)
    ang = torch.arange(T, device="cuda", dtype=torch.float64)[:, None] * torch.linspace(
        1e-3, 1.0, D // 2, device="cuda", dtype=torch.float64)
    cos, sin = ang.cos().float(), ang.sin().float()
    _check(lambda q_: kernels.apply_rope(q_, cos, sin, "neox"), lambda q_: _rope.apply_rope(q_, cos, sin, "neox"),
           [q], _r(T, 8, D, dtype=dtype, seed=4), dtype)
    a, b = _r(T, I, dtype=dtype, seed=5, scale=3), _r(T, I, dtype=dtype, seed=6)
    _check(kernels.swiglu, _moe.swiglu, [a, b], _r(T, I, dtype=dtype, seed=7), dtype)
    h = _r(2, T, 2 * I, dtype=dtype, seed=14, scale=3)  # merged [gate | up]: one gradient, no slice backward
    _check(kernels.swiglu_merged, lambda h_: _moe.swiglu(h_[..., :I], h_[..., I:]), [h],
           _r(2, T, I, dtype=dtype, seed=15), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_backwards_equal_the_torch_closed_forms(dtype):
    """kernels/triton/backward.py against the torch ops of kernels/grads.py (the same formulas): equal
    to fp32 rounding before the one rounding to the dtype, at the learner's row counts (several rows
    per RMSNorm program, its partial weight gradients summed), and the same bits run to run."""
    from kernels import grads
    from kernels.triton import backward as tb

    T, H, I = 4100, 1536, 1000
    x, w = _r(T, H, dtype=dtype, seed=20, scale=2), _r(H, dtype=dtype, seed=21) + 1
    g = _r(T, H, dtype=dtype, seed=22)
    fused = tb.rms_norm_backward(x, w, g, 1e-6)
    assert all(torch.equal(p, q) for p, q in zip(fused, tb.rms_norm_backward(x, w, g, 1e-6)))
    x_, w_ = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    grads.rms_norm(lambda p, q: kernels.rms_norm(p.detach(), q.detach(), 1e-6), x_, w_, 1e-6).backward(g)
    ulp = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused[0].float(), x_.grad.float(), **ulp)
    torch.testing.assert_close(fused[1].float(), w_.grad.float(), rtol=1e-4 if dtype == torch.float32 else 1e-2, atol=1e-3)
    a, b, gy = _r(T, I, dtype=dtype, seed=23, scale=3), _r(T, I, dtype=dtype, seed=24), _r(T, I, dtype=dtype, seed=25)
    da, db = tb.swiglu_backward(a, b, gy)
    a_, b_ = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    grads.swiglu(lambda p, q: kernels.swiglu(p.detach(), q.detach()), a_, b_).backward(gy)
    torch.testing.assert_close(da.float(), a_.grad.float(), **ulp)
    torch.testing.assert_close(db.float(), b_.grad.float(), **ulp)
    assert all(torch.equal(p, q) for p, q in zip((da, db), tb.swiglu_backward(a, b, gy)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_and_logprobs(dtype):
    T, k, H, V = 257, 8, 512, 32000
    y, s = _r(T, k, H, dtype=dtype, seed=8), _r(T, H, dtype=dtype, seed=9)
    w = torch.softmax(_r(T, k, dtype=torch.float32, seed=10), -1)
    _check(lambda y_, w_, s_: kernels.moe_combine(y_, w_, s_), lambda y_, w_, s_: _moe.moe_combine(y_, w_, s_),
           [y, w, s], _r(T, H, dtype=dtype, seed=11), dtype)
    logits = _r(T, V, dtype=dtype, seed=12, scale=4)
    tg = torch.randint(0, V, (T,), device="cuda")
    g = _r(T, dtype=torch.float32, seed=13)
    for t in (1.0, 0.6):
        _check(lambda l_: kernels.logprobs_from_logits(l_, tg, t), lambda l_: _lp.logprobs_from_logits(l_, tg, t),
               [logits], g, dtype)
