"""Agentic tool use on the CPU: `rz train` on recipes/tiny_moe_agentic.yaml at schedule.max_lag=0 and
at max_lag=64 (async), from one base model; the held-out reward before and after, every update's
D3, IS weights, KL and grad norm, the tool use and the faults, the lag histograms.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agentic_cpu.py [--work DIR] [--steps N] [--lags 0 64]
        [--out benchmarks/results/agentic_cpu] [KEY=VALUE recipe overrides ...]

Each run is a plain `rz train` subprocess (the run directories stay under --work); what is kept in
--out: summary.json, metrics_lag<m>.jsonl.gz and the PNG plots. An opt-in benchmark, not a test
(about 10 minutes per run on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_moe_agentic.yaml"


def run_one(work: Path, lag: int, steps: int, overrides: list[str], base: Path) -> Path:
    run = work / f"lag{lag}"
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    shutil.copytree(base, run / "base_model")
    cmd = [sys.executable, "-m", "megatron_rz.cli", "train", str(RECIPE), f"logging.run_dir={run}",
           f"schedule.max_lag={lag}", f"schedule.steps={steps}", "logging.progress=false", *overrides]
    t0 = time.perf_counter()
    with open(run.with_suffix(".log"), "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})
    if rc != 0:
        raise SystemExit(f"rz train at max_lag={lag} failed (exit {rc}); its log: {run.with_suffix('.log')}")
    print(f"max_lag={lag}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run


def rows_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def summarise(runs: dict[int, Path]) -> dict:
    out: dict = {"recipe": str(RECIPE.relative_to(ROOT)), "runs": {}}
    for lag, run in runs.items():
        rows = rows_of(run)
        train = [r for r in rows if "frac_bitwise" in r]
        evals = [r for r in rows if "eval_reward" in r]
        s = json.loads((run / "summary.json").read_text())
        tot = lambda k: sum(r.get(k, 0) for r in train)  # noqa: E731
        lag_hist = {j: sum(r.get(f"frac_tokens_lag_{j}", 0.0) * r["tokens"] for r in train) for j in range(lag + 1)}
        n_tok = sum(r["tokens"] for r in train)
        out["runs"][f"lag{lag}"] = {
            "max_lag": lag, "updates": len(train), "wall_s_loop": sum(r["time_step"] for r in train),
            "eval_reward_before": evals[0]["eval_reward"], "eval_reward_after": evals[-1]["eval_reward"],
            "eval_tool_call_rate_before": evals[0].get("eval/heldout/tool_call_rate"),
            "eval_tool_call_rate_after": evals[-1].get("eval/heldout/tool_call_rate"),
            "eval_rewards": [(r["step"], r["eval_reward"]) for r in evals],
            "train_reward_first": train[0]["reward_mean"], "train_reward_last": train[-1]["reward_mean"],
            "model_tokens": tot("agentic/model_tokens"), "env_tokens_masked": tot("agentic/env_tokens"),
            "episodes": tot("agentic/episodes"), "turns": tot("agentic/turns"), "tool_calls": tot("agentic/tool_calls"),
            "tool_errors": tot("agentic/tool_errors"), "tool_timeouts": tot("agentic/tool_timeouts"),
            "tool_truncated": tot("agentic/tool_truncated"), "malformed_calls": tot("agentic/malformed_calls"),
            "context_full": tot("agentic/context_full"),
            "frac_bitwise_mean": sum(r["frac_bitwise"] for r in train) / len(train),
            "lag0_pure_frac_bitwise_min": min((r["lag0_pure_frac_bitwise"] for r in train
                                               if "lag0_pure_frac_bitwise" in r), default=None),
            "lag0_pure_tokens": sum(r.get("lag0_pure_tokens", 0) for r in train),
            "d3_max": max(r["d3"] for r in train), "is_w_max": max(r["is_w_max"] for r in train),
            "kl_k1_max": max(r["kl_k1"] for r in train), "grad_norm_max": max(r["grad_norm"] for r in train),
            "lag_mean": sum(r["lag_mean"] * r["tokens"] for r in train) / max(1, n_tok),
            "lag_max": max(r["lag_max"] for r in train),
            "frac_samples_span_versions_mean": sum(r["frac_samples_span_versions"] for r in train) / len(train),
            "token_lag_histogram": {j: v / max(1, n_tok) for j, v in lag_hist.items() if v},
            "run_summary": s,
        }
    return out


def plots(runs: dict[int, Path], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "agentic_d3.png": ([("d3", "D3 = mean(w - 1 - log w)")], "symlog"),
        "agentic_is_weights.png": ([("is_w_max", "IS weight max"), ("is_w_min", "IS weight min"),
                                    ("is_w_mean", "IS weight mean")], "log"),
        "agentic_kl.png": ([("kl_k1", "KL k1 (rollout || learner)")], "symlog"),
        "agentic_grad_norm.png": ([("grad_norm", "grad norm (before clipping)")], "linear"),
        "agentic_train_reward.png": ([("reward_mean", "train reward (episodes)")], "linear"),
        "agentic_tool_use.png": ([("agentic/tool_call_rate", "episodes calling a tool"),
                                  ("agentic/turns_mean", "turns per episode")], "linear"),
    }
    written = []
    for fname, (keys, scale) in series.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for lag, run in runs.items():
            rows = [r for r in rows_of(run) if "frac_bitwise" in r]
            for key, label in keys:
                pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, label=f"{label}, max_lag={lag}", lw=1.2)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-6)
        elif scale == "log":
            ax.set_yscale("log")
        ax.set_xlabel("update")
        ax.set_title(fname.removesuffix(".png").replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)
        written.append(out / fname)
    # held-out reward: points at every evaluation
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for lag, run in runs.items():
        ev = [(r["step"], r["eval_reward"]) for r in rows_of(run) if "eval_reward" in r]
        xs, ys = zip(*ev)
        ax.plot(xs, ys, marker="o", label=f"held-out greedy reward, max_lag={lag}")
    ax.set_xlabel("update")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("agentic calc: held-out reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "agentic_heldout_reward.png", dpi=100)
    plt.close(fig)
    written.append(out / "agentic_heldout_reward.png")
    # the token lag histogram of the async run(s)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for lag, run in runs.items():
        if lag == 0:
            continue
        rows = [r for r in rows_of(run) if "frac_bitwise" in r]
        n = sum(r["tokens"] for r in rows)
        tok = [sum(r.get(f"frac_tokens_lag_{j}", 0.0) * r["tokens"] for r in rows) / n for j in range(lag + 1)]
        ep_n = sum(r.get("agentic/episodes", 0) for r in rows)
        eps = [sum(r.get(f"frac_episodes_lag_{j}", 0.0) * r.get("agentic/episodes", 0) for r in rows) / max(1, ep_n)
               for j in range(lag + 1)]
        top = max([j for j in range(lag + 1) if tok[j] or eps[j]], default=0) + 1
        ax.bar([j - 0.2 for j in range(top)], tok[:top], width=0.4, label=f"model tokens, max_lag={lag}")
        ax.bar([j + 0.2 for j in range(top)], eps[:top], width=0.4, label=f"episodes (start version), max_lag={lag}")
    ax.set_xlabel("lag (updates)")
    ax.set_ylabel("share")
    ax.set_title("policy lag histogram")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "agentic_lag_histogram.png", dpi=100)
    plt.close(fig)
    written.append(out / "agentic_lag_histogram.png")
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/rz_agentic_bench")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agentic_cpu"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 64])
    ap.add_argument("--only-report", action="store_true", help="summarise the runs already under --work")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if a.only_report:
        runs = {lag: work / f"lag{lag}" for lag in a.lags}
    else:
        from megatron_rz.launch.rundir import prepare_base_model
        from megatron_rz.recipe import load_recipe

        t0 = time.perf_counter()
        base = prepare_base_model(load_recipe(str(RECIPE), list(a.overrides)), work / "shared")
        print(f"base model {base} ({time.perf_counter() - t0:.0f} s)", flush=True)
        runs = {lag: run_one(work, lag, a.steps, list(a.overrides), base) for lag in a.lags}
    summary = summarise(runs)
    summary.update(steps=a.steps, overrides=list(a.overrides), cpu_count=os.cpu_count(),
                   command="OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agentic_cpu.py "
                           + " ".join([f"--steps {a.steps}", "--lags", *map(str, a.lags), *a.overrides]))
    for lag, run in runs.items():
        with gzip.open(out / f"metrics_lag{lag}.jsonl.gz", "wt") as f:
            f.write((run / "metrics.jsonl").read_text())
        summary["runs"][f"lag{lag}"]["run_summary"].pop("run_dir", None)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for p in plots(runs, out):
        print("wrote", p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
    for name, r in summary["runs"].items():
        print(f"{name}: held-out reward {r['eval_reward_before']:.2f} -> {r['eval_reward_after']:.2f}; "
              f"tool calls {r['tool_calls']} (errors {r['tool_errors']}, timeouts {r['tool_timeouts']}, "
              f"truncated {r['tool_truncated']}), malformed {r['malformed_calls']}; env tokens masked "
              f"{r['env_tokens_masked']} of {r['env_tokens_masked'] + r['model_tokens']}; lag mean {r['lag_mean']:.1f}")


if __name__ == "__main__":
    main()
