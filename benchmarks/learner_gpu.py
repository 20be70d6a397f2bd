"""The learner's train step, aligned vs fast, on one GPU: same weights, same batch, each mode alone in
its own process.

    python benchmarks/learner_gpu.py bench --out $OUT/learner.json [--configs gpu_moe,qwen2_1p5b]
        [--modes aligned,fast_te,fast_local] [--rounds 2] [--steps 5] [--budget-s 900] [--profile-dir $OUT/prof]
    python benchmarks/learner_gpu.py one --config gpu_moe --mode aligned --out x.json [--profile p.txt]

One *train step* is what ``rz train`` runs per update: ``Learner.train_step`` on ``batch`` sequences of
``seq`` tokens in micro batches of ``mbs`` (forward, backward, Megatron's DDP grad finalisation,
the bf16 mixed-precision Adam step with grad clipping), the REINFORCE surrogate of
``parallel_check.reinforce_loss``. Weights: random bf16 Hugging Face tensors (std 0.02, norms 1, a
fixed seed), loaded by both modes. ``aligned`` = ``mode=aligned`` (every forward op a ``kernels`` op,
bitwise the rollout engine's); ``fast_te`` = ``mode=fast runtime.te=on`` (Megatron-Core's Transformer
Engine layer spec: TE linears with fused RMSNorm, TE attention, grouped-GEMM experts; what ``rz train
... mode=fast`` runs where TE is installed, the baseline a Megatron user on Hopper has; it fails, and
the JSON says why, where TE does not import); ``fast_local`` = ``mode=fast runtime.te=off``
(Megatron-Core's local layer spec with the project's stock-numerics RMSNorm / attention, SequentialMLP
experts); ``fast`` = ``mode=fast runtime.te=auto`` (whichever of the two this machine gives). Each
run records the layers it built (``learner_spec``) and the TE version. The optimizer is torch's Adam
in every mode (megatron_patches 2d).

``bench`` runs ``one`` in a fresh process per (config, mode, round), modes alternating within a round,
and writes per config the median step time of each mode over all its timed steps, the spread of the
per-round medians, and the ratios of the modes (aligned / fast_te, aligned / fast_local, fast_te /
fast_local, ...). Rounds stop starting when ``--budget-s`` has passed (the JSON says which ran). ``--profile-dir``: one extra profiled step per (config, mode) after the timed ones,
torch.profiler's table of CUDA time per op (forward and backward) as text.

Configs (``CONFIGS``): gpu_moe (recipes/gpu_moe.yaml: the D3 runs' model and update), Qwen3-30B-A3B's
shapes in 4 layers, DeepSeek-V3's MLA + MoE shapes in 4 layers (1 dense), and R1-Distill-Qwen-1.5B
(dense Qwen2, its real 28 layers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (recipe, overrides, batch, seq, micro batch)
CONFIGS = {
    "gpu_moe": ("recipes/gpu_moe.yaml", [], 128, 256, 32),
    "qwen3_30b_a3b_4l": ("recipes/qwen3_30b_a3b.yaml", ["model.num_layers=4", "model.max_position_embeddings=4096", "rollout.max_new_tokens=1024"],
                         32, 1024, 4),
    "dsv3_4l": ("recipes/deepseek_v3_671b.yaml",
                ["model.hidden_size=2048", "model.num_layers=4", "model.num_attention_heads=16",
                 "model.num_kv_heads=16", "model.num_experts=64", "model.top_k=6", "model.router_group_topk=3",
                 "model.moe_ffn_hidden_size=1024", "model.dense_ffn_hidden_size=5632", "model.first_k_dense=1",
                 "model.q_lora_rank=768", "model.vocab_size=32000", "model.max_position_embeddings=4096", "rollout.max_new_tokens=1024"],
                32, 1024, 4),
    "qwen2_1p5b": ("recipes/r1_distill_qwen_1p5b.yaml", ["model.max_position_embeddings=4096", "rollout.max_new_tokens=1024"], 16, 1024, 4),
}
ONE_GPU = ["parallel.tp=1", "parallel.ep=1", "parallel.dp=1", "parallel.pp=1", "parallel.distributed_optimizer=false"]
# benchmark mode -> (recipe mode, runtime.te)
MODES = {"aligned": ("aligned", "off"), "fast_te": ("fast", "on"), "fast_local": ("fast", "off"),
         "fast": ("fast", "auto")}


def bench_recipe(name: str, mode: str):
    from megatron_rz.recipe import load_recipe

    path, overrides, *_ = CONFIGS[name]
    rmode, te = MODES[mode]
    return load_recipe(ROOT / path, list(overrides) + ONE_GPU + [f"mode={rmode}", f"runtime.te={te}", "algo.lr=1e-6"])


def random_hf_weights(model_cfg, seed: int = 0, device: str = "cuda") -> dict:
    """Random bf16 Hugging Face tensors for ``model_cfg`` (std 0.02; norms 1; router bias 0): the
    names and shapes of the family's Hugging Face config (tiny_models.hf_config)."""
    import torch

    from megatron_rz.learner.tiny_models import hf_config

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from rollout_gpu import param_shapes

    c = hf_config(model_cfg, 1, 0).to_dict()
    c.setdefault("head_dim", model_cfg.head_dim)
    c["model_type"] = {"qwen3_moe": "qwen3_moe", "qwen2": "qwen2", "deepseek_v3": "deepseek_v3"}[model_cfg.arch]
    for k, v in (("num_experts", model_cfg.num_experts), ("n_routed_experts", model_cfg.num_experts),
                 ("moe_intermediate_size", model_cfg.moe_ffn_hidden_size),
                 ("intermediate_size", model_cfg.dense_ffn_hidden_size),
                 ("first_k_dense_replace", model_cfg.first_k_dense), ("n_shared_experts", model_cfg.num_shared_experts)):
        c.setdefault(k, v)
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for n, shape in param_shapes(c).items():
        if n.endswith("norm.weight") or "layernorm" in n:
            sd[n] = torch.ones(shape, device=device, dtype=torch.bfloat16)
        elif n.endswith("e_score_correction_bias"):
            sd[n] = torch.zeros(shape, device=device, dtype=torch.float32)
        else:
            sd[n] = (torch.randn(shape, device=device, generator=g) * 0.02).to(torch.bfloat16)
    return sd


def _batch(vocab: int, batch: int, seq: int, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq)
    mask[:, seq // 4:] = 1.0  # a quarter prompt, the rest response
    adv = torch.linspace(-1.0, 1.0, batch)
    return ids, {"loss_mask": mask, "advantages": adv}


def run_one(name: str, mode: str, steps: int, warmup: int = 2, profile: str | None = None) -> dict:
    import torch

    try:
        from kernels import moe_grad  # absent in trees before the grouped MoE backward ("before" runs)
    except ImportError:
        moe_grad = None
    from megatron_rz.learner.learner import Learner
    from megatron_rz.learner.parallel_check import reinforce_loss

    _, _, batch, seq, mbs = CONFIGS[name]
    r = bench_recipe(name, mode)
    t0 = time.perf_counter()
    learner = Learner(r.model, r.parallel, r.algo, random_hf_weights(r.model), seed=0, mode=r.mode, te=r.runtime.te)
    build_s = time.perf_counter() - t0
    ids, rows = _batch(r.model.vocab_size, batch, seq)

    def step():
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = learner.train_step(ids, reinforce_loss, micro_batch_size=mbs, **rows)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    from benchmarks.machine_probe import probe

    first_s, _ = step()
    for _ in range(max(0, warmup - 1)):
        step()
    probes = [probe()]  # the machine's speed before and after the timed steps (machine_probe.py)
    torch.cuda.reset_peak_memory_stats()
    times, grad_norms = [], []
    for _ in range(steps):
        s, out = step()
        times.append(s)
        grad_norms.append(out["grad_norm"])
    probes.append(probe())
    from megatron_rz.learner.te_spec import te_version

    te_attention = None
    if learner.spec == "te":  # which attention TE picked for these shapes (flash / cuDNN fused / unfused)
        try:  # TE keeps its last selection in this module-level table (TE 2.x); a diagnostic only
            from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

            te_attention = {k: v if isinstance(v, (bool, int, str, type(None))) else str(v)
                            for k, v in dpa._attention_backends.items() if k != "attention_params"}
        except Exception as e:  # another TE layout: say so rather than guess
            te_attention = {"unknown": f"{type(e).__name__}: {e}"}

    res = {"config": name, "mode": mode, "learner_spec": learner.spec,
           "transformer_engine": te_version() if learner.spec == "te" else None, "te_attention": te_attention,
           "batch": batch, "seq": seq,
           "micro_batch": mbs,
           "params": sum(p.numel() for p in learner.model.parameters()), "build_s": build_s, "first_step_s": first_s,
           "step_s": times, "median_s": statistics.median(times), "grad_norm": grad_norms,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "grouped_mm": dict(moe_grad.GROUPED_MM) if moe_grad else None,
           "tokens_per_s": batch * seq / statistics.median(times), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "probes": probes}
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            step()
        avg = p.key_averages()
        table = avg.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
        kernels = avg.table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
        Path(profile).parent.mkdir(parents=True, exist_ok=True)
        Path(profile).write_text(f"# {name} {mode}: one train step ({batch} x {seq}, micro batch {mbs})\n"
                                 f"## by CUDA time including children (ops)\n{table}\n"
                                 f"## by self CUDA time (kernels)\n{kernels}\n")
        res["profile"] = str(profile)
    return res


def bench(out: str, configs: list[str], modes: list[str], rounds: int, steps: int, budget_s: float,
          profile_dir: str | None, te_debug: bool = False) -> dict:
    t_start = time.time()
    report = {"command": " ".join(sys.argv), "configs": {}, "skipped": []}
    outp = Path(out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    for name in configs:
        runs = {m: [] for m in modes}
        for rnd in range(rounds):
            order = modes if rnd % 2 == 0 else modes[::-1]
            for mode in order:
                if time.time() - t_start > budget_s:
                    report["skipped"].append(f"{name}/{mode}/round{rnd}")
                    continue
                if any("runtime.te=on" in r.get("error", "") for r in runs[mode]):  # no TE here: once is enough
                    report["skipped"].append(f"{name}/{mode}/round{rnd} (Transformer Engine cannot run here)")
                    continue
                tmp = outp.parent / f".{name}_{mode}_{rnd}.json"
                cmd = [sys.executable, __file__, "one", "--config", name, "--mode", mode, "--steps", str(steps),
                       "--out", str(tmp)]
                if profile_dir and rnd == 0:
                    cmd += ["--profile", str(Path(profile_dir) / f"{name}_{mode}.txt")]
                t = time.time()
                env = dict(os.environ, NVTE_DEBUG="1", NVTE_DEBUG_LEVEL="2") if te_debug and mode.startswith("fast") else None
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    runs[mode].append({"error": proc.stderr[-3000:], "rc": proc.returncode})
                else:
                    runs[mode].append(json.loads(tmp.read_text()))
                    tmp.unlink()
                    if env is not None:  # TE's reasons for its attention backend, in its own words
                        runs[mode][-1]["te_debug"] = [ln[:400] for ln in (proc.stdout + proc.stderr).splitlines()
                                                      if "DotProductAttention" in ln or "Disabling" in ln][-60:]
                print(f"[learner bench] {name} {mode} round {rnd}: "
                      f"{runs[mode][-1].get('median_s', 'error')} s/step ({time.time() - t:.0f} s)", flush=True)
        entry = {"runs": runs}
        ok = {m: [r for r in rs if "median_s" in r] for m, rs in runs.items()}
        for m, rs in ok.items():
            if rs:
                all_steps = [s for r in rs for s in r["step_s"]]
                meds = [r["median_s"] for r in rs]
                entry[m] = {"learner_spec": rs[0].get("learner_spec"), "transformer_engine": rs[0].get("transformer_engine"),
                            "te_attention": rs[0].get("te_attention"),
                            "median_s": statistics.median(all_steps), "round_medians_s": meds,
                            "spread": max(meds) / min(meds), "peak_gib": max(r["peak_gib"] for r in rs)}
        from benchmarks.machine_probe import spread

        entry["machine"] = spread([q for rs in ok.values() for r in rs for q in r.get("probes", [])])
        timed = [m for m in modes if m in entry]
        for i, a in enumerate(timed):  # every pair, in the order of --modes: aligned_over_fast_te, ...
            for b in timed[i + 1:]:
                entry[f"{a}_over_{b}"] = entry[a]["median_s"] / entry[b]["median_s"]
        report["configs"][name] = entry
        outp.write_text(json.dumps(report, indent=1) + "\n")
    report["wall_s"] = time.time() - t_start
    outp.write_text(json.dumps(report, indent=1) + "\n")
    for name, e in report["configs"].items():
        ratios = "".join(f", {k.replace('_over_', '/')} {v:.2f}" for k, v in e.items() if "_over_" in k)
        print(f"{name}: " + ", ".join(f"{m} {e[m]['median_s']:.3f} s" for m in modes if m in e) + ratios)
        if not e["machine"]["stable"]:
            print(f"  {name}: the machine's speed moved during the run ({json.dumps(e['machine'])}): "
                  "do not read these ratios as a measurement", flush=True)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--out", required=True)
    b.add_argument("--configs", default=",".join(CONFIGS))
    b.add_argument("--modes", default="aligned,fast_te,fast_local", help=f"some of {', '.join(MODES)}")
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--steps", type=int, default=5)
    b.add_argument("--budget-s", type=float, default=900.0)
    b.add_argument("--profile-dir")
    b.add_argument("--te-debug", action="store_true",
                   help="fast modes: run with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 and keep TE's attention-backend lines")
    o = sub.add_parser("one")
    o.add_argument("--config", choices=sorted(CONFIGS), required=True)
    o.add_argument("--mode", choices=tuple(MODES), required=True)
    o.add_argument("--steps", type=int, default=5)
    o.add_argument("--out", required=True)
    o.add_argument("--profile")
    a = ap.parse_args(argv)
    if a.cmd == "one":
        res = run_one(a.config, a.mode, a.steps, profile=a.profile)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    taken = [x for x in (a.out, a.profile_dir) if x and Path(x).exists()]
    if taken:  # never overwrite an earlier run's results or profiles
        raise SystemExit(f"learner_gpu: {taken[0]} already exists; give another --out / --profile-dir")
    bad = [c for c in a.configs.split(",") if c not in CONFIGS]
    if bad:
        raise SystemExit(f"learner_gpu: --configs {bad[0]!r}: expected some of {', '.join(CONFIGS)}")
    bad = [m for m in a.modes.split(",") if m not in MODES]
    if bad:
        raise SystemExit(f"learner_gpu: --modes {bad[0]!r}: expected some of {', '.join(MODES)}")
    bench(a.out, a.configs.split(","), a.modes.split(","), a.rounds, a.steps, a.budget_s, a.profile_dir, a.te_debug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
