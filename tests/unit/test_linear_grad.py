"""The GPU linear's backward (kernels.triton.gemm.LinearGrad): a linear layer's two GEMMs on the
saved inputs, nothing of the forward run again. Checked on the CPU with a plain forward in its
place: in fp32 its gradients are bitwise autograd's through F.linear (the same two matmuls); in
bf16 they are the bf16 GEMMs of the incoming gradient rounded to bf16 (Megatron's own layers), and
the forward's output is whatever ``fwd`` returned."""

import torch
import torch.nn.functional as F

from kernels.triton.gemm import LinearGrad


def _fwd(x, w, b):
    return F.linear(x, w, b)


def test_fp32_grads_equal_autograd_of_f_linear():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g)
    w = torch.randn(8, 16, generator=g)
    b = torch.randn(8, generator=g)
    dy = torch.randn(3, 5, 8, generator=g)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    F.linear(*ref).backward(dy)
    got = [t.clone().requires_grad_() for t in (x, w, b)]
    y = LinearGrad.apply(got[0], got[1], got[2], _fwd)
    assert torch.equal(y, F.linear(x, w, b))
    y.backward(dy)
    for r, t in zip(ref, got):
        assert torch.equal(r.grad, t.grad)


def test_bf16_weights_fp32_output_gradient_rounded_once_no_bias():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 32, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(12, 32, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(7, 12, generator=g)  # fp32, as an fp32-output lm_head receives it

    def fwd32(x_, w_, b_):
        return F.linear(x_.float(), w_.float())

    y = LinearGrad.apply(x, w, None, fwd32)
    assert y.dtype == torch.float32
    y.backward(dy)
    gl = dy.to(torch.bfloat16)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, gl @ w.detach())
    assert torch.equal(w.grad, gl.t() @ x.detach())


def test_only_the_needed_gradients():
    x = torch.randn(4, 8)
    w = torch.randn(3, 8, requires_grad=True)
    LinearGrad.apply(x, w, None, _fwd).sum().backward()
    assert x.grad is None and w.grad is not None
