"""Benchmark the Triton aligned ops against cuBLAS / torch, side by side in one process.

    PYTHONPATH=. python benchmarks/gpu_kernels.py --out benchmarks/results/gpu_kernels_h200.json
    PYTHONPATH=. python benchmarks/gpu_kernels.py --sweep --out sweep.json   # every GEMM config
    PYTHONPATH=. python benchmarks/gpu_kernels.py --sweep --model /root/ckpt/qwen2_1p5b \
        --ms 1 16 32 64 128 256 512 1024 2048 4096 --out s.json --table-out t.json   # a model's pick table
    PYTHONPATH=. python benchmarks/gpu_kernels.py --groups rope router attention moe fp8 decode \
        --out benchmarks/results/gpu_ops_h200.json                              # the newer groups

Timing: each op is captured ITERS times into a CUDA graph (cycling through several weight / input
copies so that the weights do not sit in L2), the graph is replayed REPS times, and the median per-op
time is reported. The baseline is measured the same way in the same process: default cuBLAS
(``x @ W.T``, bf16, with its workspace, i.e. the batch-variant library path) for GEMM,
``F.rms_norm`` for RMSNorm and ``(logits.float() / T).log_softmax(-1).gather`` for log-probs.
ratio = baseline time / Triton time (>= 1: Triton as fast or faster).

Groups (``--groups``): gemm, rmsnorm, logprobs (the first three, default set of earlier runs), segments (row-parallel K segmentation), rope,
router, attention, moe, fp8, decode. Baselines of the newer groups: RoPE and router in torch ops
(graph-captured), SDPA (flash) for attention, ``torch._grouped_mm`` for the routed experts,
``torch._scaled_mm`` (blockwise 1x128 / 128x128 scales where this torch supports it) for FP8, and for
``decode`` one decode step of the ~1B MoE model of benchmarks/moe_model.py built from stock torch ops
(cuBLAS, SDPA, _grouped_mm) vs the same model built from our aligned ops, both graph-captured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())

from benchmarks.graph_timing import bench_graph, copies  # noqa: E402

GEMM_SHAPES = [(4096, 4096), (7168, 2048), (2048, 7168), (4096, 14336), (14336, 4096)]  # (K, N)
GEMM_MS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def gemm_case(K, N, M, config=None):
    from kernels.triton.gemm import matmul

    n = copies(N * K * 2 + M * K * 2)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(n)]
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    t_cublas = bench_graph(lambda i: (lambda: xs[i] @ ws[i].T), n)
    t_triton = bench_graph(lambda i: (lambda: matmul(xs[i], ws[i], config=config)), n)
    del ws, xs
    return t_cublas, t_triton


def sweep_shapes(args) -> list[tuple[int, int, int, int | None]]:
    """(K, N, k_segments, max M) to sweep: --model's layer shapes, else --shapes, else GEMM_SHAPES."""
    from kernels.triton.gemm import default_k_segments

    if args.model:
        from benchmarks.gemm_shapes import load_config, model_gemm_shapes

        found = model_gemm_shapes(load_config(args.model))
        print("shapes of", args.model, ":", ", ".join(f"{s.name} {s.K}->{s.N}/{s.k_segments}" for s in found), flush=True)
        return [(s.K, s.N, s.k_segments, s.max_m) for s in found]
    shapes = [tuple(int(v) for v in x.split(",")) for x in args.shapes] if args.shapes else GEMM_SHAPES
    return [(sh[0], sh[1], sh[2] if len(sh) > 2 else default_k_segments(sh[0], sh[1]), None) for sh in shapes]


def run_sweep(args):
    from kernels import settings
    from kernels.triton.gemm import CONFIGS, matmul_partials, pick_config

    # "picked" is the heuristic's choice (kernels/triton/gemm.py), not a table's: a sweep measures
    # what a table would change
    settings.set_gemm_table("off")
    rows = []
    for K, N, nseg, max_m in sweep_shapes(args):
        for M in args.ms:
            if max_m is not None and M > max_m:
                continue
            from kernels.triton.gemm import matmul

            n = copies(N * K * 2 + M * K * 2)
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(n)]
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            t_cublas = bench_graph(lambda i: (lambda: xs[i] @ ws[i].T), n)
            res = {}
            for name, cfg in CONFIGS.items():
                if cfg.split and nseg == 1:
                    continue
                if cfg.block_m >= 128 and M <= 32 or cfg.block_m <= 32 and M > 1024:
                    continue
                # row-parallel layers hand split partials to the next add + norm (the engine's fast
                # path: kernels.linear_unreduced), so they are timed without the reduce kernel
                op = matmul_partials if (nseg > 1 and args.partials) else matmul
                try:
                    res[name] = bench_graph(lambda i: (lambda: op(xs[i], ws[i], config=cfg, k_segments=nseg)), n)
                except Exception as e:  # noqa: BLE001 (out of resources etc.)
                    res[name] = None
                    print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            ok = {k: v for k, v in res.items() if v}
            if not ok:
                print(f"K={K} N={N} nseg={nseg} M={M}: every config failed", flush=True)
                rows.append(dict(K=K, N=N, M=M, nseg=nseg, cublas_ms=t_cublas, configs=res, best=None, picked=None))
                continue
            best = min(ok, key=ok.get)
            pc = pick_config(M, K, N, nseg)
            picked = next((k for k, c in CONFIGS.items() if c == pc), pc.name)  # CONFIGS' key
            print(f"K={K:6d} N={N:6d} nseg={nseg} M={M:5d} cublas {t_cublas*1e3:8.1f}us  picked {picked} "
                  f"{(res.get(picked) or float('nan'))*1e3:8.1f}us  best {best:22s}"
                  f" {ok[best]*1e3:8.1f}us ratio {t_cublas/ok[best]:.2f}  | "
                  + " ".join(f"{k}={v*1e3:.0f}" for k, v in sorted(ok.items(), key=lambda kv: kv[1])[:5]),
                  flush=True)
            rows.append(dict(K=K, N=N, M=M, nseg=nseg, cublas_ms=t_cublas, configs=res, best=best, picked=picked,
                             partials=bool(nseg > 1 and args.partials)))
            if args.out:  # partial results survive a time-out
                with open(args.out, "w") as f:
                    json.dump({"sweep": rows}, f, indent=1)
            del ws, xs
    return {"sweep": rows}


def run_main(args):
    from benchmarks.gpu_ops_bench import NEW_GROUPS

    out = {}
    groups = args.groups
    old = [g for g in groups if g in ("gemm", "rmsnorm", "logprobs")]
    if old:
        out.update({k: v for k, v in run_old(args, old).items() if v})
    for g in groups:
        if g in NEW_GROUPS:
            print(f"\n=== {g} ===", flush=True)
            try:
                out[g] = NEW_GROUPS[g](args)
            except Exception as e:  # noqa: BLE001  (keep the other groups' results)
                import traceback

                traceback.print_exc()
                out[g] = {"error": f"{type(e).__name__}: {e}"}
            if args.out:  # partial results survive a time-out
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
    return out


def run_old(args, groups):
    from kernels.triton import logprobs_from_logits, rms_norm
    from kernels.triton.gemm import default_k_segments, pick_config

    out = {"gemm": [], "rmsnorm": [], "logprobs": []}
    print(f"{'K':>6} {'N':>6} {'M':>5} {'config':>22} {'cuBLAS us':>10} {'triton us':>10} {'TF/s':>7} {'ratio':>6}")
    for K, N in (GEMM_SHAPES if "gemm" in groups else []):
        nseg = default_k_segments(K, N)
        for M in args.ms:
            t_c, t_t = gemm_case(K, N, M)
            cfg = pick_config(M, K, N, nseg)
            tf = 2 * M * N * K / (t_t * 1e-3) / 1e12
            print(f"{K:6d} {N:6d} {M:5d} {cfg.name:>22} {t_c*1e3:10.1f} {t_t*1e3:10.1f} {tf:7.1f} {t_c/t_t:6.2f}",
                  flush=True)
            out["gemm"].append(dict(K=K, N=N, M=M, k_segments=nseg, config=cfg.name, cublas_us=t_c * 1e3,
                                    triton_us=t_t * 1e3, triton_tflops=tf, ratio=t_c / t_t))
    print(f"\n{'D':>6} {'rows':>6} {'dtype':>9} {'torch us':>9} {'triton us':>9} {'ratio':>6}")
    F = torch.nn.functional
    for D in ((128, 4096, 7168) if "rmsnorm" in groups else ()):
        for R in (1, 64, 4096, 32768):
            for dt in (torch.bfloat16,):
                n = copies(R * D * 2 * 2)
                xs = [torch.randn(R, D, device="cuda", dtype=dt) for _ in range(n)]
                w = torch.randn(D, device="cuda", dtype=dt)
                t_ref = bench_graph(lambda i: (lambda: F.rms_norm(xs[i], (D,), w, 1e-6)), n)
                t_tri = bench_graph(lambda i: (lambda: rms_norm(xs[i], w, 1e-6)), n)
                print(f"{D:6d} {R:6d} {str(dt)[6:]:>9} {t_ref*1e3:9.1f} {t_tri*1e3:9.1f} {t_ref/t_tri:6.2f}", flush=True)
                out["rmsnorm"].append(dict(D=D, rows=R, dtype=str(dt), torch_us=t_ref * 1e3,
                                           triton_us=t_tri * 1e3, ratio=t_ref / t_tri))
                del xs
    print(f"\n{'V':>7} {'rows':>6} {'dtype':>9} {'torch us':>9} {'triton us':>9} {'ratio':>6}")
    for V in ((32000, 151936) if "logprobs" in groups else ()):
        for R in (1, 64, 1024, 4096):
            dt = torch.bfloat16
            n = copies(R * V * 2)
            ls = [torch.randn(R, V, device="cuda", dtype=dt) * 4 for _ in range(n)]
            tg = torch.randint(0, V, (R,), device="cuda")
            T = 0.7

            def ref(i):
                return lambda: (ls[i].float() / T).log_softmax(-1, dtype=torch.float32).gather(
                    -1, tg[:, None]).squeeze(-1)

            t_ref = bench_graph(ref, n)
            t_tri = bench_graph(lambda i: (lambda: logprobs_from_logits(ls[i], tg, T)), n)
            print(f"{V:7d} {R:6d} {str(dt)[6:]:>9} {t_ref*1e3:9.1f} {t_tri*1e3:9.1f} {t_ref/t_tri:6.2f}", flush=True)
            out["logprobs"].append(dict(V=V, rows=R, dtype=str(dt), temperature=T, torch_us=t_ref * 1e3,
                                        triton_us=t_tri * 1e3, ratio=t_ref / t_tri))
            del ls
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ms", type=int, nargs="*", default=GEMM_MS)
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="--sweep shapes as K,N or K,N,k_segments (e.g. 8960,1536,8: a row-parallel down_proj); "
                         "default: GEMM_SHAPES with their default segmentation")
    ap.add_argument("--model", default=None,
                    help="--sweep the GEMM shapes of this Hugging Face config (a checkpoint directory or its "
                         "config.json; benchmarks/gemm_shapes.py) instead of --shapes")
    ap.add_argument("--partials", action=argparse.BooleanOptionalAction, default=True,
                    help="time segmented shapes as the engine runs them: split partials handed on unreduced")
    ap.add_argument("--table-out", default=None,
                    help="--sweep: also write the fastest config per (K, N, k_segments, M) as a GEMM pick table "
                         "(kernels/triton/gemm_table.py; use it with RZ_GEMM_TABLE=PATH or commit it under "
                         "kernels/triton/gemm_tables/)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp8-sweep", action="store_true", help="also time every FP8 config at M >= 128")
    ap.add_argument("--groups", nargs="*", default=["gemm", "rmsnorm", "logprobs", "attention"])
    args = ap.parse_args()
    for flag, path in (("--out", args.out), ("--table-out", args.table_out)):
        if path and os.path.exists(path):  # never overwrite an earlier run's results
            print(f"gpu_kernels: {flag} {path} already exists; give another {flag}", file=sys.stderr)
            raise SystemExit(2)
    if args.table_out and not args.sweep:
        print("gpu_kernels: --table-out needs --sweep", file=sys.stderr)
        raise SystemExit(2)
    if args.model and not os.path.exists(args.model):
        print(f"gpu_kernels: --model {args.model} does not exist; give a checkpoint directory or a config.json",
              file=sys.stderr)
        raise SystemExit(2)
    t0 = time.time()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, cuda=torch.version.cuda)
    res = run_sweep(args) if args.sweep else run_main(args)
    res["meta"] = meta | {"seconds": time.time() - t0}
    if args.table_out:
        from benchmarks.gemm_shapes import dump_table, table_from_sweep

        table = table_from_sweep(res["sweep"], meta | {"command": " ".join(["gpu_kernels.py"] + sys.argv[1:])})
        os.makedirs(os.path.dirname(os.path.abspath(args.table_out)), exist_ok=True)
        with open(args.table_out, "w") as f:
            f.write(dump_table(table))
        print(f"GEMM pick table: {args.table_out} ({len(table['entries'])} shapes)", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
