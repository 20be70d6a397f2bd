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


def test_paged_split_decode_equals_one_pass_any_split_and_in_a_graph():
    """Decode over the paged cache split over 1..n programs per (sequence, KV head) (flash-decoding
    with chunk-aligned split points and an ordered merge): bitwise the one-pass kernel and the
    contiguous reference, for every split, with padded requests, and replayed from a CUDA graph
    captured at other lengths (the engine's FULL decode graphs)."""
    need_cuda()
    from kernels.triton import attn as A

    lens = [1, 255, 256, 257, 700, 1030, 2047, 64]
    nq = [1] * len(lens)
    q, kc, vc, bt, cu, pos, kcont, vcont, sl = _paged_setup(lens, nq, Hq=16, Hkv=4)
    D = q.shape[-1]
    ref = A.attention_batched(q, kcont, vcont, cu, pos, D ** -0.5, max_q_len=1, split_kv=False)
    nc = (bt.shape[1] * kc.shape[2] + A.KV_CHUNK - 1) // A.KV_CHUNK
    for splits in (1, 2, 3, 5, nc, None):
        out = torch.full_like(ref, float("nan"))
        A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=out, splits=splits)
        assert torch.equal(out, ref), splits
    # padded requests (no query) write nothing, whatever the split
    cu_pad = torch.cat([cu, cu[-1:].repeat(3)])
    sl_pad = torch.cat([sl, torch.zeros(3, device="cuda", dtype=torch.int32)])
    bt_pad = torch.cat([bt, torch.zeros(3, bt.shape[1], device="cuda", dtype=torch.int32)])
    for splits in (1, 4):
        out = torch.full_like(ref, float("nan"))
        A.paged_attention(q, kc, vc, bt_pad, cu_pad, sl_pad, D ** -0.5, max_q_len=1, out=out, splits=splits)
        assert torch.equal(out, ref), splits
    # captured with every sequence one key long, replayed at the real lengths
    sl_g = torch.ones_like(sl)
    out_g = torch.zeros_like(ref)
    A.paged_attention(q, kc, vc, bt, cu, sl_g, D ** -0.5, max_q_len=1, out=out_g, splits=4)  # JIT outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        A.paged_attention(q, kc, vc, bt, cu, sl_g, D ** -0.5, max_q_len=1, out=out_g, splits=4)
    sl_g.copy_(sl)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g, ref)
    assert A.decode_splits(1, 4, 16, 132) == 16 and A.decode_splits(512, 4, 16, 132) == 1 and A.decode_splits(256, 4, 16, 132) == 2


@pytest.mark.parametrize("rows", [64, 16])
def test_paged_decode_fused_merge_equals_the_merge_kernel(rows):
    """The fused merge (``RZ_DECODE_FUSED_MERGE``: the last split program of each (sequence, KV
    head) folds the chunk states; one launch instead of two) against the one-pass kernel: every
    split, padded requests, and 50 replays of a CUDA graph captured at other lengths whose lengths
    change between replays (the check-in counters must be back at 0 after every launch). This is
    the measurement that decides whether it is a launch plan on this GPU."""
    need_cuda()
    from kernels.triton import attn as A

    lens = [1, 63, 255, 256, 257, 700, 1030, 2047, 2600, 64, 5, 1500]
    nq = [1] * len(lens)
    q, kc, vc, bt, cu, pos, kcont, vcont, sl = _paged_setup(lens, nq, Hq=12, Hkv=2, seed=5)
    D = q.shape[-1]
    ref = A.attention_batched(q, kcont, vcont, cu, pos, D ** -0.5, max_q_len=1, split_kv=False)
    nc = (bt.shape[1] * kc.shape[2] + A.KV_CHUNK - 1) // A.KV_CHUNK
    for splits in (2, 3, 5, nc, None):
        out = torch.full_like(ref, float("nan"))
        A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=out, splits=splits, rows=rows,
                          fused_merge=True)
        assert torch.equal(out, ref), (rows, splits, (out.float() - ref.float()).abs().max().item())
    assert int(A._COUNTERS[str(q.device)].abs().sum()) == 0
    cu_pad = torch.cat([cu, cu[-1:].repeat(3)])
    sl_pad = torch.cat([sl, torch.zeros(3, device="cuda", dtype=torch.int32)])
    bt_pad = torch.cat([bt, torch.zeros(3, bt.shape[1], device="cuda", dtype=torch.int32)])
    out = torch.full_like(ref, float("nan"))
    A.paged_attention(q, kc, vc, bt_pad, cu_pad, sl_pad, D ** -0.5, max_q_len=1, out=out, splits=4, rows=rows,
                      fused_merge=True)
    assert torch.equal(out, ref)
    # a graph captured at length 1, replayed at shorter and full lengths in turn
    sl_g = torch.ones_like(sl)
    out_g = torch.zeros_like(ref)
    A.paged_attention(q, kc, vc, bt, cu, sl_g, D ** -0.5, max_q_len=1, out=out_g, splits=6, rows=rows, fused_merge=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        A.paged_attention(q, kc, vc, bt, cu, sl_g, D ** -0.5, max_q_len=1, out=out_g, splits=6, rows=rows,
                          fused_merge=True)
    half = torch.clamp(sl // 2, min=1)
    ref_half = A.attention_batched(q, kcont, vcont, cu, half - 1, D ** -0.5, max_q_len=1, split_kv=False)
    for i in range(50):
        sl_g.copy_(sl if i % 2 == 0 else half)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, ref if i % 2 == 0 else ref_half), (rows, i)
    assert int(A._COUNTERS[str(q.device)].abs().sum()) == 0


@pytest.mark.parametrize("Hq,Hkv", [(16, 4), (32, 4), (12, 2), (16, 16), (16, 1), (8, 8)])
def test_paged_decode_with_fewer_rows_per_program_equals_the_64_row_tile(Hq, Hkv):
    """The 16-row split-KV decode programs (``rows``, ``RZ_DECODE_ROWS``) against the 64-row
    prefill tile of the contract: every decode row's bits, for GQA groups of 1 to 16 heads, lengths
    around tile and chunk edges, every split, and replayed from a CUDA graph. This is the
    measurement that decides whether the 16-row plan is a launch plan on this GPU (one warp, laid
    out as each warp of the 64-row tile): if it fails, it must stay off."""
    need_cuda()
    from kernels.triton import attn as A

    lens = [1, 63, 64, 65, 255, 256, 257, 700, 1030, 2047, 2600]
    nq = [1] * len(lens)
    q, kc, vc, bt, cu, pos, kcont, vcont, sl = _paged_setup(lens, nq, Hq=Hq, Hkv=Hkv, seed=Hq + Hkv)
    D = q.shape[-1]
    ref = A.attention_batched(q, kcont, vcont, cu, pos, D ** -0.5, max_q_len=1, split_kv=False)
    nc = (bt.shape[1] * kc.shape[2] + A.KV_CHUNK - 1) // A.KV_CHUNK
    G = Hq // Hkv
    for rows in (16,):
        assert A.decode_tile(G, rows) == (16, 1)  # every group here fits 16 rows
        for splits in (1, 2, 3, nc, None):
            out = torch.full_like(ref, float("nan"))
            A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=out, splits=splits, rows=rows)
            assert torch.equal(out, ref), (rows, splits, (out.float() - ref.float()).abs().max().item())
        sl_g = torch.ones_like(sl)
        out_g = torch.zeros_like(ref)
        A.paged_attention(q, kc, vc, bt, cu, sl_g, D ** -0.5, max_q_len=1, out=out_g, splits=4, rows=rows)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            A.paged_attention(q, kc, vc, bt, cu, sl_g, D ** -0.5, max_q_len=1, out=out_g, splits=4, rows=rows)
        sl_g.copy_(sl)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, ref), rows


def test_fused_work_list_equals_torch_work_list():
    """The one-kernel MoE work list (decode) has exactly the values of the torch sort / scan one,
    for skewed and uniform routings, and moe_experts gives the same bits through either."""
    need_cuda()
    from kernels import settings
    from kernels.triton import moe as M

    g = torch.Generator(device="cuda").manual_seed(0)
    for T, k, E, bm in [(1, 4, 32, 16), (64, 4, 32, 16), (256, 8, 128, 16), (512, 6, 256, 64), (37, 2, 8, 128)]:
        ids = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :k].to(torch.int32)
        ids[: T // 2] = ids[0].clone()  # half the tokens to the same experts
        ref = M.make_work_list(ids.reshape(-1).to(torch.int64), E, bm)
        got = M.work_list_fused(ids.reshape(-1), E, bm, k)
        assert torch.equal(got[0], ref[0].to(torch.int32)) and torch.equal(got[1], (ref[0] // k).to(torch.int32))
        for a, b in zip(got[2:], ref[1:]):
            assert torch.equal(a, b), (T, k, E, bm)
    T, H, I, E, k = 48, 256, 128, 16, 4
    x = randn(T, H, seed=1)
    wg, wu, wd = randn(E, I, H, seed=2, scale=0.05), randn(E, I, H, seed=3, scale=0.05), randn(E, H, I, seed=4, scale=0.05)
    ids = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :k]
    wts = torch.rand(T, k, device="cuda", generator=g).to(torch.bfloat16)
    fused = M.moe_experts(x, wg, wu, wd, ids, wts)
    settings.set_fused_work_list(False)
    try:
        plain = M.moe_experts(x, wg, wu, wd, ids, wts)
    finally:
        settings.set_fused_work_list(True)
    assert torch.equal(fused, plain)


def test_rms_norm_reads_head_slices_in_place():
    """q / k heads sliced from the fused q/k/v GEMM output are normed through their strides (no
    copy) with the bits of the contiguous rows."""
    need_cuda()
    from kernels.triton.rmsnorm import rms_norm

    y = randn(33, 16 * 128 + 2 * 4 * 128, seed=9)
    w = randn(128, seed=10)
    for t in (y[:, :2048].reshape(33, 16, 128), y[:, 2048:2560].reshape(33, 4, 128)):
        assert torch.equal(rms_norm(t, w, 1e-6), rms_norm(t.contiguous().reshape(-1, 128), w, 1e-6).reshape(t.shape))


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


def test_batched_keyed_draw():
    """The aligned sampler's one-launch draw on the GPU: exact samples of softmax(l / T) (chi-square
    over 200k keyed draws), greedy rows argmax, a seeded request's token the same alone and in a
    batch, its key (seed, draw count) kept in its own CUDA generator (advanced once per draw)."""
    need_cuda()
    from kernels.triton.draw import gumbel_draw
    from vllm_bridge.sampler_patch import DrawKeys

    V = 50
    lg = randn(1, V, dtype=torch.float32, seed=12, scale=2.0)
    M = 200_000
    keys = torch.stack([torch.full((M,), 5, device="cuda"), torch.arange(M, device="cuda")], 1)
    d = gumbel_draw(lg.expand(M, V).contiguous(), torch.full((M,), 0.8, device="cuda"), keys)
    p = torch.softmax(lg[0].double() / 0.8, -1)
    chi2 = float((((torch.bincount(d, minlength=V).double() - M * p) ** 2) / (M * p)).sum())
    assert chi2 < 86.7, chi2  # the 0.1% tail of chi-square(49); deterministic (fixed keys)
    x = randn(9, 151936, dtype=torch.float32, seed=13, scale=4.0)
    T = torch.tensor([1.0, 0.0, 0.7, 1.0, 0.0, 1.3, 1.0, 1.0, 0.5], device="cuda")
    gens = {r: torch.Generator(device="cuda").manual_seed(100 + r) for r in (0, 2, 5, 7)}
    k, _ = DrawKeys().step(9, gens, x.device)
    assert all(g.get_offset() == 4 for g in gens.values())
    tok = gumbel_draw(x, T, k)
    assert torch.equal(tok[[1, 4]], x[[1, 4]].argmax(1))
    for r in (0, 2, 5, 7):
        alone_gen = {0: torch.Generator(device="cuda").manual_seed(100 + r)}
        ka, _ = DrawKeys().step(1, alone_gen, x.device)
        assert torch.equal(gumbel_draw(x[r:r + 1], T[r:r + 1], ka), tok[r:r + 1]), r
    k2, _ = DrawKeys().step(9, gens, x.device)  # the next draw of the same requests: a new key
    assert torch.equal(k2[[0, 2, 5, 7], 1], k[[0, 2, 5, 7], 1] + 1)


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


def test_aligned_cuda_engine_bitwise_on_the_v2_runner(moe_ckpt, tmp_path, monkeypatch):
    """The same on vLLM's V2 GPU model runner (``VLLM_USE_V2_MODEL_RUNNER=1``; stock vLLM's default
    for dense models): the V2 halves of the sampler patch (sampler_patch.apply_v2) and of the
    prompt logprobs (vllm_patches), keyed draws by (request seed, position)."""
    import benchmarks.rollout_gpu as rg

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    r = rg.check(moe_ckpt, str(tmp_path / "check.json"), which=("aligned",))["engines"]["aligned"]
    assert r["model_runner"].startswith("vllm.v1.worker.gpu.model_runner"), r  # the V2 runner really ran
    assert r["batch_invariance_equal"] == "8/8", r
    n = 16 * 64
    assert r["decode_eq_prefill_tokens"] == f"{n}/{n}", r
    assert r["learner_eq_engine_tokens"] == f"{8 * 64}/{8 * 64}", r
    assert r["after_update_learner_eq_engine_tokens"] == f"{8 * 32}/{8 * 32}", r



def test_aligned_cuda_engine_bitwise_with_the_small_batch_plans(moe_ckpt, tmp_path, monkeypatch):
    """The same with the opt-in small-batch launch plans on (``RZ_MOE_NARROW_TILES``: narrow grouped
    MoE tiles; ``RZ_MOE_DIRECT_ROWS``: a few rows' experts without a work list; ``RZ_QK_ONE_LAUNCH``: Qwen3's q/k norms in one launch, their RoPE in one): still batch
    invariant, decode == prefill and equal to the learner's kernels, which run the default plans.
    This is the measurement that decides whether the plans may become the defaults."""
    import benchmarks.rollout_gpu as rg

    from kernels import settings

    monkeypatch.setenv("RZ_MOE_NARROW_TILES", "1")  # the engine's processes read these at start
    monkeypatch.setenv("RZ_MOE_DIRECT_ROWS", "1")
    monkeypatch.setenv("RZ_QK_ONE_LAUNCH", "1")
    before = settings.moe_narrow_tiles(), settings.moe_direct_rows(), settings.qk_one_launch()
    settings.set_moe_narrow_tiles(False)  # this process (the learner side): the default plans
    settings.set_moe_direct_rows(False)
    settings.set_qk_one_launch(False)
    try:
        r = rg.check(moe_ckpt, str(tmp_path / "check.json"), which=("aligned",))["engines"]["aligned"]
    finally:
        settings.set_moe_narrow_tiles(before[0])
        settings.set_moe_direct_rows(before[1])
        settings.set_qk_one_launch(before[2])
    assert r["batch_invariance_equal"] == "8/8", r
    n = 16 * 64
    assert r["decode_eq_prefill_tokens"] == f"{n}/{n}", r
    assert r["learner_eq_engine_tokens"] == f"{8 * 64}/{8 * 64}", r
