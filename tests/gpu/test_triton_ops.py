"""GPU tests of the Triton RoPE, router, MoE experts, batched attention and the device dispatch.

Skipped without CUDA. On the GPU machine:

    PYTHONPATH=. python -m pytest tests/gpu/test_triton_ops.py -q

Each op: bitwise invariance over batch sizes 1..256 and random compositions (a row computed alone
equals the same row inside any batch), and agreement with the exact CPU reference within the stated
tolerance (bitwise where the op has no reduction).
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = pytest.mark.gpu


from gpu_util import gen as _gen, need_cuda as _need_cuda, randn as _randn  # noqa: E402,F401


def _mod(name):
    return importlib.import_module(f"kernels.triton.{name}")


def _compositions(n_pool, seed, trials=24, max_m=256):
    g = torch.Generator().manual_seed(seed)
    for t in range(trials):
        M = int(torch.randint(1, max_m + 1, (1,), generator=g))
        yield torch.randint(0, n_pool, (M,), generator=g).cuda()


# ------------------------------------------------------------------------------------------ RoPE


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_bitwise_cpu_and_invariant(style, dtype):
    """RoPE is elementwise: bitwise equal to the CPU reference (same tables), any batch."""
    _need_cuda()
    from kernels import rope as R

    rope = _mod("rope")
    T, H, D = 300, 8, 128
    x = _randn(T, H, D, seed=1, dtype=dtype)
    pos = torch.randint(0, 32768, (T,), generator=torch.Generator().manual_seed(2))
    cos, sin = R.rope_cos_sin(pos, 64, 1e6)  # partial rotary (r = 64 < D): dims 64.. pass through
    cc, ss = cos.cuda(), sin.cuda()
    y = rope.apply_rope(x, cc, ss, style)
    ref = R.apply_rope(x.cpu(), cos, sin, style)
    assert torch.equal(y.cpu(), ref), f"max diff {(y.cpu().float() - ref.float()).abs().max()}"
    # tables built on the GPU (float64 cos/sin there) give the same rounded fp32 tables here
    cg, sg = R.rope_cos_sin(pos.cuda(), 64, 1e6)
    frac = (cg.cpu() != cos).float().mean().item()
    print(f"GPU vs CPU fp32 cos table mismatch fraction {frac:.2e}")
    for M in range(1, 257):
        assert torch.equal(rope.apply_rope(x[:M], cc[:M], ss[:M], style), y[:M])
    for idx in _compositions(T, 3):
        assert torch.equal(rope.apply_rope(x[idx], cc[idx], ss[idx], style), y[idx])


def test_rope_mla_decoupled_views():
    """MLA: rope part of q (a strided view [T, H, nope+rope][..., nope:]) and the shared k_pe
    [T, 1, rope]; interleaved and neox; broadcast tables [s, 1, r/2] over [s, b, h, d]."""
    _need_cuda()
    from kernels import rope as R

    rope = _mod("rope")
    T, H, nope, r = 77, 16, 128, 64
    q = _randn(T, H, nope + r, seed=4)
    kpe = _randn(T, 1, r, seed=5)
    cos, sin = R.rope_cos_sin(torch.arange(T), r, 10000.0)
    for style in ("interleaved", "neox"):
        qp = q[..., nope:]
        assert torch.equal(rope.apply_rope(qp, cos.cuda(), sin.cuda(), style).cpu(),
                           R.apply_rope(qp.cpu(), cos, sin, style))
        assert torch.equal(rope.apply_rope(kpe, cos.cuda(), sin.cuda(), style).cpu(),
                           R.apply_rope(kpe.cpu(), cos, sin, style))
    x4 = _randn(T, 3, 4, 64, seed=6)  # Megatron [s, b, h, d]
    c4, s4 = cos[:, None, :], sin[:, None, :]
    assert torch.equal(rope.apply_rope(x4, c4.cuda(), s4.cuda(), "neox").cpu(),
                       R.apply_rope(x4.cpu(), c4, s4, "neox"))


# ---------------------------------------------------------------------------------------- router

ROUTER_CASES = {
    "qwen3_softmax": dict(E=128, k=8, kw=dict(score="softmax", norm_topk_prob=True)),
    "softmax_raw": dict(E=64, k=6, kw=dict(score="softmax")),
    "dsv3_sigmoid_grouped": dict(E=256, k=8, kw=dict(score="sigmoid", num_groups=8, group_topk=4,
                                                      norm_topk_prob=True, scaling_factor=2.5), bias=True),
    # DeepSeek-V4: sqrtsoftplus scores, biased selection, normalised, scaled (tiny_dsv4's router)
    "dsv4_sqrtsoftplus": dict(E=256, k=6, kw=dict(score="sqrtsoftplus", norm_topk_prob=True, scaling_factor=1.5),
                              bias=True),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_invariance_and_cpu_agreement(case):
    _need_cuda()
    from kernels import router as RT

    route = _mod("router").route
    c = ROUTER_CASES[case]
    E, k, kw = c["E"], c["k"], dict(c["kw"])
    if c.get("bias"):
        kw["expert_bias"] = _randn(E, seed=7, dtype=torch.float32, scale=0.05)
    logits = _randn(600, E, seed=8, dtype=torch.float32, scale=2.0)
    ids_all, w_all = route(logits, k, **kw)
    alone = [route(logits[i:i + 1], k, **kw) for i in range(256)]
    ids1 = torch.cat([a[0] for a in alone])
    w1 = torch.cat([a[1] for a in alone])
    assert torch.equal(ids1, ids_all[:256]) and torch.equal(w1, w_all[:256])
    for M in range(1, 257):
        i, w = route(logits[:M], k, **kw)
        assert torch.equal(i, ids1[:M]) and torch.equal(w, w1[:M]), f"M={M}"
    for idx in _compositions(600, 9):
        i, w = route(logits[idx], k, **kw)
        assert torch.equal(i, ids_all[idx]) and torch.equal(w, w_all[idx])
    # vs the exact CPU reference: same experts (continuous random logits: no near-ties), weights ~ulp
    kw_cpu = {kk: (v.cpu() if isinstance(v, torch.Tensor) else v) for kk, v in kw.items()}
    ids_c, w_c = RT.route(logits.cpu(), k, **kw_cpu)
    same = (ids_c == ids_all.cpu()).all(dim=1).float().mean().item()
    err = (w_c - w_all.cpu()).abs().max().item()
    print(f"{case}: rows with identical ids {same:.4f}, max |dw| {err:.2e}")
    assert same == 1.0
    assert err < 2e-6 * max(1.0, kw.get("scaling_factor", 1.0))
    # bf16 logits (HF Qwen3 rounds router logits to bf16): ties happen; lowest id must win, as on CPU
    lb = logits.to(torch.bfloat16)
    i_b, _ = route(lb, k, **kw)
    i_bc, _ = RT.route(lb.cpu(), k, **kw_cpu)
    print(f"{case}: bf16 logits rows with identical ids {(i_bc == i_b.cpu()).all(1).float().mean().item():.4f}")


def test_router_ties_lowest_id():
    _need_cuda()
    route = _mod("router").route
    lg = torch.zeros(3, 16, device="cuda")
    lg[1, 3] = lg[1, 9] = 2.0
    lg[2] = torch.tensor([1.0] * 8 + [3.0] * 8)
    ids, _ = route(lg, 4)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 9, 0, 1], [8, 9, 10, 11]]
    # grouped: equal group scores -> lowest group id kept
    ids, _ = route(torch.zeros(1, 16, device="cuda"), 2, score="sigmoid", num_groups=4, group_topk=1)
    assert ids.tolist() == [[0, 1]]


# ------------------------------------------------------------------------------------------- MoE

MOE_CASES = {
    "qwen3_like": dict(H=1024, I=512, E=32, k=4, route=dict(score="softmax", norm_topk_prob=True), shared=False),
    "dsv3_like": dict(H=2048, I=256, E=64, k=6, route=dict(score="sigmoid", num_groups=8, group_topk=4,
                                                            norm_topk_prob=True, scaling_factor=2.5), shared=True),
}


def _moe_setup(c, seed=10, pool=512):
    H, I, E = c["H"], c["I"], c["E"]
    x = _randn(pool, H, seed=seed)
    wgu = _randn(E, 2 * I, H, seed=seed + 1, scale=H ** -0.5)
    wd = _randn(E, H, I, seed=seed + 2, scale=I ** -0.5)
    wr = _randn(E, H, seed=seed + 3, scale=H ** -0.5)
    route = _mod("router").route
    from kernels.triton import linear

    logits = linear(x, wr, out_dtype=torch.float32, k_segments=1)
    ids, w = route(logits, c["k"], **c["route"])
    sh = None
    if c["shared"]:
        sh = (_randn(I, H, seed=seed + 4, scale=H ** -0.5), _randn(I, H, seed=seed + 5, scale=H ** -0.5),
              _randn(H, I, seed=seed + 6, scale=I ** -0.5))
    return x, wgu, wd, ids, w, sh


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_grouped_invariance(case):
    """A token's MoE output does not depend on how many tokens each expert received."""
    _need_cuda()
    moe = _mod("moe")
    c = MOE_CASES[case]
    x, wgu, wd, ids, w, sh = _moe_setup(c)

    def run(idx):
        xs = x[idx]
        so = moe.expert_mlp(xs, *sh) if sh else None
        return moe.moe_experts_merged(xs, wgu, wd, ids[idx], w[idx], so)

    full = run(torch.arange(512, device="cuda"))
    alone = torch.cat([run(torch.tensor([i], device="cuda")) for i in range(256)])
    assert torch.equal(alone, full[:256])
    for M in range(1, 257):
        assert torch.equal(run(torch.arange(M, device="cuda")), alone[:M]), f"M={M}"
    for idx in _compositions(512, 11):
        assert torch.equal(run(idx), full[idx])
    # a big prefill-sized batch (128-row tiles): same bits for its first rows
    big = torch.arange(512, device="cuda").repeat(8)
    assert torch.equal(run(big)[:512], full)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_grouped_equals_dense_per_token(case):
    """Grouped kernel == per-token dense path with the invariant GEMM (same K chains), bitwise;
    separate gate/up weights == merged weight; and close to the exact CPU reference."""
    _need_cuda()
    moe = _mod("moe")
    from kernels.gemm import ROW_PARALLEL_K_SEGMENTS  # the experts' down_proj segments (row-parallel)
    from kernels.triton import linear

    c = MOE_CASES[case]
    x, wgu, wd, ids, w, sh = _moe_setup(c)
    I = c["I"]
    T = 40
    so = moe.expert_mlp(x[:T], *sh) if sh else None
    y = moe.moe_experts_merged(x[:T], wgu, wd, ids[:T], w[:T], so)
    y_sep = moe.moe_experts(x[:T], wgu[:, :I].contiguous(), wgu[:, I:].contiguous(), wd, ids[:T], w[:T], so)
    assert torch.equal(y, y_sep)
    outs = torch.empty(T, c["k"], c["H"], device="cuda", dtype=x.dtype)
    for t in range(T):
        for j in range(c["k"]):
            e = int(ids[t, j])
            g = linear(x[t:t + 1], wgu[e, :I], k_segments=1)
            u = linear(x[t:t + 1], wgu[e, I:], k_segments=1)
            outs[t, j] = linear(moe.swiglu(g, u), wd[e], k_segments=ROW_PARALLEL_K_SEGMENTS)[0]
    dense = moe.moe_combine(outs, w[:T], so)
    assert torch.equal(y, dense)
    # CPU reference (exact, slow): a few tokens, bf16; agreement within bf16 rounding of the outputs
    from kernels import moe as M

    n = 6
    sh_cpu = [tuple(t.cpu() for t in sh)] if sh else None
    ref = M.moe_experts(x[:n].cpu(), wgu[:, :I].cpu(), wgu[:, I:].cpu(), wd.cpu(), ids[:n].cpu(), w[:n].cpu(), sh_cpu)
    rel = ((y[:n].cpu().float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{case}: rel err vs CPU reference {rel:.2e}")
    assert rel < 1e-2


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_narrow_tiles_give_the_default_plans_bits(case):
    """The small-batch grouped-GEMM plans (kernels.settings.set_moe_narrow_tiles: 32- or 16-column
    tiles, one warp per 16 columns; set_moe_direct_rows: one program row per (token, slot) row, no
    work list), each and together, against the default plan, bitwise, for every
    batch of 1..40 tokens and 64, also through the segmented down_proj and grouped_linear; and a
    token alone under the narrow plan equals the token inside the default plan's 512-row batch."""
    _need_cuda()
    moe = _mod("moe")
    from kernels import settings

    c = MOE_CASES[case]
    x, wgu, wd, ids, w, sh = _moe_setup(c)
    before = settings.moe_narrow_tiles(), settings.moe_direct_rows()
    plans = [(False, False), (True, False), (False, True), (True, True)]  # (narrow tiles, direct rows)
    try:
        outs = {}
        for narrow, direct in plans:
            settings.set_moe_narrow_tiles(narrow)
            settings.set_moe_direct_rows(direct)
            outs[narrow, direct] = [moe.moe_experts_merged(x[:T], wgu, wd, ids[:T], w[:T])
                                    for T in list(range(1, 41)) + [64]]
            outs[narrow, direct].append(moe.grouped_linear(x[:3], wgu[:, :c["I"]].contiguous(), ids[:3, 0],
                                                           k_segments=8))
        settings.set_moe_narrow_tiles(False)
        settings.set_moe_direct_rows(False)
        full = moe.moe_experts_merged(x, wgu, wd, ids, w)
    finally:
        settings.set_moe_narrow_tiles(before[0])
        settings.set_moe_direct_rows(before[1])
    for plan in plans[1:]:
        for i, (a, b) in enumerate(zip(outs[plans[0]], outs[plan])):
            assert torch.equal(a, b), f"plan {plan}, output {i}"
    assert torch.equal(outs[True, True][0], full[:1])
    assert moe.direct_rows(1 * c["k"], c["E"], on=True)  # batch 1 did take the direct plan
    assert moe.grouped_tile_n(1 * c["k"], c["E"], c["I"], 16, True, 132, narrow=True)[0] < 64  # the plan did narrow


def test_grouped_linear_matches_dense():
    _need_cuda()
    moe = _mod("moe")
    from kernels.triton import linear

    E, N, K = 16, 768, 1024
    x = _randn(300, K, seed=12)
    w = _randn(E, N, K, seed=13, scale=K ** -0.5)
    eid = torch.randint(0, E, (300,), device="cuda", generator=_gen(14))
    for segs in (1, 2, 4):
        y = moe.grouped_linear(x, w, eid, k_segments=segs)
        for i in (0, 1, 150, 299):
            assert torch.equal(y[i:i + 1], linear(x[i:i + 1], w[int(eid[i])], k_segments=segs))


@pytest.mark.parametrize("K,segs", [(64, 8), (200, 8), (48, 2)])
def test_grouped_linear_segments_shorter_than_a_tile(K, segs):
    """An expert's row-parallel segments of 6..25 columns (tiny_dsv3's 64-wide expert down_proj in 8
    segments): 16-wide tiles masked at each segment's end, every row bitwise the dense Triton GEMM of
    its expert at the same segmentation, at any number of rows."""
    _need_cuda()
    moe = _mod("moe")
    from kernels.triton import linear

    E, N = 5, 40
    x = _randn(300, K, seed=K + 20)
    w = _randn(E, N, K, seed=K + 21, scale=K ** -0.5)
    eid = torch.randint(0, E, (300,), device="cuda", generator=_gen(K + 22))
    full = moe.grouped_linear(x, w, eid, k_segments=segs)
    for R in (1, 7, 300):
        y = moe.grouped_linear(x[:R].contiguous(), w, eid[:R].contiguous(), k_segments=segs)
        assert torch.equal(y, full[:R]), f"R={R}"
    for i in (0, 1, 150, 299):
        assert torch.equal(full[i:i + 1], linear(x[i:i + 1], w[int(eid[i])], k_segments=segs))


def test_swiglu_and_combine_vs_cpu():
    _need_cuda()
    moe = _mod("moe")
    from kernels import moe as M

    g = _randn(300, 512, seed=15, dtype=torch.float32, scale=3)
    u = _randn(300, 512, seed=16, dtype=torch.float32)
    a = moe.swiglu(g, u)
    r = M.swiglu(g.cpu(), u.cpu())
    print("swiglu fp32 max |d|", (a.cpu() - r).abs().max().item())
    assert torch.allclose(a.cpu(), r, rtol=1e-6, atol=1e-6)
    gb, ub = g.bfloat16(), u.bfloat16()
    ab = moe.swiglu(gb, ub)
    assert (ab.cpu() != M.swiglu(gb.cpu(), ub.cpu())).float().mean().item() < 0.01
    for M_ in (1, 7, 300):
        assert torch.equal(moe.swiglu(g[:M_], u[:M_]), a[:M_])
    y = _randn(50, 6, 384, seed=17)
    w = torch.rand(50, 6, device="cuda", generator=_gen(18))
    s = _randn(50, 384, seed=19)
    c = moe.moe_combine(y, w, s)
    # combine is elementwise fp32 in slot order with no FMA: bitwise the CPU reference
    assert torch.equal(c.cpu(), M.moe_combine(y.cpu(), w.cpu(), s.cpu()))
    assert torch.equal(moe.moe_combine(y, w, [s, s]).cpu(), M.moe_combine(y.cpu(), w.cpu(), [s.cpu(), s.cpu()]))


def test_combine_rounds_routing_weights_in_the_kernel_as_torch_does():
    """moe_combine(..., weights_dtype=bf16 / fp16) == moe_combine of ``w.to(dtype)`` on the GPU, bit for
    bit (the aligned engine's Qwen3-MoE path rounds its fp32 routing weights there, not in a launch of
    its own); with k = 1 and unit outputs, the rounded weights themselves (ties, overflow to inf; subnormals
    against torch's rounding read by the same kernel)."""
    _need_cuda()
    moe = _mod("moe")
    v = torch.cat([torch.randn(3000, device="cuda", generator=_gen(30))
                   * 10.0 ** torch.randint(-30, 30, (3000,), device="cuda", generator=_gen(31)).float(),
                   1.0 + torch.arange(0, 2048, device="cuda").float() * 2.0 ** -9,
                   torch.tensor([0.0, -0.0, 1e-40, -1e-41, 3.0e38, 3.39e38, float("inf")], device="cuda")])
    ones = torch.ones(v.numel(), 1, 8, device="cuda")
    for wd in (torch.bfloat16, torch.float16):
        got = moe.moe_combine(ones, v[:, None], out_dtype=torch.float32, weights_dtype=wd)[:, 0]
        # against torch's rounding read by the same kernel (whatever the GPU does with subnormals)
        assert torch.equal(got, moe.moe_combine(ones, v[:, None].to(wd), out_dtype=torch.float32)[:, 0]), wd
        normal = (v == 0) | (v.to(wd).float().abs() >= torch.finfo(wd).tiny)
        assert torch.equal(got[normal], v.to(wd).float()[normal]), wd
    y, s = _randn(64, 8, 384, seed=32), _randn(64, 384, seed=33)
    w = torch.softmax(torch.randn(64, 8, device="cuda", generator=_gen(34)), -1)
    for shared in (None, s):
        assert torch.equal(moe.moe_combine(y, w, shared, weights_dtype=torch.bfloat16),
                           moe.moe_combine(y, w.to(torch.bfloat16), shared))


# ------------------------------------------------------------------------------------- attention


def test_attention_batched_equals_single_and_decode():
    """GQA-packed batched kernel: every row equals the single-sequence kernel; decode batches of
    mixed lengths equal full-sequence rows."""
    _need_cuda()
    A = _mod("attn")
    Hq, Hkv, D = 16, 4, 128
    lens = [1, 5, 63, 64, 65, 200, 256, 257, 333, 700]  # chunk boundaries at 256, 512
    B, Smax = len(lens), 800
    kc = torch.zeros(B, Smax, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    qs, fulls = [], []
    for b, L in enumerate(lens):
        kc[b, :L] = _randn(L, Hkv, D, seed=20 + b)
        vc[b, :L] = _randn(L, Hkv, D, seed=40 + b)
        q = _randn(L, Hq, D, seed=60 + b)
        qs.append(q)
        fulls.append(A.attention(q, kc[b, :L].contiguous(), vc[b, :L].contiguous(), torch.arange(L, device="cuda"),
                                 D ** -0.5))
    # packed prefill of all sequences in one launch
    q_all = torch.cat(qs)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    pos = torch.cat([torch.arange(L, device="cuda") for L in lens])
    out = A.attention_batched(q_all, kc, vc, cu, pos, D ** -0.5, max_q_len=max(lens))
    assert torch.equal(out, torch.cat(fulls))
    # decode: every sequence's last token, batched
    qd = torch.stack([q[-1] for q in qs])
    cud = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    pd = torch.tensor([L - 1 for L in lens], device="cuda")
    od = A.attention_batched(qd, kc, vc, cud, pd, D ** -0.5, max_q_len=1)  # split-KV + ordered merge
    od_ns = A.attention_batched(qd, kc, vc, cud, pd, D ** -0.5, max_q_len=1, split_kv=False)
    for b in range(B):
        assert torch.equal(od[b], fulls[b][-1]), f"seq {b}"
        assert torch.equal(od_ns[b], fulls[b][-1]), f"seq {b} (no split)"
    # every earlier position of the longest sequence as a decode query over its zero-padded cache row
    Lmax = lens[-1]
    qq = qs[-1]
    od_all = A.attention_batched(qq, kc[-1:].expand(Lmax, -1, -1, -1), vc[-1:].expand(Lmax, -1, -1, -1),
                                 torch.arange(Lmax + 1, device="cuda", dtype=torch.int32),
                                 torch.arange(Lmax, device="cuda"), D ** -0.5, max_q_len=1)
    assert torch.equal(od_all, fulls[-1])
    # subsets of the decode batch (other sequences absent)
    for b in range(B):
        o1 = A.attention_batched(qd[b:b + 1], kc[b:b + 1], vc[b:b + 1], cud[:2], pd[b:b + 1], D ** -0.5, max_q_len=1)
        assert torch.equal(o1[0], fulls[b][-1])
    # chunked prefill of the longest sequence in two chunks
    L = lens[-1]
    a = 150
    c1 = A.attention_batched(qs[-1][a:], kc[-1:], vc[-1:], torch.tensor([0, L - a], device="cuda", dtype=torch.int32),
                             torch.arange(a, L, device="cuda"), D ** -0.5, max_q_len=L - a)
    assert torch.equal(c1, fulls[-1][a:])


# -------------------------------------------------------------------------------------- dispatch


def test_dispatch_picks_device():
    """kernels.<op> runs Triton on CUDA tensors and the exact reference on CPU tensors."""
    _need_cuda()
    import kernels
    from kernels import dispatch
    from kernels import gemm as G
    from kernels import norm as Nm

    x = _randn(33, 256, seed=70)
    w = _randn(128, 256, seed=71, scale=1 / 16)
    from kernels.triton import linear as tl_linear, rms_norm as tl_rms

    assert torch.equal(kernels.linear(x, w), tl_linear(x, w, k_segments=1))
    assert torch.equal(kernels.linear(x, w, k_segments=2), tl_linear(x, w, k_segments=2))
    assert torch.equal(kernels.linear(x.cpu(), w.cpu()), G.linear(x.cpu(), w.cpu()))
    nw = _randn(256, seed=72)
    assert torch.equal(kernels.rms_norm(x, nw, 1e-6), tl_rms(x, nw, 1e-6))
    assert torch.equal(kernels.rms_norm(x.cpu(), nw.cpu(), 1e-6), Nm.rms_norm(x.cpu(), nw.cpu(), 1e-6))
    dispatch.set_backend("reference")
    try:
        assert torch.equal(kernels.linear(x, w).cpu(), G.linear(x.cpu(), w.cpu()))  # reference ops on CUDA
    finally:
        dispatch.set_backend("auto")
    # N-invariance on GPU through the dispatch: a column shard / merged weight gives the same bits
    assert torch.equal(kernels.linear(x, w[:64]), kernels.linear(x, w)[:, :64])
    # TP row-parallel composition through the public API
    parts = [kernels.linear_partial(x[:, :128], w[:, :128]), kernels.linear_partial(x[:, 128:], w[:, 128:])]
    assert torch.equal(kernels.finish_linear(kernels.sum_partials(parts), None, x.dtype),
                       kernels.linear(x, w, k_segments=2))
    # every op dispatches and runs; gradients flow (reference backward)
    xg = x.float().requires_grad_()
    wg = w.float().requires_grad_()
    kernels.linear(xg, wg).sum().backward()
    assert xg.grad is not None and wg.grad is not None
    lg = _randn(20, 32, seed=73, dtype=torch.float32).requires_grad_()
    ids, wts = kernels.route(lg, 4, norm_topk_prob=True)
    wts.sum().backward()
    assert lg.grad is not None
    q = _randn(1, 3, 50, 4, 64, seed=74).squeeze(0)
    k = _randn(3, 50, 2, 64, seed=75)
    v = _randn(3, 50, 2, 64, seed=76)
    o = kernels.causal_attention(q, k, v, 0.125)
    o_ref = torch.stack([kernels.attention(q[b], k[b], v[b], torch.arange(50, device="cuda"), 0.125) for b in range(3)])
    assert torch.equal(o, o_ref)
    o_cpu = kernels.causal_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), 0.125)
    assert (o.float().cpu() - o_cpu).abs().max().item() < 5e-2
    lp = kernels.token_logprobs(x, _randn(1000, 256, seed=77, scale=1 / 16),
                               torch.randint(0, 1000, (33,), device="cuda"))
    assert lp.dtype == torch.float32 and lp.is_cuda
    from kernels import rope as R

    cos, sin = R.rope_cos_sin(torch.arange(33), 64)
    xr = x.view(33, 4, 64)
    assert torch.equal(kernels.apply_rope(xr, cos.cuda(), sin.cuda()).cpu(), kernels.apply_rope(xr.cpu(), cos, sin))


@pytest.mark.parametrize("Hq,Hkv", [(16, 4), (32, 4), (8, 8)])
def test_qk_norms_in_one_launch_give_the_two_launches_bits(Hq, Hkv):
    """kernels.qk_rms_norm (RZ_QK_ONE_LAUNCH: Qwen3's q and k norms over the packed q/k/v GEMM output
    in one launch) == rms_norm of q and of k, bitwise, for 1..300 tokens; then one RoPE launch over
    both == the two RoPE launches."""
    _need_cuda()
    from kernels.triton.rmsnorm import qk_rms_norm, rms_norm
    from kernels.triton.rope import apply_rope

    D = 128
    y = _randn(300, (Hq + 2 * Hkv) * D, seed=Hq + Hkv)
    wq, wk = _randn(D, seed=3), _randn(D, seed=4)
    pos = torch.arange(300, device="cuda", dtype=torch.float64)[:, None]
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D))
    cos, sin = torch.cos(pos * inv).float(), torch.sin(pos * inv).float()
    for T in (1, 2, 7, 64, 300):
        yt = y[:T]
        one = qk_rms_norm(yt[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), wq, wk, Hq, 1e-6)
        q = rms_norm(yt[:, :Hq * D].reshape(T, Hq, D), wq, 1e-6)
        k = rms_norm(yt[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D), wk, 1e-6)
        assert torch.equal(one[:, :Hq], q) and torch.equal(one[:, Hq:], k), T
        r = apply_rope(one, cos[:T], sin[:T], "neox")
        assert torch.equal(r[:, :Hq], apply_rope(q, cos[:T], sin[:T], "neox")), T
        assert torch.equal(r[:, Hq:], apply_rope(k, cos[:T], sin[:T], "neox")), T
