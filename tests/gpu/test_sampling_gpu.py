"""kernels/sampling.py on CUDA tensors: a row's processed logprob does not depend on the batch.

Skipped without CUDA. On the GPU machine:

    PYTHONPATH=. python -m pytest tests/gpu/test_sampling_gpu.py -q

The learner and the aligned engine's sampler run these functions on the same device, so row
invariance on the GPU is what their bitwise agreement needs (CUDA bits need not equal the CPU's).
Vocabulary sizes include a real one (151936, Qwen); batches of 1..256 rows; fp32 and bf16 logits;
rows with many exact ties; the same or random per-row parameters.
"""

from __future__ import annotations

import pytest
import torch

import kernels

pytestmark = pytest.mark.gpu

from gpu_util import need_cuda as _need_cuda  # noqa: E402

PARAMS = [(0.6, 0, 0.9), (1.0, 5, 1.0), (1.3, 20, 0.5), (0.7, 20, 0.99), (1.0, 1, 1.0), (1.0, 0, 1.0)]


def _batch(g, n, v, dtype, ties):
    x = torch.randn(n, v, device="cuda", generator=g) * 3
    return (torch.round(x) if ties else x).to(dtype)


@pytest.mark.parametrize("v", [64, 4099, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_row_invariance_on_cuda(v, dtype, ties):
    _need_cuda()
    g = torch.Generator(device="cuda").manual_seed(v + int(ties))
    pool = _batch(g, 64, v, dtype, ties)
    tg = torch.randint(0, v, (64,), device="cuda", generator=g)
    for T, k, p in PARAMS:
        alone = torch.cat([kernels.sampled_logprobs(pool[i:i + 1], tg[i:i + 1], T, k, p) for i in range(8)])
        full_alone = torch.cat([kernels.processed_logprobs(pool[i:i + 1], T, k, p) for i in range(8)])
        for m in (1, 7, 64, 256):
            rows = torch.randint(0, 64, (m,), device="cuda", generator=g)
            rows[: min(m, 8)] = torch.arange(min(m, 8), device="cuda")
            got = kernels.sampled_logprobs(pool[rows], tg[rows], T, k, p)
            assert torch.equal(got[: min(m, 8)], alone[: min(m, 8)]), (v, dtype, ties, T, k, p, m)
            if v <= 4099:
                full = kernels.processed_logprobs(pool[rows], T, k, p)
                assert torch.equal(full[: min(m, 8)], full_alone[: min(m, 8)]), (v, T, k, p, m)
            # per-row parameters: the other rows random
            Ts = torch.tensor([PARAMS[j % len(PARAMS)][0] for j in range(m)], device="cuda")
            ks = torch.tensor([PARAMS[j % len(PARAMS)][1] for j in range(m)], device="cuda")
            ps = torch.tensor([PARAMS[j % len(PARAMS)][2] for j in range(m)], device="cuda")
            Ts[: min(m, 8)], ks[: min(m, 8)], ps[: min(m, 8)] = T, k, p
            got = kernels.sampled_logprobs(pool[rows], tg[rows], Ts, ks, ps)
            assert torch.equal(got[: min(m, 8)], alone[: min(m, 8)]), ("per-row", v, T, k, p, m)
        kept = torch.isfinite(full_alone)
        if 0 < k < v:
            assert int(kept.sum(-1).max()) <= k
        mass = full_alone.double().exp().sum(-1)
        assert torch.allclose(mass, torch.ones_like(mass), atol=1e-4)
