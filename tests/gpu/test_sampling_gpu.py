"""kernels/sampling.py on CUDA tensors: a row's processed logprob does not depend on the batch.

Skipped without CUDA. On the GPU machine:

    PYTHONPATH=. python -m pytest tests/gpu/test_sampling_gpu.py -q

The learner and the aligned engine's sampler run these functions on the same device, so row
invariance on the GPU is what their bitwise agreement needs (CUDA bits need not equal the CPU's).
Vocabulary sizes include a real one (151936, Qwen); batches of 1..256 rows; fp32 and bf16 logits;
rows with many exact ties; the same or random per-row parameters.

The aligned sampler's fused launch plans (``kernels.settings.fused_sampler``: ``log_softmax`` in
two launches, the keyed draw writing the sampled token's logprob and the finite flag) give the
bits of the unfused ones (three ``log_softmax`` launches; ``gumbel_draw`` then torch's gather /
isfinite / all): tokens, token logprobs and processed logprobs, with seeded CUDA generators, through
``sampler_patch.aligned_sample`` and (where CUDA vLLM is installed) vLLM's patched ``Sampler``.
"""

from __future__ import annotations

import pytest
import torch

import kernels

pytestmark = pytest.mark.gpu

from gpu_util import have_cuda_vllm, need_cuda as _need_cuda  # noqa: E402

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


def _twin_generators(rows, seed0):
    """Two dicts of CUDA generators in the same states (one per plan)."""
    make = lambda: {r: torch.Generator(device="cuda").manual_seed(seed0 + r) for r in rows}  # noqa: E731
    return make(), make()


@pytest.mark.parametrize("v", [1000, 32000, 151936])
def test_fused_draw_and_log_softmax_equal_unfused_on_cuda(v):
    _need_cuda()
    from kernels.triton.draw import gumbel_draw, gumbel_draw_with_logprob
    from kernels.triton.logprobs import log_softmax, logprobs_from_logits
    from vllm_bridge.sampler_patch import DrawKeys

    g = torch.Generator(device="cuda").manual_seed(v)
    for n in (1, 7, 64, 256):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(n, v, device="cuda", generator=g) * 3).to(dtype)
            x[0, ::3] = float("-inf")
            T = torch.tensor([(1.0, 0.0, 0.7, 1.3, 1e-6)[j % 5] for j in range(n)], device="cuda")
            T_lp = torch.where(T < 1e-5, torch.ones_like(T), T)
            two, three = log_softmax(x, T_lp, fold=True), log_softmax(x, T_lp, fold=False)
            assert torch.equal(two, three), (v, n, dtype)
            t = torch.randint(0, v, (n,), device="cuda", generator=g)
            assert torch.equal(logprobs_from_logits(x, t, T_lp), two.gather(1, t[:, None]).squeeze(1)), (v, n, dtype)
            if dtype == torch.bfloat16:
                continue  # the aligned sampler draws from fp32 logits
            ga, gb = _twin_generators(range(0, n, 2), 100 * n)
            ka, base = DrawKeys().step(n, ga, x.device)
            kb, _ = DrawKeys().step(n, gb, x.device)
            assert torch.equal(ka[::2], kb[::2])  # the seeded rows (the unseeded: each DrawKeys' own base)
            for keys in (ka, None):
                tok = gumbel_draw(x, T, keys, base_seed=base)
                tok_f, tlp, fin = gumbel_draw_with_logprob(x, T, two, keys, base_seed=base)
                assert torch.equal(tok_f, tok), (v, n, keys is None)
                assert torch.equal(tlp, three.gather(1, tok[:, None]).squeeze(1)), (v, n)
                assert int(fin) == 1 and bool(torch.isfinite(tlp).all())
    x = torch.randn(5, v, device="cuda", generator=g)
    x[3] = float("nan")
    T = torch.ones(5, device="cuda")
    lp = log_softmax(x, T)
    tok, tlp, fin = gumbel_draw_with_logprob(x, T, lp)
    assert torch.equal(tok, gumbel_draw(x, T)) and int(fin) == 0 and bool(torch.isnan(tlp[3]))
    assert torch.equal(tlp[[0, 1, 2, 4]], lp.gather(1, tok[:, None]).squeeze(1)[[0, 1, 2, 4]])


@pytest.mark.parametrize("v", [12365, 32000, 151936])
def test_draw_in_vocabulary_pieces_equals_one_program_per_row_on_cuda(v):
    """Small batches race each row's vocabulary in parallel pieces and fold them in column order
    (kernels.triton.draw.draw_pieces): the tokens, token log-probs and finite flag are those of one
    program per row, for any number of pieces, keyed or not, with masked columns and greedy ties."""
    _need_cuda()
    from kernels.triton.draw import draw_pieces, gumbel_draw, gumbel_draw_with_logprob
    from kernels.triton.logprobs import log_softmax

    g = torch.Generator(device="cuda").manual_seed(v + 1)
    for n in (1, 7, 64, 127):
        x = torch.randn(n, v, device="cuda", generator=g) * 3
        x[0, ::3] = float("-inf")
        x[-1, 5] = x[-1, v - 9] = 40.0  # a tie across the first and the last piece
        T = torch.tensor([(1.0, 0.7, 1.3, 2.0)[j % 4] for j in range(n)], device="cuda")
        T[-1] = 0.0  # greedy
        lp = log_softmax(x, torch.where(T < 1e-5, torch.ones_like(T), T))
        keys = torch.stack([torch.arange(n, device="cuda") * 7 + 1, torch.arange(n, device="cuda")], 1)
        assert (draw_pieces(n, v) > 1) == (v >= 65536)  # large vocabularies only
        for k in (keys, None):
            one = gumbel_draw(x, T, k, base_seed=77, pieces=1)
            assert int(one[-1]) == 5
            for P in (2, 5, None):
                assert torch.equal(gumbel_draw(x, T, k, base_seed=77, pieces=P), one), (v, n, P)
                tok, tlp, fin = gumbel_draw_with_logprob(x, T, lp, k, base_seed=77, pieces=P)
                assert torch.equal(tok, one) and torch.equal(tlp, lp.gather(1, one[:, None]).squeeze(1))
                assert int(fin) == 1


def _md(T, generators):
    from types import SimpleNamespace

    return SimpleNamespace(temperature=T, all_random=bool((T >= 1e-5).all()), all_greedy=False, top_k=None,
                           top_p=None, generators=generators, no_penalties=True, allowed_token_ids_mask=None,
                           bad_words_token_ids={}, logitsprocs=None)


@pytest.mark.parametrize("v", [4099, 151936])
def test_aligned_sample_fused_equals_unfused_on_cuda(v):
    """sampler_patch.aligned_sample (what the patched Sampler.sample runs) over several steps of the
    same seeded / unseeded requests: the fused and the unfused plans draw the same tokens and report
    the same processed logprobs, bitwise kernels.processed_logprobs; a NaN row is caught by both."""
    _need_cuda()
    import random
    from types import SimpleNamespace

    from kernels import settings
    from vllm_bridge import sampler_patch as sp

    g = torch.Generator(device="cuda").manual_seed(v + 1)
    n = 24
    T = torch.tensor([(1.0, 0.0, 0.7, 1.3)[j % 4] for j in range(n)], device="cuda")
    T_lp = torch.where(T < 1e-5, torch.ones_like(T), T)
    gens = _twin_generators([r for r in range(n) if r % 3], 7)
    samplers = [SimpleNamespace(), SimpleNamespace()]
    for s_ in samplers:
        s_._rz_keys = sp.DrawKeys()
        s_._rz_keys.rng = random.Random(5)  # the same unseeded base seeds for both plans
    try:
        for step in range(4):
            x = torch.randn(n, v, device="cuda", generator=g) * 3
            out = []
            for fused, s_, gs in zip((True, False), samplers, gens):
                settings.set_fused_sampler(fused)
                out.append(sp.aligned_sample(s_, x, _md(T, gs)))
            (tok_f, lp_f), (tok_u, lp_u) = out
            assert torch.equal(tok_f, tok_u), step
            assert torch.equal(lp_f, lp_u), step
            settings.set_fused_sampler(False)
            assert torch.equal(lp_f, kernels.processed_logprobs(x, T_lp)), step
            settings.set_fused_sampler(True)
            assert torch.equal(lp_f, kernels.processed_logprobs(x, T_lp)), step
        torch.cuda.synchronize()
        for s_ in samplers:
            s_._rz_finite.check()
            assert not s_._rz_finite.pending
        x[5] = float("nan")
        for fused, s_, gs in zip((True, False), samplers, gens):
            settings.set_fused_sampler(fused)
            sp.aligned_sample(s_, x, _md(T, gs))
            torch.cuda.synchronize()
            with pytest.raises(sp.AlignedSamplingError):
                s_._rz_finite.check()
    finally:
        settings.set_fused_sampler(True)


def test_vllm_sampler_reports_processed_logprobs_on_cuda():
    """vLLM's own Sampler, patched and aligned (what RolloutEngine(aligned=True) runs): the
    processed logprobs it reports are bitwise kernels.processed_logprobs, fused and unfused, and
    both plans draw the same tokens for the same seeds."""
    _need_cuda()
    if not have_cuda_vllm():
        pytest.skip("needs CUDA vLLM (docs/gpu.md)")
    import os
    import random

    from benchmarks.sampler_host import _metadata
    from kernels import settings
    from vllm_bridge import sampler_patch

    sampler_patch.apply()
    from vllm.v1.sample.sampler import Sampler

    os.environ[sampler_patch.ENV] = "1"
    try:
        samplers = [Sampler(logprobs_mode="processed_logprobs") for _ in range(2)]
    finally:
        del os.environ[sampler_patch.ENV]
    g = torch.Generator(device="cuda").manual_seed(3)
    for n, seeded in ((1, True), (32, False), (32, True), (64, True)):
        x = torch.randn(n, 32000, device="cuda", generator=g) * 3
        out = []
        for fused, s_ in zip((True, False), samplers):
            assert sampler_patch.is_aligned(s_)
            s_._rz_keys = sampler_patch.DrawKeys()
            s_._rz_keys.rng = random.Random(n)
            settings.set_fused_sampler(fused)
            try:
                md = _metadata(n, seeded, torch.device("cuda"))
                out.append(s_.sample(x, md))
            finally:
                settings.set_fused_sampler(True)
        (tok_f, lp_f), (tok_u, lp_u) = out
        assert torch.equal(tok_f, tok_u) and torch.equal(lp_f, lp_u), (n, seeded)
        assert torch.equal(lp_f, kernels.processed_logprobs(x, md.temperature)), (n, seeded)
