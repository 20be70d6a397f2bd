"""CPU tests of the blockwise FP8 reference (kernels/fp8.py) and of the device dispatch on CPU.

Fast (small shapes): run in CI on CPU.
"""

from __future__ import annotations

import torch

import kernels
from kernels import fp8 as F8


def _bits(t):
    return t.view(torch.uint8)


def test_weight_quant_format_and_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 0.05
    w[:128, :128] *= 100  # one block with a much larger range: its own scale
    wq, ws = F8.quantize_weight_blockwise(w)
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == w.shape
    assert ws.shape == (3, 2) and ws.dtype == torch.float32
    # per block: amax maps to +-448 exactly, nothing saturates beyond it
    for bi in range(3):
        for bj in range(2):
            blk = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            assert ws[bi, bj] == blk.abs().max() / 448.0
            q = wq[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].float()
            assert q.abs().max() == 448.0
    deq = F8.dequantize_weight_blockwise(wq, ws)
    rel = ((deq - w).abs() / w.abs().clamp(min=1e-3 * w.abs().max())).max()
    assert rel <= 2 ** -4 + 1e-6  # e4m3: 3 mantissa bits, round to nearest


def test_act_quant_rowwise_invariant_and_zero_rows():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(33, 300, generator=g) * 4).bfloat16()
    x[3] = 0
    q, s = F8.quantize_act_groupwise(x)
    assert q.shape == x.shape and s.shape == (33, 3)
    assert torch.all(q[3].float() == 0) and torch.all(s[3] == torch.tensor(1e-10, dtype=torch.float32) / 448.0)
    for i in (0, 3, 32):
        q1, s1 = F8.quantize_act_groupwise(x[i:i + 1])
        assert torch.equal(_bits(q1), _bits(q[i:i + 1])) and torch.equal(s1, s[i:i + 1])
    # a row's quantisation does not depend on the other rows (shuffled batch)
    perm = torch.randperm(33, generator=g)
    qp, sp = F8.quantize_act_groupwise(x[perm])
    assert torch.equal(_bits(qp), _bits(q[perm])) and torch.equal(sp, s[perm])
    # 3-D input
    q3, s3 = F8.quantize_act_groupwise(x.view(3, 11, 300))
    assert torch.equal(_bits(q3.reshape(33, 300)), _bits(q)) and torch.equal(s3.reshape(33, 3), s)


def test_fp8_gemm_reference_invariance_and_accuracy():
    g = torch.Generator().manual_seed(2)
    M, N, K = 20, 136, 384
    w = torch.randn(N, K, generator=g) / K ** 0.5
    x = torch.randn(M, K, generator=g).bfloat16()
    wq, ws = F8.quantize_weight_blockwise(w)
    y = F8.fp8_linear(x, wq, ws, out_dtype=torch.float32)
    for idx in ([0], [5, 19, 5], list(range(M))[::-1]):
        assert torch.equal(F8.fp8_linear(x[idx], wq, ws, out_dtype=torch.float32), y[idx])
    # the block-scaled sum equals the dequantised product up to fp32 rounding
    xq, xs = F8.quantize_act_groupwise(x)
    deq = F8.dequantize_act_groupwise(xq, xs).double() @ F8.dequantize_weight_blockwise(wq, ws).double().T
    assert ((y.double() - deq).abs().max() / deq.abs().max()).item() < 1e-5
    # and the unquantised product up to FP8 quantisation error
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 0.08
    assert F8.fp8_linear(x, wq, ws).dtype == torch.bfloat16


def test_fp8_linear_straight_through_grad():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) / 16
    wq, ws = F8.quantize_weight_blockwise(w)
    x = torch.randn(4, 256, generator=g, requires_grad=True)
    F8.fp8_linear(x, wq, ws).sum().backward()
    expected = F8.dequantize_weight_blockwise(wq, ws).sum(0).expand(4, -1)
    assert torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-6)


def test_dispatch_on_cpu_is_the_reference():
    """Public entry points on CPU tensors give the reference's exact bits (one entry point per op)."""
    from kernels import gemm, moe, norm, router

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g).bfloat16()
    w = torch.randn(32, 64, generator=g).bfloat16()
    assert kernels.linear.__module__ == "kernels.dispatch"
    for segs in (2, kernels.ROW_PARALLEL_K_SEGMENTS):  # a generic count and the row-parallel contract's
        assert torch.equal(kernels.linear(x, w, k_segments=segs), gemm.linear(x, w, k_segments=segs))
    assert torch.equal(kernels.rms_norm(x, None, 1e-6), norm.rms_norm(x, None, 1e-6))
    lg = torch.randn(6, 16, generator=g)
    a, b = kernels.route(lg, 3, norm_topk_prob=True), router.route(lg, 3, norm_topk_prob=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(kernels.swiglu(x, x), moe.swiglu(x, x))
    xq, xs = kernels.quantize_act_groupwise(x)
    rq, rs = F8.quantize_act_groupwise(x)
    assert torch.equal(_bits(xq), _bits(rq)) and torch.equal(xs, rs)


def test_fake_quant_linear_master_weight_gets_straight_through_grad():
    """Fake-quant training: the forward is bitwise fp8_linear with the quantised weight (with or
    without the master weight attached, K not a multiple of 128 included), and the master weight
    gets the gradient F.linear with the dequantised weight would give it."""
    g = torch.Generator().manual_seed(5)
    for N, K in ((64, 256), (200, 96), (136, 300)):
        w = (torch.randn(N, K, generator=g) / 16).requires_grad_(True)
        x = torch.randn(2, 3, K, generator=g, requires_grad=True)
        wq, ws = F8.quantize_weight_blockwise(w)
        plain = F8.fp8_linear(x.detach(), wq, ws)
        y = kernels.fake_quant_linear(x, w)
        assert torch.equal(y, plain) and torch.equal(F8.fp8_linear(x, wq, ws, weight=w), plain)
        gy = torch.randn(y.shape, generator=g)
        y.backward(gy)
        assert w.grad is not None and x.grad is not None
        exp_w = gy.reshape(-1, N).t() @ x.detach().reshape(-1, K)
        exp_x = gy @ F8.dequantize_weight_blockwise(wq, ws)
        assert torch.allclose(w.grad, exp_w, rtol=1e-5, atol=1e-5)
        assert torch.allclose(x.grad, exp_x, rtol=1e-5, atol=1e-5)
