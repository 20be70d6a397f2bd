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


# ------------------------------------------------------------------ row-parallel FP8 (docs/tp.md "FP8")


def test_row_parallel_k_segments_rule():
    S = kernels.ROW_PARALLEL_K_SEGMENTS
    assert S == 8
    assert [F8.row_parallel_k_segments(k) for k in (128, 256, 1000, 1536, 1024, 2048, 7168, 16384)] == \
        [1, 1, 1, 1, 8, 8, 8, 8]
    assert F8.fp8_segments(2048, 8)[1] == (256, 512)
    import pytest

    for K, s in ((1536, 8), (1000, 8), (512, 3)):
        with pytest.raises(ValueError, match="whole 128-wide blocks|does not split"):
            F8.fp8_segments(K, s)
    x = torch.randn(2, 1536)
    wq, ws = F8.quantize_weight_blockwise(torch.randn(4, 1536))
    with pytest.raises(ValueError, match="k_segments=8"):
        F8.fp8_linear(x, wq, ws, k_segments=8)


def test_fp8_k_segments_one_is_the_single_chain():
    g = torch.Generator().manual_seed(21)
    x = torch.randn(7, 1024, generator=g).bfloat16()
    wq, ws = F8.quantize_weight_blockwise(torch.randn(96, 1024, generator=g) * 0.03)
    a = F8.fp8_linear(x, wq, ws)
    assert torch.equal(_bits(F8.fp8_linear(x, wq, ws, k_segments=1)), _bits(a))
    xq, xs = F8.quantize_act_groupwise(x)
    chain = F8.fp8_gemm_partial(xq, xs, wq, ws)  # the one chain, fp32, not rounded
    assert torch.equal(F8.fp8_gemm(xq, xs, wq, ws, out_dtype=torch.float32), chain)
    # K = 1024: one block per segment, so the 8 chains are the 8 block terms and their in-order sum
    # is the single chain itself (0 + t == t exactly): the same bits
    assert torch.equal(F8.fp8_gemm(xq, xs, wq, ws, out_dtype=torch.float32, k_segments=8), chain)
    x2 = torch.randn(7, 2048, generator=g).bfloat16()
    wq2, ws2 = F8.quantize_weight_blockwise(torch.randn(96, 2048, generator=g) * 0.03)
    xq2, xs2 = F8.quantize_act_groupwise(x2)
    chain2 = F8.fp8_gemm_partial(xq2, xs2, wq2, ws2)
    y8 = F8.fp8_gemm(xq2, xs2, wq2, ws2, out_dtype=torch.float32, k_segments=8)
    assert not torch.equal(y8, chain2)  # K = 2048: two blocks per segment, another sum order
    assert ((y8 - chain2).abs().max() / chain2.abs().max()).item() < 1e-5


def test_fp8_row_parallel_partials_over_ranks_equal_one_rank():
    """8-segment FP8 partials computed by t = 1, 2, 4, 8 ranks from their K shards (quantising their
    own activation and weight shards), gathered in rank order and added in segment order, are bitwise
    the one-rank 8-segment FP8 GEMM (kernels.fp8_linear / fake_quant_linear at k_segments=8)."""
    from kernels.dispatch import fp8_row_partials
    from kernels.gemm import finish_linear, sum_partials

    g = torch.Generator().manual_seed(22)
    K, N, S = 2048, 200, kernels.ROW_PARALLEL_K_SEGMENTS
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(13, K, generator=g) * 2).to(dtype)
        w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
        w[:, :128] *= 50  # one wide-range K block column
        wq, ws = F8.quantize_weight_blockwise(w)
        one = kernels.fp8_linear(x, wq, ws, out_dtype=dtype, k_segments=S)
        assert torch.equal(_bits(kernels.fake_quant_linear(x, w, out_dtype=dtype, k_segments=S)), _bits(one))
        for t in (1, 2, 4, 8):
            kr = K // t
            allp = []
            for r in range(t):
                wq_r, ws_r = F8.quantize_weight_blockwise(w[:, r * kr:(r + 1) * kr])  # the rank's shard
                assert torch.equal(ws_r, ws[:, r * kr // 128:(r + 1) * kr // 128])
                allp += list(fp8_row_partials(x[:, r * kr:(r + 1) * kr], wq_r, ws_r, S // t).unbind(0))
            assert len(allp) == S
            got = finish_linear(sum_partials(allp), None, dtype)
            assert torch.equal(_bits(got), _bits(one)), (dtype, t)
        # row invariant: a row alone == the row in the batch
        for i in (0, 5, 12):
            assert torch.equal(_bits(kernels.fp8_linear(x[i:i + 1], wq, ws, out_dtype=dtype, k_segments=S)),
                               _bits(one[i:i + 1]))


def test_fp8_column_shards_and_activation_groups_are_tp_exact():
    """Column-parallel FP8: a 128-aligned row shard of the weight quantises to the full weight's
    blocks, and the activation is quantised per row over the unsplit K: the shard's outputs are the
    full output's columns, bitwise."""
    g = torch.Generator().manual_seed(23)
    x = torch.randn(9, 384, generator=g).bfloat16()
    w = torch.randn(512, 384, generator=g).bfloat16() * 0.05
    full = kernels.fake_quant_linear(x, w, out_dtype=torch.bfloat16)
    for t in (2, 4):
        n = 512 // t
        cols = [kernels.fake_quant_linear(x, w[r * n:(r + 1) * n], out_dtype=torch.bfloat16) for r in range(t)]
        assert torch.equal(_bits(torch.cat(cols, dim=-1)), _bits(full))


def test_recipe_fp8_constants_agree_with_kernels():
    """megatron_rz.recipe checks the FP8 TP shape rules without importing kernels (layer 0)."""
    from megatron_rz import recipe

    assert recipe._ROW_PARALLEL_K_SEGMENTS == kernels.ROW_PARALLEL_K_SEGMENTS
    assert recipe._FP8_BLOCK == F8.BLOCK
