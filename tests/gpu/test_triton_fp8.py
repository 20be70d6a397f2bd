"""GPU tests of blockwise FP8 (kernels/triton/fp8.py vs the exact reference kernels/fp8.py).

    PYTHONPATH=. python -m pytest tests/gpu/test_triton_fp8.py -q
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = pytest.mark.gpu


from gpu_util import gen as _gen, need_cuda as _need_cuda, randn as _randn  # noqa: E402,F401


def _f8():
    return importlib.import_module("kernels.triton.fp8")


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("K", [7168, 2048, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_bitwise_cpu(K, dtype):
    """The GPU activation quantiser gives the CPU reference's bits (values and scales)."""
    _need_cuda()
    from kernels import fp8 as F8

    x = _randn(257, K, seed=1, dtype=dtype, scale=3.0)
    x[5] = 0  # all-zero row: eps-clamped scale, zero codes
    x[7, :5] = 1e4  # saturating outliers
    q, s = _f8().quantize_act_groupwise(x)
    qc, sc = F8.quantize_act_groupwise(x.cpu())
    assert torch.equal(s.cpu(), sc)
    assert torch.equal(_bits(q).cpu(), _bits(qc))
    for M in (1, 2, 100):
        q1, s1 = _f8().quantize_act_groupwise(x[:M])
        assert torch.equal(_bits(q1), _bits(q[:M])) and torch.equal(s1, s[:M])


def test_weight_quant_same_bits_on_gpu():
    _need_cuda()
    from kernels import fp8 as F8

    w = _randn(1000, 700, seed=2, scale=0.02)
    wq, ws = F8.quantize_weight_blockwise(w)
    wq_c, ws_c = F8.quantize_weight_blockwise(w.cpu())
    assert ws.shape == (8, 6)
    assert torch.equal(ws.cpu(), ws_c) and torch.equal(_bits(wq).cpu(), _bits(wq_c))


@pytest.mark.parametrize("K,N", [(7168, 2048), (2048, 7168), (4096, 4096), (384, 200)])
def test_fp8_gemm_invariance_and_accuracy(K, N):
    _need_cuda()
    from kernels import fp8 as F8

    f8 = _f8()
    w = _randn(N, K, seed=3, scale=K ** -0.5)
    wq, ws = F8.quantize_weight_blockwise(w)
    x = _randn(600, K, seed=4)
    xq, xs = f8.quantize_act_groupwise(x)
    full = f8.fp8_gemm(xq, xs, wq, ws)
    alone = torch.cat([f8.fp8_gemm(xq[i:i + 1], xs[i:i + 1], wq, ws) for i in range(256)])
    assert torch.equal(alone, full[:256])
    for M in range(1, 257):
        assert torch.equal(f8.fp8_gemm(xq[:M], xs[:M], wq, ws), alone[:M]), f"M={M}"
    g = torch.Generator().manual_seed(5)
    for _ in range(16):
        idx = torch.randint(0, 600, (int(torch.randint(1, 600, (1,), generator=g)),), generator=g).cuda()
        assert torch.equal(f8.fp8_gemm(xq[idx], xs[idx], wq, ws), full[idx])
    # every config gives the same bits (fp32 out, so nothing is hidden by rounding)
    for M in (1, 64, 200, 600):
        outs = {n: f8.fp8_gemm(xq[:M], xs[:M], wq, ws, out_dtype=torch.float32, config=c)
                for n, c in f8.FP8_CONFIGS.items()}
        first = next(iter(outs.values()))
        for n, o in outs.items():
            assert torch.equal(o, first), f"config {n} differs at M={M}"
    # accuracy: vs the CPU reference on the same quantised operands, and vs the dequantised product
    n = 16
    y32 = f8.fp8_gemm(xq[:n], xs[:n], wq, ws, out_dtype=torch.float32).cpu()
    ref = F8.fp8_gemm(xq[:n].cpu(), xs[:n].cpu(), wq.cpu(), ws.cpu(), out_dtype=torch.float32)
    rel = ((y32 - ref).norm() / ref.norm()).item()
    deq = F8.dequantize_act_groupwise(xq[:n].cpu(), xs[:n].cpu()).double() @ \
        F8.dequantize_weight_blockwise(wq.cpu(), ws.cpu()).double().T
    rel_d = ((y32.double() - deq).norm() / deq.norm()).item()
    exact = x[:n].cpu().double() @ w.cpu().double().T
    rel_q = ((y32.double() - exact).norm() / exact.norm()).item()
    print(f"K={K} N={N}: rel err vs CPU reference {rel:.2e}, vs dequantised fp64 {rel_d:.2e}, "
          f"vs unquantised bf16 product {rel_q:.2e} (quantisation error)")
    assert rel < 2e-3 and rel_d < 2e-3 and rel_q < 0.1


def test_fp8_linear_dispatch_and_grad():
    _need_cuda()
    import kernels

    w = _randn(512, 1024, seed=6, scale=1 / 32)
    wq, ws = kernels.quantize_weight_blockwise(w)
    x = _randn(9, 1024, seed=7, dtype=torch.float32).requires_grad_()
    y = kernels.fp8_linear(x, wq, ws)
    assert y.is_cuda and y.dtype == torch.float32
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    yc = kernels.fp8_linear(x.detach().cpu(), wq.cpu(), ws.cpu())
    assert ((y.detach().cpu() - yc).norm() / yc.norm()).item() < 2e-3


@pytest.mark.parametrize("K,N", [(7168 + 1024, 2048), (2048, 7168), (1024, 200)])
def test_fp8_gemm_k_segments(K, N):
    """Row-parallel FP8 (docs/tp.md "FP8"): the Triton GEMM at k_segments=8 is bitwise the 8 per-segment
    fp32 chains added in segment order, also when the segments come from t = 1, 2, 4, 8 rank shards
    (kernels.dispatch.fp8_row_partials); row invariant; every config the same bits; k_segments=1 unchanged
    (its bits are the single chain's); close to the CPU reference. Written without a GPU (untested)."""
    _need_cuda()
    from kernels import dispatch as D
    from kernels import fp8 as F8
    from kernels.gemm import finish_linear, sum_partials

    f8 = _f8()
    S, B = 8, F8.BLOCK
    w = _randn(N, K, seed=13, scale=K ** -0.5)
    wq, ws = F8.quantize_weight_blockwise(w)
    x = _randn(300, K, seed=14)
    xq, xs = f8.quantize_act_groupwise(x)
    y8 = f8.fp8_gemm(xq, xs, wq, ws, out_dtype=torch.float32, k_segments=S)
    seg = K // S
    parts = [f8.fp8_gemm(xq[:, j * seg:(j + 1) * seg], xs[:, j * seg // B:(j + 1) * seg // B],
                         wq[:, j * seg:(j + 1) * seg], ws[:, j * seg // B:(j + 1) * seg // B],
                         out_dtype=torch.float32) for j in range(S)]
    assert torch.equal(y8, sum_partials(parts))
    for t in (1, 2, 4, 8):
        kr = K // t
        ranks = [D.fp8_row_partials(x[:, r * kr:(r + 1) * kr], wq[:, r * kr:(r + 1) * kr],
                                    ws[:, r * kr // B:(r + 1) * kr // B], S // t) for r in range(t)]
        allp = [p for rk in ranks for p in rk.unbind(0)]
        assert torch.equal(finish_linear(sum_partials(allp), None, torch.float32), y8), f"t={t}"
    yb = f8.fp8_gemm(xq, xs, wq, ws, k_segments=S)
    assert torch.equal(yb, y8.to(torch.bfloat16))
    alone = torch.cat([f8.fp8_gemm(xq[i:i + 1], xs[i:i + 1], wq, ws, k_segments=S) for i in range(64)])
    assert torch.equal(alone, yb[:64])
    for M in (1, 64, 300):
        outs = {n: f8.fp8_gemm(xq[:M], xs[:M], wq, ws, out_dtype=torch.float32, config=c, k_segments=S)
                for n, c in f8.FP8_CONFIGS.items()}
        for n, o in outs.items():
            assert torch.equal(o, y8[:M]), f"config {n} differs at M={M}"
    one = f8.fp8_gemm(xq, xs, wq, ws, out_dtype=torch.float32)  # single chain: a different sum
    ref = F8.fp8_gemm(xq[:16].cpu(), xs[:16].cpu(), wq.cpu(), ws.cpu(), out_dtype=torch.float32, k_segments=S)
    assert ((y8[:16].cpu() - ref).norm() / ref.norm()).item() < 2e-3
    assert ((one - y8).norm() / y8.norm()).item() < 1e-5
