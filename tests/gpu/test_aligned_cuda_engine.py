"""The aligned engine's CUDA pieces: the paged-cache attention and KV write, the sampler's
log-softmax, and (with CUDA vLLM installed, docs/gpu.md) the aligned vLLM engine itself: batch
invariance, decode == prefill, learner parity, in-place weight update, all with torch.equal."""

import json

import pytest
import torch

from gpu_util import moe1b_checkpoint, need_cuda, randn

pytestmark = pytest.mark.gpu


def _paged_setup(lens, nq, Hq=8, Hkv=2, D=128, PAGE=16, dtype=torch.bfloat16, seed=0):
    nb = sum((L + PAGE - 1) // PAGE for L in lens) + 7
    cache = randn(nb, Hkv, PAGE, 2 * D, dtype=dtype, seed=seed)
    kc, vc = cache[..., :D], cache[..., D:]
    maxb = max((L + PAGE - 1) // PAGE for L in lens)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))
    bt = torch.zeros(len(lens), maxb, dtype=torch.int32)
    i = 0
    for b, L in enumerate(lens):
        for j in range((L + PAGE - 1) // PAGE):
            bt[b, j] = perm[i]
            i += 1
    bt = bt.cuda()
    Lmax = max(lens)
    kcont = torch.zeros(len(lens), Lmax, Hkv, D, device="cuda", dtype=dtype)
    vcont = torch.zeros_like(kcont)
    for b, L in enumerate(lens):
        p = torch.arange(L, device="cuda")
        kcont[b, :L] = kc[bt[b, p // PAGE].long(), :, p % PAGE]
        vcont[b, :L] = vc[bt[b, p // PAGE].long(), :, p % PAGE]
    cu = torch.tensor([0] + list(torch.tensor(nq).cumsum(0)), device="cuda", dtype=torch.int32)
    pos = torch.cat([torch.arange(L - n, L) for L, n in zip(lens, nq)]).cuda()
    q = randn(int(sum(nq)), Hq, D, dtype=dtype, seed=seed + 1)
    return q, kc, vc, bt, cu, pos, kcont, vcont, torch.tensor(lens, device="cuda", dtype=torch.int32)


def test_paged_attention_equals_contiguous_and_is_invariant():
    need_cuda()
    from kernels.triton import attn as A

    lens, nq = [300, 17, 1030, 600], [300, 5, 1, 64]  # prefill, chunked prefill, decode, chunk
    q, kc, vc, bt, cu, pos, kcont, vcont, sl = _paged_setup(lens, nq)
    D = q.shape[-1]
    ref = A.attention_batched(q, kcont, vcont, cu, pos, D ** -0.5, max_q_len=max(nq), split_kv=False)
    out = torch.full_like(ref, float("nan"))
    A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=max(nq), out=out)
    assert torch.equal(out, ref)
    # each sequence alone, and each query alone (decode of that position), gives the same rows
    for b in range(len(lens)):
        a, e = int(cu[b]), int(cu[b + 1])
        o1 = torch.empty(e - a, *q.shape[1:], device="cuda", dtype=q.dtype)
        A.paged_attention(q[a:e], kc, vc, bt[b:b + 1], torch.tensor([0, e - a], device="cuda", dtype=torch.int32),
                          sl[b:b + 1], D ** -0.5, max_q_len=e - a, out=o1)
        assert torch.equal(o1, ref[a:e])
        j = e - 1  # the last query as a one-token decode over the same keys
        o2 = torch.empty(1, *q.shape[1:], device="cuda", dtype=q.dtype)
        A.paged_attention(q[j:j + 1], kc, vc, bt[b:b + 1], torch.tensor([0, 1], device="cuda", dtype=torch.int32),
                          sl[b:b + 1], D ** -0.5, max_q_len=1, out=o2)
        assert torch.equal(o2, ref[j:j + 1])
    # padded requests of a captured batch (no queries) write nothing
    cu_pad = torch.cat([cu, cu[-1:].repeat(3)])
    sl_pad = torch.cat([sl, torch.zeros(3, device="cuda", dtype=torch.int32)])
    bt_pad = torch.cat([bt, torch.zeros(3, bt.shape[1], device="cuda", dtype=torch.int32)])
    out2 = torch.full_like(ref, float("nan"))
    A.paged_attention(q, kc, vc, bt_pad, cu_pad, sl_pad, D ** -0.5, max_q_len=max(nq), out=out2)
    assert torch.equal(out2, ref)


def test_paged_kv_write_copies_exactly_and_skips_padding():
    need_cuda()
    from kernels.triton import attn as A

    nb, Hkv, PAGE, D, Dv = 6, 2, 16, 96, 32
    cache = torch.zeros(nb, Hkv, PAGE, 2 * D, device="cuda", dtype=torch.bfloat16)
    k, v = randn(4, Hkv, D, seed=3), randn(4, Hkv, Dv, seed=4)
    slots = torch.tensor([5, -1, 37, 80], device="cuda")
    A.paged_kv_write(k, v, cache[..., :D], cache[..., D:], slots)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(cache[s // PAGE, :, s % PAGE, :D], k[i])
        assert torch.equal(cache[s // PAGE, :, s % PAGE, D:D + Dv], v[i])
        assert not cache[s // PAGE, :, s % PAGE, D + Dv:].any()  # V zero-padded to D
    assert int((cache != 0).any(-1).sum()) == 3 * Hkv  # nothing else written


def test_log_softmax_rows_equal_token_logprobs():
    need_cuda()
    import kernels
    from kernels.triton.logprobs import log_softmax, logprobs_from_logits

    x = randn(37, 151936, dtype=torch.float32, seed=5, scale=4.0)
    t = torch.randint(0, x.shape[1], (37,), device="cuda")
    full = log_softmax(x)
    assert torch.equal(full.gather(1, t[:, None]).squeeze(1), logprobs_from_logits(x, t))
    # a row's values do not depend on the other rows
    assert torch.equal(log_softmax(x[5:6]), full[5:6])
    assert torch.equal(kernels.log_softmax(x), full)
    assert (full - torch.log_softmax(x, -1)).abs().max() < 1e-4


def test_per_row_temperature_equals_float_temperature():
    """The aligned sampler's sync-free path passes one temperature per row (a tensor); each row must
    get the bits of the learner's float temperature, in log_softmax, the token logprob and the draw
    logits (kernels.untruncated == masked_logits / processed_logprobs / sampled_logprobs)."""
    need_cuda()
    import kernels

    x = randn(12, 151936, dtype=torch.float32, seed=6, scale=4.0)
    t = torch.randint(0, x.shape[1], (12,), device="cuda")
    temps = [1.0, 0.7, 1.3, 0.6] * 3
    T = torch.tensor(temps, device="cuda", dtype=torch.float32)
    full = kernels.log_softmax(x, T)
    draw, lp = kernels.untruncated(x, T)
    assert torch.equal(lp, full)
    for r, tr in enumerate(temps):
        assert torch.equal(full[r], kernels.log_softmax(x[r:r + 1], tr)[0])
        assert torch.equal(kernels.logprobs_from_logits(x, t, T)[r], kernels.logprobs_from_logits(x[r:r + 1], t[r:r + 1], tr)[0])
        assert torch.equal(draw[r], kernels.masked_logits(x[r:r + 1], tr)[0])
    assert torch.equal(full.gather(1, t[:, None]).squeeze(1), kernels.sampled_logprobs(x, t, T))
    assert torch.equal(lp, kernels.processed_logprobs(x, T))
    assert not torch.equal(full[1], kernels.log_softmax(x[1:2], 1.0)[0])  # the temperature is applied


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return moe1b_checkpoint(tmp_path_factory)


def test_aligned_cuda_engine_bitwise(moe_ckpt, tmp_path):
    """The aligned class in CUDA vLLM (FULL CUDA graphs for decode): batch invariant, decode ==
    prefill, equal to the learner's kernels, and again after an in-place weight update."""
    import benchmarks.rollout_gpu as rg

    r = rg.check(moe_ckpt, str(tmp_path / "check.json"), which=("aligned",))["engines"]["aligned"]
    assert r["batch_invariance_equal"] == "8/8", r
    n = 16 * 64
    assert r["decode_eq_prefill_tokens"] == f"{n}/{n}", r
    assert r["learner_eq_engine_tokens"] == f"{8 * 64}/{8 * 64}", r
    assert r["after_update_learner_eq_engine_tokens"] == f"{8 * 32}/{8 * 32}", r
    json.dump(r, open(tmp_path / "r.json", "w"))
