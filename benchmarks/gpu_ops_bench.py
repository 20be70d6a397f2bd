"""Benchmark groups rope / router / attention / moe / fp8 / decode for benchmarks/gpu_kernels.py.

Each row measures the aligned op and its fast baseline side by side in one process with the same
graph-replay method (graph_timing.bench_graph); ratio = baseline time / aligned time.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F


def _bg():
    from benchmarks.graph_timing import bench_graph, copies

    return bench_graph, copies


def _row(rows, label, t_base, t_al, **kw):
    r = dict(kw, baseline_us=t_base * 1e3, aligned_us=t_al * 1e3, ratio=t_base / t_al)
    rows.append(r)
    print(f"{label:<58} base {t_base * 1e3:9.1f} us  aligned {t_al * 1e3:9.1f} us  ratio {t_base / t_al:5.2f}",
          flush=True)


# ------------------------------------------------------------------------------------------ RoPE


def bench_rope(args):
    from benchmarks.moe_model import rope_fast
    from kernels.triton.rope import apply_rope

    bench_graph, copies = _bg()
    rows = []
    Hq, D = 32, 128
    tab = torch.randn(8192, D // 2, device="cuda")
    for T in (1, 64, 1024, 8192):
        n = copies(T * Hq * D * 2 * 2)
        xs = [torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        pos = torch.randint(0, 8192, (T,), device="cuda")
        cos, sin = tab[pos].contiguous(), tab.flip(0)[pos].contiguous()
        tb = bench_graph(lambda i: (lambda: rope_fast(xs[i], cos, sin)), n)
        ta = bench_graph(lambda i: (lambda: apply_rope(xs[i], cos, sin, "neox")), n)
        _row(rows, f"rope neox T={T} H={Hq} D={D}", tb, ta, T=T, H=Hq, D=D, baseline="torch elementwise")
    return rows


# ---------------------------------------------------------------------------------------- router


def bench_router(args):
    from kernels.triton.router import route

    bench_graph, _ = _bg()
    rows = []
    for E, k, kind in ((128, 8, "softmax"), (256, 8, "sigmoid_grouped")):
        bias = torch.randn(E, device="cuda") * 0.01
        for T in (1, 64, 1024, 8192):
            lg = torch.randn(T, E, device="cuda")
            if kind == "softmax":
                def base():
                    w, i = lg.softmax(-1).topk(k, -1)
                    return i, w / w.sum(-1, keepdim=True)

                def al():
                    return route(lg, k, norm_topk_prob=True)
            else:
                def base():
                    s = lg.sigmoid()
                    ch = (s + bias).view(T, 8, E // 8)
                    gs = ch.topk(2, -1)[0].sum(-1)
                    gi = gs.topk(4, -1)[1]
                    mask = torch.zeros(T, 8, device="cuda", dtype=torch.bool).scatter_(1, gi, True)
                    c2 = ch.masked_fill(~mask[..., None], float("-inf")).view(T, E)
                    i = c2.topk(k, -1)[1]
                    w = s.gather(1, i)
                    return i, w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5

                def al():
                    return route(lg, k, score="sigmoid", expert_bias=bias, num_groups=8, group_topk=4,
                                 norm_topk_prob=True, scaling_factor=2.5)
            tb = bench_graph(lambda i: base, 1)
            ta = bench_graph(lambda i: al, 1)
            _row(rows, f"router {kind} E={E} k={k} T={T}", tb, ta, E=E, k=k, T=T, kind=kind,
                 baseline="torch softmax/sigmoid + topk")
    return rows


# ------------------------------------------------------------------------------------- attention


def bench_attention(args):
    from kernels.triton.attn import attention, attention_batched

    bench_graph, _ = _bg()
    rows = []
    Hq, Hkv, D = 32, 8, 128
    sc = D ** -0.5
    for S in (1024, 4096):  # prefill, one sequence: single-sequence kernel and the GQA-packed kernel
        q = torch.randn(S, Hq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(S, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(S, Hkv, D, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(S, device="cuda")
        cu = torch.tensor([0, S], device="cuda", dtype=torch.int32)
        qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        tb = bench_graph(lambda i: (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                           enable_gqa=True)), 1, iters=10)
        t1 = bench_graph(lambda i: (lambda: attention(q, k, v, pos, sc)), 1, iters=10)
        t2 = bench_graph(lambda i: (lambda: attention_batched(q, k[None], v[None], cu, pos, sc, max_q_len=S)), 1,
                         iters=10)
        _row(rows, f"attn prefill S={S} single-seq kernel", tb, t1, mode="prefill", kernel="attention", S=S, B=1,
             Hq=Hq, Hkv=Hkv, D=D, baseline="SDPA causal")
        _row(rows, f"attn prefill S={S} GQA-packed kernel", tb, t2, mode="prefill", kernel="attention_batched",
             S=S, B=1, Hq=Hq, Hkv=Hkv, D=D, baseline="SDPA causal")
    for B, L in ((1, 4096), (32, 1024), (64, 2048), (128, 1024), (32, 8192)):  # batched decode
        kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
        kt, vt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        pos = torch.full((B,), L - 1, device="cuda")
        cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
        tb = bench_graph(lambda i: (lambda: F.scaled_dot_product_attention(q[:, :, None], kt, vt, enable_gqa=True)),
                         1, iters=10)
        ta = bench_graph(lambda i: (lambda: attention_batched(q, kc, vc, cu, pos, sc, max_q_len=1)), 1, iters=10)
        _row(rows, f"attn decode B={B} L={L} GQA-packed kernel", tb, ta, mode="decode", kernel="attention_batched",
             B=B, S=L, Hq=Hq, Hkv=Hkv, D=D, baseline="SDPA (q_len 1)")
        del kc, vc, kt, vt
    return rows


# ------------------------------------------------------------------------------------------- MoE


def bench_moe(args):
    from benchmarks.moe_model import experts_fast
    from kernels import settings
    from kernels.triton.moe import moe_experts_merged

    bench_graph, _ = _bg()
    rows = []
    narrow0, direct0 = settings.moe_narrow_tiles(), settings.moe_direct_rows()
    for name, H, I, E, k in (("1B-config layer", 1024, 512, 32, 4), ("moe1b layer", 1024, 768, 32, 4),
                             ("Qwen3-30B-A3B layer", 2048, 768, 128, 8)):
        n = 2
        wgu = [torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5 for _ in range(n)]
        wd = [torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5 for _ in range(n)]
        for T in (1, 4, 16, 32, 64, 256, 1024, 4096):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            w, ids = torch.randn(T, E, device="cuda").softmax(-1).topk(k, -1)
            w = w / w.sum(-1, keepdim=True)
            tb = bench_graph(lambda i: (lambda: experts_fast(x, wgu[i], wd[i], ids, w)), n, iters=8)
            settings.set_moe_narrow_tiles(False)  # the default plans
            settings.set_moe_direct_rows(False)
            ta = bench_graph(lambda i: (lambda: moe_experts_merged(x, wgu[i], wd[i], ids, w)), n, iters=8)
            y0 = moe_experts_merged(x, wgu[0], wd[0], ids, w)
            # the small-batch plans (settings.set_moe_narrow_tiles, set_moe_direct_rows): their time
            # and whether their output is the default plan's, bit for bit
            settings.set_moe_narrow_tiles(True)
            settings.set_moe_direct_rows(True)  # (taken only while 2 * T * k <= E)
            tn = bench_graph(lambda i: (lambda: moe_experts_merged(x, wgu[i], wd[i], ids, w)), n, iters=8)
            same = bool(torch.equal(moe_experts_merged(x, wgu[0], wd[0], ids, w), y0))
            settings.set_moe_narrow_tiles(narrow0)
            settings.set_moe_direct_rows(direct0)
            _row(rows, f"moe {name} H={H} I={I} E={E} k={k} T={T}", tb, ta, H=H, I=I, E=E, k=k, T=T,
                 baseline="torch._grouped_mm + silu + combine", small_plans_us=tn * 1e3, small_plans_bitwise=same)
            print(f"{'':<58} small-batch plans {tn * 1e3:9.1f} us  (default / these {ta / tn:5.2f}, "
                  f"bitwise {same})", flush=True)
        del wgu, wd
    return rows


# ------------------------------------------------------------------------------------------- FP8


def _scaled_mm_variants(xq, xs, wq, ws):
    """Callables computing xq @ wq.T with blockwise scales through torch, first the blockwise ones.
    cuBLAS wants M a multiple of 4 for 1x128 scales: rows are zero-padded beforehand (not timed)."""
    M = xq.shape[0]
    if M % 4:
        p = 4 - M % 4
        xq = torch.cat([xq, torch.zeros(p, xq.shape[1], device=xq.device, dtype=xq.dtype)])
        xs = torch.cat([xs, torch.ones(p, xs.shape[1], device=xs.device, dtype=xs.dtype)])
    out = []
    xs_cm = xs.t().contiguous().t()  # 1x128 scales must be outer-dim-major (column major)
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        ST = F.ScalingType
        out.append(("F.scaled_mm blockwise 1x128/128x128", lambda: F.scaled_mm(
            xq, wq.t(), xs_cm, ST.BlockWise1x128, ws.t(), ST.BlockWise128x128, output_dtype=torch.bfloat16)))
    out.append(("torch._scaled_mm blockwise (scale shapes)", lambda: torch._scaled_mm(
        xq, wq.t(), xs_cm, ws.t(), out_dtype=torch.bfloat16)))
    one = torch.ones((), device=xq.device)
    out.append(("torch._scaled_mm per-tensor", lambda: torch._scaled_mm(xq, wq.t(), one, one, out_dtype=torch.bfloat16)))
    return out


def bench_fp8(args):
    from kernels import fp8 as F8
    from kernels.triton.fp8 import FP8_CONFIGS, fp8_gemm, pick_fp8_config, quantize_act_groupwise

    bench_graph, copies = _bg()
    rows = []
    mode_seen = {}
    for K, N in ((7168, 2048), (2048, 7168), (4096, 4096), (7168, 18432)):
        for M in (1, 16, 64, 128, 256, 1024, 4096, 8192):
            n = copies(N * K + M * K)
            ws_list, wq_list = [], []
            for _ in range(n):
                w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
                wq, ws = F8.quantize_weight_blockwise(w)
                wq_list.append(wq)
                ws_list.append(ws)
                del w
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_act_groupwise(x)
            ours = fp8_gemm(xq, xs, wq_list[0], ws_list[0])
            ours = torch.cat([ours, ours.new_zeros((-M) % 4, N)])
            base_name, base_fn = None, None
            for nm, fn in _scaled_mm_variants(xq, xs, wq_list[0], ws_list[0]):
                try:
                    y = fn()
                    torch.cuda.synchronize()
                    rel = ((y[:ours.shape[0]].float() - ours.float()).norm() / ours.float().norm()).item()
                    if "per-tensor" not in nm and rel > 2e-2:
                        mode_seen[nm] = f"wrong result (rel {rel:.2e})"
                        continue
                    base_name = nm
                    break
                except Exception as e:  # noqa: BLE001
                    mode_seen[nm] = f"{type(e).__name__}: {str(e)[:160]}"
            mode_seen[f"used K={K} N={N} M={M}"] = base_name
            vs = [_scaled_mm_variants(xq, xs, wq_list[i], ws_list[i]) for i in range(n)]
            names = [v[0] for v in vs[0]]
            j = names.index(base_name)
            tb = bench_graph(lambda i: vs[i][j][1], n)
            ta = bench_graph(lambda i: (lambda: fp8_gemm(xq, xs, wq_list[i], ws_list[i])), n)
            xb = x
            wb = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(min(n, 3))]
            tbf = bench_graph(lambda i: (lambda: xb @ wb[i % len(wb)].T), min(n, 3))
            tq = bench_graph(lambda i: (lambda: quantize_act_groupwise(x)), 1)
            tf = 2 * M * N * K / (ta * 1e-3) / 1e12
            sweep = {}
            if getattr(args, "fp8_sweep", False) and M >= 128:
                for cn, cfg in FP8_CONFIGS.items():
                    if cfg.block_m > 64 or M <= 256:
                        try:
                            sweep[cn] = bench_graph(lambda i: (lambda: fp8_gemm(xq, xs, wq_list[i], ws_list[i],
                                                                                config=cfg)), n) * 1e3
                        except Exception as e:  # noqa: BLE001
                            sweep[cn] = None
                            print(f"   {cn}: {type(e).__name__} {str(e)[:100]}")
                ok = {k_: v_ for k_, v_ in sweep.items() if v_}
                print("   sweep:", " ".join(f"{k_}={v_:.1f}" for k_, v_ in sorted(ok.items(), key=lambda kv: kv[1])))
            _row(rows, f"fp8 K={K} N={N} M={M} [{pick_fp8_config(M, N, K).name}] {tf:6.0f} TF/s", tb, ta, K=K, N=N,
                 M=M, baseline=base_name, aligned_tflops=tf, cublas_bf16_us=tbf * 1e3, act_quant_us=tq * 1e3,
                 config=pick_fp8_config(M, N, K).name, ratio_vs_cublas_bf16=tbf / ta, sweep_us=sweep)
            del wq_list, ws_list, wb
    print("scaled_mm modes:", mode_seen)
    return {"rows": rows, "scaled_mm_modes": mode_seen}


# ---------------------------------------------------------------------------------------- decode


def bench_decode(args):
    from benchmarks.moe_model import ONE_B, KVCache, aligned_decode, fast_decode, init_weights, param_count, rope_tables

    bench_graph, _ = _bg()
    c = ONE_B
    W = init_weights(c, 0)
    tables = rope_tables(c)
    res = {"config": c.__dict__ | {"params": param_count(c)}, "rows": []}
    print(f"~1B MoE config: {param_count(c) / 1e9:.3f} B parameters", flush=True)
    for B, L in ((1, 1024), (8, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 512)):
        ca = KVCache(c, B, "aligned")
        cf = KVCache(c, B, "fast")
        g = torch.Generator(device="cuda")
        g.manual_seed(B)
        for li in range(c.layers):
            kk = torch.randn(B, L, c.kv_heads, c.head_dim, device="cuda", generator=g).to(torch.bfloat16)
            vv = torch.randn(B, L, c.kv_heads, c.head_dim, device="cuda", generator=g).to(torch.bfloat16)
            ca.k[li][:, :L] = kk
            ca.v[li][:, :L] = vv
            cf.k[li][:, :, :L] = kk.transpose(1, 2)
            cf.v[li][:, :, :L] = vv.transpose(1, 2)
        tok = torch.randint(0, c.vocab, (B,), device="cuda", generator=g)
        tgt = torch.randint(0, c.vocab, (B,), device="cuda", generator=g)
        with torch.no_grad():
            lp_a = aligned_decode(c, W, ca, tables, tok, L, tgt)
            lp_f = fast_decode(c, W, cf, tables, tok, L, tgt)
            diff = (lp_a - lp_f).abs().max().item()
            from kernels import set_gemm_small_tiles

            set_gemm_small_tiles(False)  # the GEMM tile choice before the small-tile rule (same bits)
            t_a_big = statistics.median([bench_graph(lambda i: (lambda: aligned_decode(c, W, ca, tables, tok, L, tgt)),
                                                     1, iters=4, reps=10) for _ in range(2)])
            set_gemm_small_tiles(True)
            lp_a2 = aligned_decode(c, W, ca, tables, tok, L, tgt)
            assert torch.equal(lp_a2, lp_a), "tile choice changed the bits"
            times_a, times_f, times_ff = [], [], []
            for _ in range(3):  # alternate: aligned, fast, fast+fused misc, aligned, ...
                times_a.append(bench_graph(lambda i: (lambda: aligned_decode(c, W, ca, tables, tok, L, tgt)), 1,
                                           iters=4, reps=10))
                times_f.append(bench_graph(lambda i: (lambda: fast_decode(c, W, cf, tables, tok, L, tgt)), 1,
                                           iters=4, reps=10))
                times_ff.append(bench_graph(lambda i: (lambda: fast_decode(c, W, cf, tables, tok, L, tgt, True)), 1,
                                            iters=4, reps=10))
        ta, tf, tff = statistics.median(times_a), statistics.median(times_f), statistics.median(times_ff)
        r = dict(B=B, context=L, aligned_ms=ta, fast_ms=tf, aligned_over_fast=ta / tf,
                 fast_fused_misc_ms=tff, aligned_over_fast_fused_misc=ta / tff,
                 aligned_without_small_tile_rule_ms=t_a_big,
                 max_abs_logprob_diff_aligned_vs_fast=diff, tokens_per_s_aligned=B / ta * 1e3,
                 tokens_per_s_fast=B / tf * 1e3)
        res["rows"].append(r)
        print(f"decode B={B:4d} ctx={L}: aligned {ta * 1e3:8.1f} us  fast {tf * 1e3:8.1f} us  aligned/fast "
              f"{ta / tf:5.3f}  fast+fused rope/router {tff * 1e3:8.1f} us  aligned/that {ta / tff:5.3f}  "
              f"max|dlogp| aligned vs fast {diff:.3f}  (aligned w/o small-tile rule {t_a_big * 1e3:.1f} us)", flush=True)
        del ca, cf
        torch.cuda.empty_cache()
    return res


def bench_gemm1b(args):
    """The ~1B decode model's projections at decode/mid M: cuBLAS, the dispatcher's pick, every config."""
    from kernels.triton.gemm import CONFIGS, matmul, pick_config

    bench_graph, copies = _bg()
    rows = []
    for name, K, N, seg in (("qkv", 1024, 3072, 1), ("o_proj", 2048, 1024, 2), ("shared_gate_up", 1024, 2048, 1),
                            ("shared_down", 1024, 1024, 2), ("router", 1024, 32, 1), ("lm_head", 1024, 32768, 1)):
        for M in (8, 32, 64, 128, 256, 512):
            n = copies(N * K * 2 + M * K * 2)
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(n)]
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            tb = bench_graph(lambda i: (lambda: xs[i] @ ws[i].T), n)
            pick = pick_config(M, K, N, seg)
            ta = bench_graph(lambda i: (lambda: matmul(xs[i], ws[i], k_segments=seg)), n)
            sweep = {}
            for cn, cfg in CONFIGS.items():
                if cfg.split and seg == 1 or cfg.block_m >= 128 and M <= 32:
                    continue
                try:
                    sweep[cn] = bench_graph(lambda i: (lambda: matmul(xs[i], ws[i], k_segments=seg, config=cfg)), n) * 1e3
                except Exception:  # noqa: BLE001
                    sweep[cn] = None
            ok = {k_: v_ for k_, v_ in sweep.items() if v_}
            best = min(ok, key=ok.get)
            _row(rows, f"gemm1b {name} K={K} N={N} seg={seg} M={M} pick={pick.name} best={best} {ok[best]:.1f}us", tb,
                 ta, name=name, K=K, N=N, k_segments=seg, M=M, config=pick.name, best=best, sweep_us=sweep,
                 baseline="cuBLAS x @ W.T")
            del ws, xs
    return rows


# ----------------------------------------------------------------------------- row-parallel segments

SEGMENT_COUNTS = (1, 2, 4, 8, 16)
# (name, K, N) of row-parallel projections (their K is what a TP engine splits)
SEGMENT_SHAPES = (("moe1b o_proj", 2048, 1024), ("qwen3-30b o_proj", 4096, 2048),
                  ("qwen2-1.5b o_proj", 1536, 1536), ("qwen2-1.5b down", 8960, 1536),
                  ("dsv3 o_proj", 16384, 7168), ("dsv3 shared down", 2048, 7168),
                  ("dsv3 dense down", 18432, 7168))


def bench_segments(args):
    """What a fixed row-parallel K segmentation costs: the Triton GEMM and the routed
    experts' down GEMM at 1 / 2 / 4 / 8 / 16 K segments, decode to prefill M, beside cuBLAS."""
    from kernels.triton.gemm import matmul, pick_config
    from kernels.triton.moe import moe_experts_merged

    bench_graph, copies = _bg()
    rows = []
    for name, K, N in SEGMENT_SHAPES:
        for M in (1, 16, 64, 256, 1024, 4096):
            n = copies(N * K * 2 + M * K * 2)
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(n)]
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            tb = bench_graph(lambda i: (lambda: xs[i] @ ws[i].T), n)
            t1 = None
            for seg in SEGMENT_COUNTS:
                if K % seg:
                    continue
                ta = bench_graph(lambda i: (lambda: matmul(xs[i], ws[i], k_segments=seg)), n)
                t1 = t1 or ta
                cfg = pick_config(M, K, N, seg).name
                rows.append(dict(kind="gemm", name=name, K=K, N=N, M=M, k_segments=seg, config=cfg,
                                 cublas_us=tb * 1e3, triton_us=ta * 1e3, vs_one_segment=ta / t1))
                print(f"gemm {name:<18} K={K:5d} N={N:5d} M={M:5d} seg={seg:2d} {cfg:>20} cuBLAS {tb * 1e3:8.1f} us"
                      f"  triton {ta * 1e3:8.1f} us  /seg1 {ta / t1:5.2f}", flush=True)
            del ws, xs
    for name, H, I, E, k in (("qwen3-30b experts", 2048, 768, 128, 8), ("dsv3 experts", 7168, 2048, 256, 8)):
        n = 1 if E * H * I * 6 > 3 * 2**30 else 2
        wgu = [torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5 for _ in range(n)]
        wd = [torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5 for _ in range(n)]
        for T in (1, 64, 256, 2048):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            w, ids = torch.randn(T, E, device="cuda").softmax(-1).topk(k, -1)
            w = w / w.sum(-1, keepdim=True)
            t1 = None
            for seg in SEGMENT_COUNTS:
                if I % seg:
                    continue
                ta = bench_graph(lambda i: (lambda: moe_experts_merged(x, wgu[i], wd[i], ids, w, k_segments_down=seg)),
                                 n, iters=8)
                t1 = t1 or ta
                rows.append(dict(kind="moe", name=name, H=H, I=I, E=E, k=k, T=T, k_segments_down=seg,
                                 aligned_us=ta * 1e3, vs_one_segment=ta / t1))
                print(f"moe  {name:<18} H={H} I={I} E={E} T={T:5d} seg={seg:2d} {ta * 1e3:9.1f} us  /seg1 {ta / t1:5.2f}",
                      flush=True)
        del wgu, wd
        torch.cuda.empty_cache()
    return rows


NEW_GROUPS = {
    "segments": bench_segments,
    "gemm1b": bench_gemm1b,
    "rope": bench_rope,
    "router": bench_router,
    "attention": bench_attention,
    "moe": bench_moe,
    "fp8": bench_fp8,
    "decode": bench_decode,
}
