"""The long stability experiment: aligned vs fast from one base model, same seeds and step size, at
lag 2 and lag 8, with bf16 rollouts, resumable across sessions and SLURM jobs.

    python benchmarks/stability.py run --root DIR [--recipe recipes/tiny_moe.yaml] [--legs aligned:2,fast:2,aligned:8,fast:8]
        [--bf16 rollout|both] [--steps 5000] [--slice-s 600] [--budget-s 3600] [recipe overrides ...]

``--bf16 both`` (GPU): learner and vLLM in bf16 in both modes (``model.dtype=bfloat16``; aligned is
then bitwise in bf16, fast runs stock bf16 kernels on both sides). ``--bf16 rollout`` (the CPU
default: Megatron trains bf16 only on CUDA): fast legs sample in bf16 vLLM beside the fp32 learner
(``rollout.dtype=bfloat16``, the usual deployment), aligned legs run fp32 on both sides (one dtype
is what bitwise needs).
    python benchmarks/stability.py report --root DIR --out benchmarks/results/stability_cpu

``run`` makes the base model once (``DIR/base_model``, a warm start of the recipe with the overrides),
then advances the legs round-robin, ``--slice-s`` seconds of updates each (``rz train ...
checkpoint.load=latest schedule.time_limit_s=SLICE``: every slice ends at an update boundary with
its checkpoint and continues from it), until every leg has ``--steps`` updates or ``--budget-s``
has passed. Run it again later, with the same ``--root``, to continue: nothing is restarted or
overwritten. Each leg is ``DIR/<mode>_lag<L>``, a normal run directory (metrics.jsonl, plots,
checkpoints).

``report`` reads the legs' metrics and writes ``report.json`` / ``report.md`` and overlay plots per
lag into ``--out`` (a new directory, or one written by an earlier report of the same legs): per leg
the updates, the running D3 peak / median, D3 (= KL k3) and KL k1 medians over the first and the
last 10% of updates (and the first / last 1,000 when there are 2,000 or more), the largest gradient
norm before clipping and IS weight, reward and held-out evaluation first vs last; per lag the fast /
aligned ratios of those figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# a step size untruncated IS survives at lag 8 on this task (500 CPU updates at lag 8 and lr 1e-4 were
# stable in fp32), checkpoints often enough for short slices, sparse evaluation
DEFAULTS = ["algo.lr=1e-4", "rollout.prompts_per_step=8", "checkpoint.every=25", "schedule.eval_every=100",
            "logging.wandb=false"]
# per --bf16: (overrides of every leg and the base model, overrides of the fast legs only)
BF16 = {"both": (["model.dtype=bfloat16"], []), "rollout": ([], ["rollout.dtype=bfloat16"])}
# what make demo pins for reproducible CPU numerics (one thread, AVX2 code paths)
CPU_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
           "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_WAIT_POLICY": "PASSIVE"}


def _legs(spec: str) -> list[tuple[str, int]]:
    out = []
    for item in spec.split(","):
        mode, _, lag = item.partition(":")
        if mode not in ("aligned", "fast") or not lag.isdigit():
            raise SystemExit(f"stability: --legs item {item!r}: expected MODE:LAG with MODE aligned or fast, e.g. aligned:2")
        out.append((mode, int(lag)))
    return out


def _updates(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return 0
    return sum(1 for line in f.read_text().splitlines() if '"max_abs_dlogp"' in line)


def _rz(args: list[str], log: Path) -> int:
    env = {**os.environ, **CPU_ENV}
    with open(log, "a") as fh:
        fh.write(f"\n$ rz {' '.join(args)}\n")
        fh.flush()
        return subprocess.run([sys.executable, "-m", "megatron_rz.cli", *args], env=env, stdout=fh,
                              stderr=subprocess.STDOUT, cwd=ROOT).returncode


def run(root: Path, recipe: str, legs: list[tuple[str, int]], steps: int, slice_s: float, budget_s: float,
        overrides: list[str], bf16: str = "rollout") -> int:
    root.mkdir(parents=True, exist_ok=True)
    common, fast_only = BF16[bf16]
    ov = DEFAULTS + common + list(overrides)
    meta = {"recipe": recipe, "overrides": ov, "fast_overrides": fast_only, "bf16": bf16,
            "legs": [f"{m}:{lag}" for m, lag in legs], "steps": steps}
    mf = root / "experiment.json"
    if mf.is_file():  # a continued experiment must be the same experiment
        old = json.loads(mf.read_text())
        keys = ("recipe", "overrides", "fast_overrides")
        if {k: old.get(k) for k in keys} != {k: meta[k] for k in keys}:
            raise SystemExit(f"stability: {root} holds an experiment with recipe/overrides {old.get('recipe')} "
                             f"{old.get('overrides')}; continue it with the same ones or give another --root")
    mf.write_text(json.dumps(meta, indent=1))
    base = root / "base_model"
    log = root / "stability.log"
    if not (base / "config.json").is_file():
        if base.exists():
            shutil.rmtree(base)  # an interrupted warm start of this experiment (no config.json yet)
        print(f"stability: warm start -> {base}", flush=True)
        if _rz(["make-model", recipe, *ov, "--out", str(base)], log) != 0:
            print(f"stability: warm start failed, see {log}", flush=True)
            return 1
    t0 = time.time()
    while time.time() - t0 < budget_s:
        todo = [(m, lag) for m, lag in legs if _updates(root / f"{m}_lag{lag}") < steps]
        if not todo:
            break
        for mode, lag in todo:
            left = budget_s - (time.time() - t0)
            if left < 60:
                break
            rd = root / f"{mode}_lag{lag}"
            if not (rd / "base_model").exists():
                rd.mkdir(parents=True, exist_ok=True)
                shutil.copytree(base, rd / "base_model")
            before = _updates(rd)
            t = time.time()
            rc = _rz(["train", recipe, f"mode={mode}", f"schedule.max_lag={lag}", f"schedule.steps={steps}",
                      f"schedule.time_limit_s={min(slice_s, left - 30):.0f}", "checkpoint.load=latest",
                      f"logging.run_dir={rd}", *ov, *(fast_only if mode == "fast" else [])], log)
            print(f"stability: {mode} lag {lag}: updates {before} -> {_updates(rd)} in {time.time() - t:.0f} s "
                  f"(exit {rc})", flush=True)
            if rc != 0:
                print(f"stability: {mode} lag {lag} failed; see {log}", flush=True)
                return rc
    done = ", ".join(f"{m}:{lag} {_updates(root / (m + '_lag' + str(lag)))}" for m, lag in legs)
    print(f"stability: {done} updates; continue with the same command", flush=True)
    return 0


def _median(xs):
    ys = sorted(x for x in xs if isinstance(x, (int, float)))
    if not ys:
        return None
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def leg_figures(run_dir: Path, limit: int | None = None) -> dict:
    """The leg's figures over its first ``limit`` updates (all by default)."""
    from megatron_rz.loop.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    tr = [r for r in rows if "max_abs_dlogp" in r][:limit]
    last = tr[-1]["step"] if tr else 0
    ev = [r for r in rows if isinstance(r.get("eval_reward"), (int, float)) and r["step"] <= last]
    if not tr:
        return {"updates": 0}
    tenth = max(1, len(tr) // 10)
    d3 = [r["d3"] for r in tr]
    med = _median(d3)
    out = {
        "updates": len(tr),
        "d3_peak": max(d3), "d3_median": med,
        "d3_peak_over_median": (max(d3) / med) if med else None,
        "d3_median_first_10pct": _median(d3[:tenth]), "d3_median_last_10pct": _median(d3[-tenth:]),
        "kl_k1_median_first_10pct": _median([r.get("kl_k1") for r in tr[:tenth]]),
        "kl_k1_median_last_10pct": _median([r.get("kl_k1") for r in tr[-tenth:]]),
        "grad_norm_max": max((r["grad_norm"] for r in tr if isinstance(r.get("grad_norm"), (int, float))), default=None),
        "is_weight_max": max((r["is_w_max"] for r in tr if isinstance(r.get("is_w_max"), (int, float))), default=None),
        "frac_bitwise_mean": sum(r.get("frac_bitwise", 0.0) for r in tr) / len(tr),
        "reward_first_10pct": sum(r["reward_mean"] for r in tr[:tenth]) / tenth,
        "reward_last_10pct": sum(r["reward_mean"] for r in tr[-tenth:]) / tenth,
        "eval_first": ev[0]["eval_reward"] if ev else None, "eval_last": ev[-1]["eval_reward"] if ev else None,
        "eval_last_step": ev[-1]["step"] if ev else None,
    }
    if out["d3_median_first_10pct"]:
        out["d3_median_growth"] = out["d3_median_last_10pct"] / out["d3_median_first_10pct"]
    if len(tr) >= 2000:
        out["d3_median_first_1000"] = _median(d3[:1000])
        out["d3_median_last_1000"] = _median(d3[-1000:])
        out["d3_median_growth_1000"] = out["d3_median_last_1000"] / out["d3_median_first_1000"]
    return out


def report(root: Path, out: Path) -> dict:
    from megatron_rz.loop.metrics import plot_compare

    legs = sorted(d for d in root.iterdir() if d.is_dir() and (d / "metrics.jsonl").is_file()
                  and d.name.startswith(("aligned_lag", "fast_lag")))
    if not legs:
        raise SystemExit(f"stability: no legs with metrics under {root}")
    meta = json.loads((root / "experiment.json").read_text()) if (root / "experiment.json").is_file() else {}
    if out.exists() and any(out.iterdir()):
        rep = out / "report.json"
        if not rep.is_file() or json.loads(rep.read_text()).get("experiment") != meta:
            raise SystemExit(f"stability: --out {out} holds other files or another experiment's report; give a new "
                             "directory")
    out.mkdir(parents=True, exist_ok=True)
    res = {"experiment": meta, "legs": {d.name: leg_figures(d) for d in legs}, "lags": {}}
    lags = sorted({int(d.name.split("lag")[1]) for d in legs})
    lines = ["# Stability experiment", "", f"recipe `{meta.get('recipe')}`, overrides `{' '.join(meta.get('overrides', []))}`, "
             f"fast legs also `{' '.join(meta.get('fast_overrides', []))}`", "",
             "| leg | updates | D3 peak / median | D3 median first -> last 10% | KL k1 median first -> last 10% | "
             "max grad norm | max IS weight | bitwise | reward first -> last 10% | eval first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, p=3):
        return "-" if x is None else (f"{x:.{p}g}" if isinstance(x, float) else str(x))

    for name, r in res["legs"].items():
        if not r.get("updates"):
            continue
        lines.append(f"| {name} | {r['updates']} | {f(r['d3_peak_over_median'])} | {f(r['d3_median_first_10pct'])} -> "
                     f"{f(r['d3_median_last_10pct'])} | {f(r['kl_k1_median_first_10pct'])} -> {f(r['kl_k1_median_last_10pct'])} | "
                     f"{f(r['grad_norm_max'])} | {f(r['is_weight_max'])} | {f(r['frac_bitwise_mean'])} | "
                     f"{f(r['reward_first_10pct'])} -> {f(r['reward_last_10pct'])} | {f(r['eval_first'])} -> {f(r['eval_last'])} |")
    for lag in lags:
        a, fa = res["legs"].get(f"aligned_lag{lag}", {}), res["legs"].get(f"fast_lag{lag}", {})
        both = [d for d in legs if d.name in (f"aligned_lag{lag}", f"fast_lag{lag}")]
        plot_compare(both, out / f"plots_lag{lag}", labels=[d.name for d in both])
        if a.get("updates") and fa.get("updates"):
            # side by side over the updates both legs have: the same prefix of the same schedule
            n = min(a["updates"], fa["updates"])
            a_n = leg_figures(root / f"aligned_lag{lag}", n)
            f_n = leg_figures(root / f"fast_lag{lag}", n)
            ratio = {k: (f_n[k] / a_n[k]) if isinstance(a_n.get(k), float) and a_n[k] and isinstance(f_n.get(k), float)
                     else None for k in ("d3_peak_over_median", "d3_median", "grad_norm_max", "is_weight_max")}
            res["lags"][str(lag)] = {"updates_compared": n, "aligned": a_n, "fast": f_n,
                                     **{f"fast_over_aligned_{k}": v for k, v in ratio.items()}}
            lines.append(f"| lag {lag}, first {n} updates: fast / aligned | D3 peak/median {f(ratio['d3_peak_over_median'])}, "
                         f"D3 median {f(ratio['d3_median'])}, max grad norm {f(ratio['grad_norm_max'])}, "
                         f"max IS weight {f(ratio['is_weight_max'])} |")
    lines += ["", "Overlay plots per lag: `plots_lag<L>/` (rz plot's comparison figures).", ""]
    (out / "report.json").write_text(json.dumps(res, indent=1))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", required=True)
    r.add_argument("--recipe", default="recipes/tiny_moe.yaml")
    r.add_argument("--legs", default="aligned:2,fast:2,aligned:8,fast:8")
    r.add_argument("--bf16", choices=sorted(BF16), default="rollout")
    r.add_argument("--steps", type=int, default=5000)
    r.add_argument("--slice-s", type=float, default=600)
    r.add_argument("--budget-s", type=float, default=3600)
    r.add_argument("overrides", nargs="*")
    p = sub.add_parser("report")
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        return run(Path(a.root), a.recipe, _legs(a.legs), a.steps, a.slice_s, a.budget_s, a.overrides, a.bf16)
    report(Path(a.root), Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
