"""GPU tests of the Triton aligned ops (kernels/triton): batch invariance, config invariance, accuracy.

Skipped without CUDA. On the GPU machine:

    PYTHONPATH=. python -m pytest tests/gpu/test_triton_kernels.py -q
    PYTHONPATH=. python tests/gpu/test_triton_kernels.py        # same tests, no pytest needed
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if __name__ == "__main__":  # allow running as a script from the repo root
    sys.path.insert(0, os.getcwd())

# (K, N): LLM projection shapes (7168x2048 is segmented by default) and small odd ones
GEMM_SHAPES = [(4096, 4096), (7168, 2048), (2048, 7168), (4096, 14336), (320, 200), (4096, 1000)]
DTYPES = [torch.bfloat16]


from gpu_util import gen as _gen, need_cuda as _need_cuda, randn as _randn  # noqa: E402,F401


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


# ------------------------------------------------------------------------------------------ GEMM


@pytest.mark.parametrize("K,N", GEMM_SHAPES)
def test_gemm_row_invariance_all_m(K, N):
    """Every row of x[:M] @ W.T equals the row computed alone, for every M in 1..256 (+ prefill M)."""
    _need_cuda()
    from kernels.triton import linear

    x = _randn(4096, K, seed=1)
    w = _randn(N, K, seed=2, scale=K ** -0.5)
    for odt in (torch.bfloat16, torch.float32):
        single = torch.cat([linear(x[i : i + 1], w, out_dtype=odt) for i in range(256)])
        for M in list(range(1, 257)):
            y = linear(x[:M], w, out_dtype=odt)
            assert torch.equal(y, single[:M]), f"K={K} N={N} M={M} {odt}"
        for M in (384, 1000, 2048, 4096):  # prefill configs
            y = linear(x[:M], w, out_dtype=odt)
            assert torch.equal(y[:256], single), f"K={K} N={N} M={M} {odt}"
            # a later row alone
            assert torch.equal(y[M - 1 : M], linear(x[M - 1 : M], w, out_dtype=odt))


@pytest.mark.parametrize("K,N", GEMM_SHAPES[:4])
def test_gemm_random_batches(K, N):
    """A row's result does not depend on the other rows or its position (random compositions)."""
    _need_cuda()
    from kernels.triton import linear

    pool = _randn(512, K, seed=3)
    w = _randn(N, K, seed=4, scale=K ** -0.5)
    alone = torch.cat([linear(pool[i : i + 1], w) for i in range(pool.shape[0])])
    g = torch.Generator().manual_seed(5)
    for trial in range(40):
        M = int(torch.randint(1, 2049, (1,), generator=g)) if trial % 4 == 0 else int(
            torch.randint(1, 257, (1,), generator=g))
        idx = torch.randint(0, pool.shape[0], (M,), generator=g).cuda()
        y = linear(pool[idx], w)
        assert torch.equal(y, alone[idx]), f"trial {trial} M={M}"


# the last three: tiny_dsv4's query down / up and key projections (hidden 256, q_lora 128, 16 x 512 heads)
@pytest.mark.parametrize("K,N", [(4096, 4096), (7168, 2048), (320, 200), (4096, 1000), (256, 128), (128, 8192),
                                 (256, 512)])
def test_gemm_all_configs_identical(K, N):
    """Every config of the dispatcher table gives the same bits (bf16 and fp32 out, with bias)."""
    _need_cuda()
    from kernels.triton.gemm import CONFIGS, default_k_segments, matmul

    nseg = default_k_segments(K, N)
    w = _randn(N, K, seed=6, scale=K ** -0.5)
    b = _randn(N, seed=7, dtype=torch.float32)
    for M in (1, 13, 64, 200, 1031):
        x = _randn(M, K, seed=8 + M)
        for odt, bias in ((torch.bfloat16, None), (torch.float32, b)):
            results = {}
            for name, cfg in CONFIGS.items():
                if cfg.split and nseg == 1:
                    continue
                results[name] = matmul(x, w, bias, out_dtype=odt, config=cfg)
            first_name, first = next(iter(results.items()))
            for name, y in results.items():
                assert torch.equal(y, first), f"K={K} N={N} M={M} {odt}: {name} != {first_name}"


@pytest.mark.parametrize("K,N,segs", [(8960, 1536, 8), (1536, 1536, 8), (2048, 1024, 8)])
def test_gemm_all_configs_identical_row_parallel(K, N, segs):
    """Row-parallel segmentations whose segments are not a multiple of the tile (1120 and 192
    columns): every config, including the ones that mask the segment's last tile (``mask_tail``)
    instead of narrowing the tiles, gives the same bits."""
    _need_cuda()
    from kernels.triton.gemm import CONFIGS, matmul

    w = _randn(N, K, seed=16, scale=K ** -0.5)
    b = _randn(N, seed=17, dtype=torch.float32)
    assert any(c.mask_tail for c in CONFIGS.values())
    for M in (1, 32, 200):
        x = _randn(M, K, seed=18 + M)
        for odt, bias in ((torch.bfloat16, None), (torch.float32, b)):
            results = {name: matmul(x, w, bias, out_dtype=odt, config=cfg, k_segments=segs)
                       for name, cfg in CONFIGS.items()}
            first_name, first = next(iter(results.items()))
            for name, y in results.items():
                assert torch.equal(y, first), f"K={K} N={N} M={M} {odt}: {name} != {first_name}"


def test_gemm_segments_in_kernel_vs_split():
    """Explicit k_segments: in-kernel loop == split+reduce == per-shard partials added in order."""
    _need_cuda()
    from kernels.triton.gemm import CONFIGS, matmul

    K, N = 4096, 1536
    w = _randn(N, K, seed=9, scale=K ** -0.5)
    for M in (1, 7, 96, 700):
        x = _randn(M, K, seed=10 + M)
        for segs in (2, 4, 8):
            ys = [matmul(x, w, out_dtype=torch.float32, k_segments=segs, config=cfg)
                  for cfg in CONFIGS.values()]
            for y in ys[1:]:
                assert torch.equal(y, ys[0]), f"M={M} segs={segs}"
            # row-parallel TP: rank r holds K shard r; partials all-gathered and added in rank order
            s = K // segs
            parts = [matmul(x[:, r * s : (r + 1) * s].contiguous(), w[:, r * s : (r + 1) * s].contiguous(),
                            out_dtype=torch.float32, k_segments=1) for r in range(segs)]
            acc = torch.zeros_like(parts[0])
            for p in parts:
                acc = acc + p
            assert torch.equal(acc, ys[0]), f"TP composition M={M} segs={segs}"


@pytest.mark.parametrize("K,segs", [(128, 16), (96, 8), (200, 8), (48, 2)])
def test_gemm_segments_shorter_than_a_tile(K, segs):
    """Row-parallel segments of 8..25 columns (a tiny model's o_proj in 16 segments): 16-wide tiles
    masked at each segment's end. Every config and M gives the same bits, the result is the
    per-segment partials added in order (what a TP rank group computes), and it is accurate."""
    _need_cuda()
    from kernels.triton.gemm import CONFIGS, matmul

    N = 72
    w = _randn(N, K, seed=K + segs, scale=K ** -0.5)
    x_all = _randn(300, K, seed=K + segs + 1)
    full = matmul(x_all, w, out_dtype=torch.float32, k_segments=segs)
    for M in (1, 5, 64, 300):
        x = x_all[:M].contiguous()
        ys = [matmul(x, w, out_dtype=torch.float32, k_segments=segs, config=cfg) for cfg in CONFIGS.values()]
        for y in ys:
            assert torch.equal(y, full[:M]), f"M={M}"  # any config, any batch: the same rows
        s = K // segs
        parts = [matmul(x[:, r * s:(r + 1) * s].contiguous(), w[:, r * s:(r + 1) * s].contiguous(),
                        out_dtype=torch.float32, k_segments=1) for r in range(segs)]
        acc = torch.zeros_like(parts[0])
        for p in parts:
            acc = acc + p
        assert torch.equal(acc, ys[0]), f"TP composition M={M}"
        exact = x.double() @ w.double().T
        assert _rel_err(ys[0], exact) < 1e-5


@pytest.mark.parametrize("K,N", GEMM_SHAPES)
def test_gemm_accuracy(K, N):
    """fp32 out vs float64: rel err ~ fp32 accumulation; bf16 out within bf16 rounding."""
    _need_cuda()
    from kernels.triton import linear

    w = _randn(N, K, seed=11, scale=K ** -0.5)
    b = _randn(N, seed=12)
    for M in (1, 77, 1500):
        x = _randn(M, K, seed=13 + M)
        ref = x.double() @ w.double().T + b.double()
        y32 = linear(x, w, b, out_dtype=torch.float32)
        e32 = _rel_err(y32, ref)
        y16 = linear(x, w, b)
        e16 = _rel_err(y16, ref)
        print(f"K={K} N={N} M={M}: rel err fp32 out {e32:.2e}, bf16 out {e16:.2e}")
        assert e32 < 1e-5
        assert y16.dtype == torch.bfloat16 and e16 < 5e-3
        # fp32 inputs: IEEE fp32 dot (not tf32)
    xf = _randn(33, K, seed=14, dtype=torch.float32)
    wf = w.float()
    ef = _rel_err(linear(xf, wf), xf.double() @ wf.double().T)
    print(f"K={K} N={N} fp32 inputs: rel err {ef:.2e}")
    assert ef < 1e-5


def test_gemm_strided_and_3d_inputs():
    _need_cuda()
    from kernels.triton import linear

    K, N = 1024, 512
    w = _randn(N, K, seed=15, scale=K ** -0.5)
    x = _randn(4, 9, K, seed=16)
    y = linear(x, w)
    assert y.shape == (4, 9, N)
    assert torch.equal(y.reshape(-1, N)[5], linear(x.reshape(-1, K)[5:6], w)[0])
    big = _randn(9, 2 * K, seed=17)
    xs = big[:, :K]  # row stride 2K
    assert torch.equal(linear(xs, w), linear(xs.contiguous(), w))


def test_gemm_backward_runs():
    _need_cuda()
    from kernels.triton import linear

    x = _randn(8, 256, seed=18, dtype=torch.float32).requires_grad_()
    w = _randn(64, 256, seed=19, dtype=torch.float32).requires_grad_()
    linear(x, w).square().sum().backward()
    assert x.grad is not None and w.grad is not None and torch.isfinite(w.grad).all()


# --------------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("D", [64, 128, 1000, 4096, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_invariance_and_accuracy(D, dtype):
    _need_cuda()
    from kernels.norm import rms_norm as cpu_rms_norm
    from kernels.triton import rms_norm

    pool = _randn(600, D, seed=20, dtype=dtype) * 3
    w = _randn(D, seed=21, dtype=dtype)
    alone = torch.cat([rms_norm(pool[i : i + 1], w, 1e-6) for i in range(64)])
    for M in list(range(1, 65)) + [300, 600]:
        y = rms_norm(pool[:M], w, 1e-6)
        assert torch.equal(y[: min(M, 64)], alone[: min(M, 64)]), f"D={D} M={M}"
    g = torch.Generator().manual_seed(22)
    for _ in range(10):
        idx = torch.randint(0, 64, (int(torch.randint(1, 500, (1,), generator=g)),), generator=g).cuda()
        assert torch.equal(rms_norm(pool[idx], w, 1e-6), alone[idx])
    ref = cpu_rms_norm(pool.cpu(), w.cpu(), 1e-6)
    y = rms_norm(pool, w, 1e-6).cpu()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # bf16 outputs: at most one rounding step apart, rarely
        assert (y != ref).float().mean().item() < 0.01
    yn = rms_norm(pool, None, 1e-6)
    assert torch.allclose(yn.float().cpu(), cpu_rms_norm(pool.cpu(), None, 1e-6).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_residual_add_and_norm_is_bitwise_the_two_ops(dtype):
    """kernels.add_rms_norm on the GPU: h is torch's ``x + delta`` (fp32 sum rounded to nearest
    even once) and the norm is kernels.rms_norm of that h, bit for bit, for any row count."""
    _need_cuda()
    import kernels

    for R, D in ((1, 2048), (7, 2048), (300, 1536), (64, 7168), (5, 100)):
        x = _randn(R, D, seed=R + D, dtype=dtype) * 4
        d = _randn(R, D, seed=R + D + 1, dtype=dtype)
        w = (_randn(D, seed=D, dtype=torch.float32).abs() + 0.5).to(dtype)
        h, y = kernels.add_rms_norm(x, d, w, 1e-6)
        want = x + d
        assert torch.equal(h, want), (R, D)
        assert torch.equal(y, kernels.rms_norm(want, w, 1e-6)), (R, D)
        h1, y1 = kernels.add_rms_norm(x[:1], d[:1], w, 1e-6)  # a row alone: the same bits
        assert torch.equal(h1, h[:1]) and torch.equal(y1, y[:1]), (R, D)


@pytest.mark.parametrize("K", [1536, 8960])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_gemm_partials_into_add_rms_norm_are_bitwise_the_reduce_and_add_rms_norm(K, with_bias):
    """A row-parallel GEMM's split-mode partials summed inside the residual add + RMSNorm (one
    launch; the engine's o_proj / down_proj into the next norm) == ``matmul`` (its own reduce
    kernel) then ``add_rms_norm``, bit for bit in bf16: Qwen2-1.5B shapes (K = 1536 / 8960 -> N =
    1536, 8 segments), decode and mid M, every split config, with and without a bias; and the same
    through ``kernels.linear_unreduced`` / ``finish_unreduced`` / ``add_rms_norm``."""
    _need_cuda()
    import kernels
    from kernels.triton.gemm import CONFIGS, matmul, matmul_partials, reduce_partials
    from kernels.triton.rmsnorm import add_partials_rms_norm

    N, segs = 1536, 8
    w = _randn(N, K, seed=40, scale=K ** -0.5)
    b = _randn(N, seed=41) if with_bias else None
    nw = (_randn(N, seed=42, dtype=torch.float32).abs() + 0.5).to(torch.bfloat16)
    split = {name: cfg for name, cfg in CONFIGS.items() if cfg.split}
    for M in (1, 7, 32, 64, 200):
        x = _randn(M, K, seed=43 + M)
        h0 = _randn(M, N, seed=44 + M, scale=4.0)
        want = matmul(x, w, b, k_segments=segs)  # the config the dispatcher picks, reduce kernel included
        hw, yw = kernels.add_rms_norm(h0, want, nw, 1e-6)
        assert torch.equal(hw, h0 + want), M
        for name, cfg in split.items():
            ws, is_parts = matmul_partials(x, w, b, k_segments=segs, config=cfg)
            assert is_parts and ws.shape == (segs, M, N), name
            assert torch.equal(reduce_partials(ws, b, out_dtype=torch.bfloat16), want), (M, name)
            h, y = add_partials_rms_norm(h0, ws, b, nw, 1e-6)
            assert torch.equal(h, hw) and torch.equal(y, yw), f"M={M} {name}"
        d = kernels.linear_unreduced(x, w, b, k_segments=segs)  # what the engine's fast path calls
        assert torch.equal(kernels.finish_unreduced(d), want), M
        h, y = kernels.add_rms_norm(h0, d, nw, 1e-6)
        assert torch.equal(h, hw) and torch.equal(y, yw), M
        h1, y1 = add_partials_rms_norm(h0[:1], matmul_partials(x[:1], w, b, k_segments=segs,
                                                               config=split["d16_n64_split"])[0], b, nw, 1e-6)
        assert torch.equal(h1, hw[:1]) and torch.equal(y1, yw[:1]), M  # a row alone: the same bits


def test_fast_layer_loop_is_bitwise_the_layer_chain_at_qwen2_shapes():
    """The engine's fast layer loop (``layer_forward_fast``: residual add carried into the next
    layer's norm, o_proj / down_proj partials summed in the add + norm launches) == a chain of the
    learner's ``layer_forward`` calls, bitwise in bf16: two Qwen2-1.5B-wide layers, decode and mid
    M, the final norm and the plain residual (a pipeline stage's output) both checked."""
    _need_cuda()
    import kernels
    from kernels.models import qwen3_dsv3 as ref

    H, Hq, Hkv, D, inter = 1536, 12, 2, 128, 8960
    c = ref.arch_config({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": H,
                         "num_hidden_layers": 2, "num_attention_heads": Hq, "num_key_value_heads": Hkv,
                         "vocab_size": 64, "intermediate_size": inter})
    layers, seed = [], 50
    for _ in range(c.num_layers):
        d = {}
        for name, shape in (("self_attn.q_proj", (Hq * D, H)), ("self_attn.k_proj", (Hkv * D, H)),
                            ("self_attn.v_proj", (Hkv * D, H)), ("self_attn.o_proj", (H, Hq * D)),
                            ("mlp.gate_proj", (inter, H)), ("mlp.up_proj", (inter, H)), ("mlp.down_proj", (H, inter))):
            d[name + ".weight"] = _randn(*shape, seed=seed, scale=shape[1] ** -0.5)
            seed += 1
            if name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                d[name + ".bias"] = _randn(shape[0], seed=seed, scale=0.5)
                seed += 1
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            d[name] = (_randn(H, seed=seed, dtype=torch.float32).abs() + 0.5).to(torch.bfloat16)
            seed += 1
        d["rz_gate_up"] = torch.cat([d["mlp.gate_proj.weight"], d["mlp.up_proj.weight"]])
        layers.append(d)
    norm_w = (_randn(H, seed=seed, dtype=torch.float32).abs() + 0.5).to(torch.bfloat16)

    def fast_mlp(d, x):  # the model class's _fast_dense_unreduced
        gu = kernels.linear(x, d["rz_gate_up"])
        return kernels.linear_unreduced(kernels.swiglu(gu[..., :inter], gu[..., inter:]), d["mlp.down_proj.weight"],
                                        k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)

    for M in (1, 7, 32, 200):
        positions = torch.arange(M, device="cuda") + 3
        cos, sin = kernels.rope_cos_sin(positions, c.rope_dim, c.rope_theta)
        attend = lambda q, k, v: q * 0.5 + v.repeat_interleave(Hq // Hkv, 1)  # noqa: E731  any fixed function
        h0 = _randn(M, H, seed=100 + M, scale=2.0)
        h = h0
        for i, d in enumerate(layers):
            h = ref.layer_forward(c, d.__getitem__, i, h, cos, sin, attend)
        hf, y = h0, None
        for i, d in enumerate(layers):
            hf, y = ref.layer_forward_fast(c, d.__getitem__, i, hf, y, cos, sin, attend,
                                           mlp=lambda x, d=d: fast_mlp(d, x))
        assert isinstance(y, kernels.Unreduced), M  # down_proj ran split mode (the current tile tables)
        assert torch.equal(ref.carried_residual(hf, y), h), M
        assert torch.equal(ref.final_norm_carried(c, norm_w, hf, y), ref.final_norm(c, norm_w, h)), M


def test_rope_of_q_and_k_in_one_launch_is_bitwise_two_launches():
    """The fast path's Qwen2 RoPE: q and k, adjacent column blocks of the packed q/k/v GEMM output,
    rotated as one strided [T, Hq + Hkv, D] view == the two calls on their own views, bf16, at
    Qwen2-1.5B head shapes (12 / 2 heads of 128) and a GQA 4 one, decode and mid T."""
    _need_cuda()
    import kernels

    for Hq, Hkv, D in ((12, 2, 128), (16, 4, 64)):
        for T in (1, 7, 32, 200):
            y = _randn(T, (Hq + 2 * Hkv) * D, seed=60 + T + Hq, scale=3.0)
            cos, sin = kernels.rope_cos_sin(torch.arange(T, device="cuda") * 37 + 5, D, 10000.0)
            one = kernels.apply_rope(y[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), cos, sin, "neox")
            q = kernels.apply_rope(y[:, :Hq * D].view(T, Hq, D), cos, sin, "neox")
            k = kernels.apply_rope(y[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), cos, sin, "neox")
            assert torch.equal(one[:, :Hq], q) and torch.equal(one[:, Hq:], k), (Hq, Hkv, D, T)
            qc = kernels.apply_rope(y[:, :Hq * D].reshape(T, Hq, D).contiguous(), cos, sin, "neox")
            assert torch.equal(qc, q), (Hq, Hkv, D, T)  # strided read == a contiguous copy's


# -------------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("V", [1000, 32000, 151936])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprobs_invariance_and_accuracy(V, dtype):
    _need_cuda()
    from kernels.triton import logprobs_from_logits

    R = 300
    logits = _randn(R, V, seed=23, dtype=dtype) * 4
    targets = torch.randint(0, V, (R,), device="cuda", generator=_gen(24))
    for T in (1.0, 0.7):
        alone = torch.cat([logprobs_from_logits(logits[i : i + 1], targets[i : i + 1], T) for i in range(64)])
        for M in list(range(1, 65)) + [R]:
            lp = logprobs_from_logits(logits[:M], targets[:M], T)
            assert torch.equal(lp[:64], alone[: min(M, 64)]), f"V={V} M={M} T={T}"
        g = torch.Generator().manual_seed(25)
        for _ in range(8):
            idx = torch.randint(0, 64, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g).cuda()
            assert torch.equal(logprobs_from_logits(logits[idx], targets[idx], T), alone[idx])
        ref = (logits.double() / T).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        lp = logprobs_from_logits(logits, targets, T)
        assert (lp.double() - ref).abs().max().item() < 2e-5
        tref = (logits.float() / T).log_softmax(-1, dtype=torch.float32).gather(-1, targets[:, None]).squeeze(-1)
        assert (lp - tref).abs().max().item() < 2e-5


def test_log_softmax_of_top_k_masked_rows_is_finite_on_a_large_vocabulary():
    """Top-k masked logits over 151,936 columns (10 pieces, most of them all -inf): the kept
    columns' log-probabilities are finite, torch's to fp32 rounding, and equal
    logprobs_from_logits of the same targets; a row alone == the same row in a batch."""
    _need_cuda()
    from kernels.triton import log_softmax, logprobs_from_logits

    R, V, k = 64, 151936, 50
    logits = _randn(R, V, seed=31, dtype=torch.float32) * 4
    kth = logits.topk(k, dim=-1).values[:, -1:]
    masked = logits.masked_fill(logits < kth, float("-inf"))
    lsm = log_softmax(masked)
    ref = masked.double().log_softmax(-1)
    keep = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lsm), keep) and int(keep.sum()) == R * k
    assert (lsm[keep].double() - ref[keep]).abs().max().item() < 2e-5
    tg = masked.argmax(-1)
    assert torch.equal(logprobs_from_logits(masked, tg), lsm[torch.arange(R, device="cuda"), tg])
    assert torch.equal(log_softmax(masked[5:6]), lsm[5:6])


def test_token_logprobs_end_to_end_invariance():
    _need_cuda()
    from kernels.triton import token_logprobs

    H, V = 2048, 32000
    hidden = _randn(200, H, seed=26)
    w = _randn(V, H, seed=27, scale=H ** -0.5)
    tg = torch.randint(0, V, (200,), device="cuda", generator=_gen(28))
    full = token_logprobs(hidden, w, tg)
    for i in (0, 57, 199):
        assert torch.equal(token_logprobs(hidden[i : i + 1], w, tg[i : i + 1]), full[i : i + 1])
    ref = (hidden.double() @ w.double().T).log_softmax(-1).gather(-1, tg[:, None]).squeeze(-1)
    assert (full.double() - ref).abs().max().item() < 0.1  # bf16 logits


# ------------------------------------------------------------------------------------- attention


def _attention_available():
    try:
        from kernels.triton import attention  # noqa: F401
    except Exception:
        return False
    return True


def test_attention_prefill_equals_decode():
    _need_cuda()
    if not _attention_available():
        pytest.skip("kernels.triton.attention not built")
    from kernels.triton import attention

    S, Hq, Hkv, D = 300, 8, 2, 128
    q = _randn(S, Hq, D, seed=30)
    k = _randn(S + 37, Hkv, D, seed=31)  # extra finite slots beyond the sequence
    v = _randn(S + 37, Hkv, D, seed=32)
    pos = torch.arange(S, device="cuda")
    scale = D ** -0.5
    full = attention(q, k, v, pos, scale)
    # decode: query p sees a KV of exactly p+1 keys
    for p in range(S):
        dec = attention(q[p : p + 1], k[: p + 1], v[: p + 1], pos[p : p + 1], scale)
        assert torch.equal(dec, full[p : p + 1]), f"decode p={p}"
    # zero-padded slots past the sequence (a paged / preallocated cache)
    kz = torch.cat([k[:S], torch.zeros_like(k[:37])])
    vz = torch.cat([v[:S], torch.zeros_like(v[:37])])
    assert torch.equal(attention(q, kz, vz, pos, scale), full)
    # chunked prefill
    for a, b in ((0, 17), (17, 130), (130, 300), (0, 1), (1, 65), (65, 66)):
        ch = attention(q[a:b], k[:b], v[:b], pos[a:b], scale)
        assert torch.equal(ch, full[a:b]), f"chunk {a}:{b}"
    # shuffled queries
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(33)).cuda()
    assert torch.equal(attention(q[perm], k, v, pos[perm], scale), full[perm])
    # accuracy vs float64 causal softmax
    kk = k[:S].double().repeat_interleave(Hq // Hkv, 1)
    vv = v[:S].double().repeat_interleave(Hq // Hkv, 1)
    sc = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    sc = sc.masked_fill(torch.ones(S, S, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref = torch.einsum("hts,shd->thd", sc.softmax(-1), vv)
    assert _rel_err(full, ref) < 1e-2


# ------------------------------------------------------------------------------ script runner


def _main() -> int:
    import inspect

    if not torch.cuda.is_available():
        print("no CUDA: nothing to run")
        return 0
    mod = sys.modules[__name__]
    passed = failed = skipped = 0
    for name, fn in list(vars(mod).items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        marks = getattr(fn, "pytestmark", [])
        cases = [{}]
        for m in marks:
            if m.name == "parametrize":
                argnames = [a.strip() for a in m.args[0].split(",")] if isinstance(m.args[0], str) else m.args[0]
                new = []
                for c in cases:
                    for vals in m.args[1]:
                        vals = vals if len(argnames) > 1 else (vals,)
                        new.append({**c, **dict(zip(argnames, vals))})
                cases = new
        for case in cases:
            label = f"{name}[{','.join(str(v) for v in case.values())}]"
            try:
                fn(**{k: v for k, v in case.items() if k in inspect.signature(fn).parameters})
                passed += 1
                print("PASS", label, flush=True)
            except pytest.skip.Exception as e:
                skipped += 1
                print("SKIP", label, e, flush=True)
            except Exception as e:  # noqa: BLE001
                failed += 1
                print("FAIL", label, repr(e)[:500], flush=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
