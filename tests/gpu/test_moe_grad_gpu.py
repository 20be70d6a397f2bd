"""The learner's routed experts on the GPU (kernels.moe_expert_rows): the grouped Triton forward is
bitwise the per-expert chains (and the engine's moe_experts before its combine), and the grouped-GEMM
backward (kernels/moe_grad.py) agrees with autograd of the per-expert loop to bf16 / fp32 rounding,
is the same bits run to run, and handles experts without rows and expert-parallel subsets.

    PYTHONPATH=. python -m pytest tests/gpu/test_moe_grad_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import moe_grad

pytestmark = pytest.mark.gpu


def _inputs(T, k, H, I, E, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_(True)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.05).to(dtype).requires_grad_(True)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.05).to(dtype).requires_grad_(True)
    ids = torch.randint(0, E - 1, (T, k), device="cuda", generator=g)  # the last expert gets no row
    return x, w13, w2, ids


def _loop(x, w13, w2, flat, k):
    """The learner's previous MoE: one expert at a time, autograd through kernels.linear."""
    y = x.new_zeros(flat.numel(), x.shape[1])
    for e in range(w13.shape[0]):
        sel = (flat == e).nonzero().squeeze(1)
        y = y.index_copy(0, sel, kernels.expert_mlp_merged(x[sel // k], w13[e], w2[e]))
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 37, 2048])
def test_grouped_rows_forward_bitwise_backward_close(dtype, T):
    k, H, I, E = 4, 256, 128, 8
    x, w13, w2, ids = _inputs(T, k, H, I, E, dtype, seed=T)
    flat = ids.reshape(-1)
    slots = torch.arange(flat.numel(), device="cuda")
    y = kernels.moe_expert_rows(x, slots, flat, w13, w2, k)
    y_loop = _loop(x, w13, w2, flat, k)
    assert torch.equal(y, y_loop)
    with torch.no_grad():  # the engine's grouped MoE (before its combine) gives the same rows
        combined = kernels.moe_experts(x, w13[:, :I], w13[:, I:], w2, ids, torch.ones(T, k, device="cuda"))
        assert torch.equal(combined, kernels.moe_combine(y.view(T, k, H), torch.ones(T, k, device="cuda")))
    gy = torch.randn(y.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(dtype)
    new = torch.autograd.grad(y, (x, w13, w2), gy)
    old = torch.autograd.grad(y_loop, (x, w13, w2), gy)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(new, old):
        err = (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-3)
        assert err < tol, err
    assert new[1][E - 1].abs().max() == 0 and new[2][E - 1].abs().max() == 0  # no rows: zero gradient
    again = torch.autograd.grad(kernels.moe_expert_rows(x, slots, flat, w13, w2, k), (x, w13, w2), gy)
    assert all(torch.equal(a, b) for a, b in zip(new, again))


def test_expert_parallel_subset_and_the_grouped_path_ran():
    k, H, I, E, T = 2, 128, 128, 8, 300  # I: 8 down-projection K segments of 16
    x, w13, w2, ids = _inputs(T, k, H, I, E, torch.bfloat16, seed=5)
    flat = ids.reshape(-1)
    before = dict(moe_grad.GROUPED_MM)
    sel = ((flat >= 2) & (flat < 6)).nonzero().squeeze(1)
    rows = kernels.moe_expert_rows(x, sel, flat[sel] - 2, w13[2:6], w2[2:6], k)
    assert torch.equal(rows, _loop(x, w13, w2, flat, k)[sel])
    rows.float().sum().backward()
    assert moe_grad.GROUPED_MM["grouped"] > before["grouped"]  # torch._grouped_mm took the bf16 products
    assert moe_grad.GROUPED_MM["fallback"] == before["fallback"]
    assert w13.grad[:2].abs().max() == 0 and w13.grad[2:6].abs().max() > 0
