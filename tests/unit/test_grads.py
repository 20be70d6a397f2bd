"""kernels/grads.py: the closed-form backwards the GPU path pairs with its Triton forwards.

On the CPU the forward handed to each function is the exact reference op; its gradient must equal,
to rounding, autograd through that reference (what ``with_reference_grad`` returned before), for
fp32 and bf16 inputs, leading shapes, optional weights and shared experts; and in float64 it must
pass ``torch.autograd.gradcheck`` (the formula itself, not only agreement at one point).
"""

from __future__ import annotations

import pytest
import torch

from kernels import grads
from kernels import logprobs as _lp
from kernels import moe as _moe
from kernels import norm as _norm
from kernels import rope as _rope


def _autograd(ref, inputs, g):
    ins = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    out = ref(*ins)
    out.backward(g)
    return out, [t.grad if t is not None else None for t in ins]


def _ours(fn, inputs, g):
    ins = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*ins)
    out.backward(g)
    return out, [t.grad if t is not None else None for t in ins]


def _close(a, b, dtype):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), **tol)


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 4, 32)])
def test_rms_norm(dtype, with_weight, shape):
    x = _rand(*shape, dtype=dtype, seed=0) * 3
    w = (_rand(shape[-1], dtype=dtype, seed=1) + 1) if with_weight else None
    g = _rand(*shape, dtype=dtype, seed=2)
    ref = lambda x_, w_: _norm.rms_norm(x_, w_, 1e-6)  # noqa: E731
    o_ref, gr = _autograd(ref, [x, w], g)
    o, go = _ours(lambda x_, w_: grads.rms_norm(ref, x_, w_, 1e-6), [x, w], g)
    assert torch.equal(o, o_ref)  # the forward is the one handed in
    for a, b in zip(go, gr):
        if b is not None:
            _close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rot", [32, 16])  # the whole head, or part of it (the rest passes through)
def test_apply_rope(dtype, style, rot):
    T, H, D = 6, 3, 32
    x = _rand(T, H, D, dtype=dtype, seed=3)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * torch.linspace(0.1, 1.0, rot // 2, dtype=torch.float64)
    cos, sin = ang.cos().float(), ang.sin().float()
    g = _rand(T, H, D, dtype=dtype, seed=4)
    ref = lambda x_, c_, s_: _rope.apply_rope(x_, c_, s_, style)  # noqa: E731
    o_ref, (gr,) = _autograd(lambda x_: ref(x_, cos, sin), [x], g)
    o, (go,) = _ours(lambda x_: grads.apply_rope(ref, x_, cos, sin), [x], g)
    assert torch.equal(o, o_ref)
    _close(go, gr, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(dtype):
    a = _rand(7, 48, dtype=dtype, seed=5) * 4
    b = _rand(7, 48, dtype=dtype, seed=6)
    g = _rand(7, 48, dtype=dtype, seed=7)
    o_ref, gr = _autograd(_moe.swiglu, [a, b], g)
    o, go = _ours(lambda a_, b_: grads.swiglu(_moe.swiglu, a_, b_), [a, b], g)
    assert torch.equal(o, o_ref)
    for x, y in zip(go, gr):
        _close(x, y, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_merged_is_swiglu_of_the_halves_with_one_gradient(dtype):
    """The merged [gate | up] form: the forward of the two halves, and the gradient of the merged
    tensor autograd gives through the slices (both halves, leading dims kept)."""
    h = _rand(2, 5, 96, dtype=dtype, seed=8) * 3
    g = _rand(2, 5, 48, dtype=dtype, seed=9)
    o_ref, (gr,) = _autograd(lambda h_: _moe.swiglu(h_[..., :48], h_[..., 48:]), [h], g)
    o, (go,) = _ours(lambda h_: grads.swiglu_merged(_moe.swiglu, h_), [h], g)
    assert torch.equal(o, o_ref) and go.shape == h.shape
    _close(go, gr, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_shared", [0, 1, 2])
def test_moe_combine(dtype, n_shared):
    T, k, H = 5, 4, 24
    y = _rand(T, k, H, dtype=dtype, seed=8)
    w = torch.softmax(_rand(T, k, dtype=torch.float32, seed=9), -1)
    shared = [_rand(T, H, dtype=dtype, seed=10 + i) for i in range(n_shared)]
    g = _rand(T, H, dtype=dtype, seed=20)
    ref = lambda y_, w_, *s_: _moe.moe_combine(y_, w_, list(s_) if s_ else None)  # noqa: E731
    o_ref, gr = _autograd(ref, [y, w, *shared], g)
    o, go = _ours(lambda y_, w_, *s_: grads.moe_combine(ref, y_, w_, s_), [y, w, *shared], g)
    assert torch.equal(o, o_ref)
    for a, b, t in zip(go, gr, [y, w, *shared]):
        _close(a, b, t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs(dtype, temperature):
    logits = _rand(2, 5, 50, dtype=dtype, seed=30) * 3
    targets = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(31))
    targets[0, :2] = 7  # repeated targets
    g = _rand(2, 5, dtype=torch.float32, seed=32)
    ref = lambda l_: _lp.logprobs_from_logits(l_, targets, temperature)  # noqa: E731
    o_ref, (gr,) = _autograd(ref, [logits], g)
    o, (go,) = _ours(lambda l_: grads.logprobs_from_logits(ref, l_, targets, temperature), [logits], g)
    assert torch.equal(o, o_ref)
    _close(go, gr, dtype)


def test_formulas_pass_gradcheck_in_float64():
    """Finite differences against each closed form, with float64 forwards of the same functions
    (the references compute in fp32, too coarse for finite differences)."""
    d = torch.float64
    x = _rand(3, 8, dtype=d, seed=40).requires_grad_()
    w = (_rand(8, dtype=d, seed=41) + 1).requires_grad_()
    nrm = lambda x_, w_: x_ * torch.rsqrt((x_ * x_).mean(-1, keepdim=True) + 1e-6) * w_  # noqa: E731
    assert torch.autograd.gradcheck(lambda x_, w_: grads.rms_norm(nrm, x_, w_, 1e-6), (x, w))
    a = _rand(4, 6, dtype=d, seed=42).requires_grad_()
    b = _rand(4, 6, dtype=d, seed=43).requires_grad_()
    sw = lambda a_, b_: a_ / (1 + torch.exp(-a_)) * b_  # noqa: E731
    assert torch.autograd.gradcheck(lambda a_, b_: grads.swiglu(sw, a_, b_), (a, b))
    hm = _rand(4, 12, dtype=d, seed=48).requires_grad_()
    assert torch.autograd.gradcheck(lambda h_: grads.swiglu_merged(sw, h_), (hm,))
    y = _rand(3, 2, 5, dtype=d, seed=44).requires_grad_()
    wt = _rand(3, 2, dtype=d, seed=45).requires_grad_()
    s = _rand(3, 5, dtype=d, seed=46).requires_grad_()
    comb = lambda y_, w_, s_: (w_.unsqueeze(-1) * y_).sum(1) + s_  # noqa: E731
    assert torch.autograd.gradcheck(lambda y_, w_, s_: grads.moe_combine(comb, y_, w_, [s_]), (y, wt, s))
    lg = _rand(3, 9, dtype=d, seed=47).requires_grad_()
    tg = torch.tensor([1, 4, 4])
    lp = lambda l_: (l_ / 0.7).log_softmax(-1).gather(-1, tg[:, None]).squeeze(-1)  # noqa: E731
    assert torch.autograd.gradcheck(lambda l_: grads.logprobs_from_logits(lp, l_, tg, 0.7), (lg,))
    q = _rand(4, 2, 10, dtype=d, seed=48).requires_grad_()
    ang = _rand(4, 4, dtype=d, seed=49)

    def rope(x_, c_, s_):  # neox over the first 8 of 10 dims, float64
        c_, s_ = c_.unsqueeze(-2), s_.unsqueeze(-2)
        x1, x2 = x_[..., :4], x_[..., 4:8]
        return torch.cat([x1 * c_ - x2 * s_, x2 * c_ + x1 * s_, x_[..., 8:]], -1)

    assert torch.autograd.gradcheck(lambda q_: grads.apply_rope(rope, q_, ang.cos(), ang.sin()), (q,))
