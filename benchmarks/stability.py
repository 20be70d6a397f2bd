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
checkpoints). ``--legs`` may name only some legs (e.g. the ones behind); the experiment keeps them
all. Stop it with SIGTERM (or Ctrl-C): the running leg checkpoints after its update and exits
before the runner does.

``report`` reads the legs' metrics and writes ``report.json`` / ``report.md`` and overlay plots per
lag into ``--out`` (a new directory, or one written by an earlier report of the same legs): per leg
the updates, the running D3 peak / median, D3 (= KL k3) and KL k1 medians over the first and the
last 10% of updates (and the first / last 1,000 when there are 2,000 or more), the largest gradient
norm before clipping and IS weight, reward and held-out evaluation first vs last; per lag the fast /
aligned ratios of those figures.

    python benchmarks/stability.py seeds --roots DIR_SEED0 DIR_SEED1 [...] --out benchmarks/results/<new dir>

``seeds`` sets the same experiment run from several seeds (one root each) side by side: per leg, each
seed's KL k1 growth (last / first 10%), D3 peak / median, max IS weight, max grad norm and held-out gain
over the updates every seed and mode of that lag has, their min / median / max, and per lag fast / aligned of each figure per
seed with the count of seeds where fast is above aligned (``seeds.json`` / ``seeds.md``).

    python benchmarks/stability.py sweep --root DIR --out benchmarks/results/stability_lr_sweep_cpu
        [--lrs 5e-5,1e-4,2e-4,4e-4,8e-4] [--lag 8] [--steps 200] [--budget-s 3600] [recipe overrides ...]

``sweep`` chooses the step size for the long runs: aligned at lag ``--lag`` from the same base model
(``DIR/base_model``, made as ``run`` makes it, so a sweep may share ``run``'s root), one run per lr
(``DIR/sweep_aligned_lag<L>_lr<LR>``), one after another, ``--steps`` updates each, resumable like
``run``; then ``report.json`` / ``report.md``, the lrs' metrics (gzipped) and overlay plots into
``--out``. An lr is stable when its run did every update (none skipped, every loss and gradient norm
finite), the KL k1 median of the last 10% of updates is at most 2x that of the first 10%, the mean train
reward of the last 10% is at least that of the first 10% - 0.05, and the final held-out reward at least
the one before training - 0.05 (``sweep_verdict``); the report's chosen lr is the largest stable one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# a step size untruncated IS survives at lag 8 on this task (500 CPU updates at lag 8 and lr 1e-4 were
# stable in fp32), checkpoints often enough for short slices, sparse evaluation
DEFAULTS = ["algo.lr=1e-4", "rollout.prompts_per_step=8", "checkpoint.every=25", "schedule.eval_every=100",
            "logging.wandb=false"]
# Bookkeeping of every leg's rz train, not part of the experiment (experiment.json): keep each leg's
# newest checkpoints only (a tiny_moe checkpoint is 11 MB; one every 25 updates filled 1.2 GB per leg
# by update 3,000, and would fill ~9 GB per leg by 20,000).
LEG_BOOKKEEPING = ["checkpoint.keep=3"]


def effective(overrides: list[str]) -> list[str]:
    """The overrides as the recipe applies them: a key given twice keeps its last value (the run's
    own ``algo.lr=5e-5`` after DEFAULTS' ``algo.lr=1e-4``), in first-given order."""
    last = {}
    for o in overrides:
        last[o.split("=", 1)[0]] = o
    return list(last.values())


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


# Not for a fast leg: stock vLLM-CPU's bf16 GEMM packs its weights for torch's brgemm, which needs
# oneDNN's AMX code paths, and ONEDNN_MAX_CPU_ISA=AVX2 takes them away: the worker aborts on its first
# forward ("BFloat16 Brgemm VNNI format is only supported ... when ... amx is supported"; measured on
# this project's CPU box, every fast bf16 leg). The aligned legs never reach oneDNN's GEMMs (kernels/).
FAST_LEG_UNSET = ("ONEDNN_MAX_CPU_ISA",)


_child: "subprocess.Popen | None" = None  # the leg's `rz` process while one runs
_stopping: "int | None" = None  # the signal that asked the runner to stop


def _stop(signum, frame) -> None:
    """SIGTERM / SIGINT / SIGHUP to the runner: pass SIGTERM on to the leg's `rz train` (it
    checkpoints after the update it is on and exits: megatron_rz.launch.preemption; a second signal
    here passes a second SIGTERM, which stops it at once); :func:`_run_leg` then sees it exit and
    the runner stops. Between legs the runner stops at once. Without this the leg outlived its
    runner and kept the run directory's lock. (The handler only signals: the main thread is inside
    the child's wait(), which must be the one to reap it.)"""
    global _stopping
    first = _stopping is None
    _stopping = signum
    if _child is None or _child.returncode is not None:
        raise SystemExit(128 + signum)
    if first:
        print(f"stability: signal {signum}: stopping the running leg (it checkpoints first)", flush=True)
    _child.send_signal(signal.SIGTERM)


def _run_leg(cmd: list[str], env: dict, out) -> int:
    """Run one leg's command to its end; if the runner was asked to stop meanwhile, stop too."""
    global _child
    _child = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        rc = _child.wait()
    finally:
        _child = None
    if _stopping is not None:
        raise SystemExit(128 + _stopping)
    return rc


def _rz(args: list[str], log: Path, mode: str = "aligned") -> int:
    env = {**os.environ, **CPU_ENV}
    if mode == "fast":
        for k in FAST_LEG_UNSET:
            env.pop(k, None)
    with open(log, "a") as fh:
        fh.write(f"\n$ rz {' '.join(args)}\n")
        fh.flush()
        return _run_leg([sys.executable, "-m", "megatron_rz.cli", *args], env, fh)


def _base_model(root: Path, recipe: str, ov: list[str], log: Path) -> bool:
    """``root/base_model``: the warm start of the recipe with the overrides, made once per root."""
    base = root / "base_model"
    if not (base / "config.json").is_file():
        if base.exists():
            shutil.rmtree(base)  # an interrupted warm start of this experiment (no config.json yet)
        print(f"stability: warm start -> {base}", flush=True)
        if _rz(["make-model", recipe, *ov, "--out", str(base)], log) != 0:
            print(f"stability: warm start failed, see {log}", flush=True)
            return False
    return True


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
        # an invocation may advance only some legs (e.g. the ones behind): the experiment keeps all of them
        meta["legs"] = list(dict.fromkeys(list(old.get("legs", [])) + meta["legs"]))
    mf.write_text(json.dumps(meta, indent=1))
    base = root / "base_model"
    log = root / "stability.log"
    if not _base_model(root, recipe, ov, log):
        return 1
    t0 = time.time()
    failed: list[tuple[str, int]] = []  # legs that failed in this invocation: the others go on
    while time.time() - t0 < budget_s:
        todo = [(m, lag) for m, lag in legs if _updates(root / f"{m}_lag{lag}") < steps and (m, lag) not in failed]
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
                      f"logging.run_dir={rd}", *ov, *(fast_only if mode == "fast" else []), *LEG_BOOKKEEPING],
                     log, mode)
            print(f"stability: {mode} lag {lag}: updates {before} -> {_updates(rd)} in {time.time() - t:.0f} s "
                  f"(exit {rc})", flush=True)
            if rc != 0:
                print(f"stability: {mode} lag {lag} failed; see {log} (the other legs go on)", flush=True)
                failed.append((mode, lag))
    done = ", ".join(f"{m}:{lag} {_updates(root / (m + '_lag' + str(lag)))}" for m, lag in legs)
    print(f"stability: {done} updates; continue with the same command", flush=True)
    if failed:
        print(f"stability: failed in this run: {', '.join(f'{m}:{lag}' for m, lag in failed)}", flush=True)
        return 1
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
        # the KL's course, not only its ends: the median of each tenth of the updates (the last tenth
        # takes the remainder), and the policy's entropy at both ends (a sharper policy moves each
        # token's logprob more per update, so the weight-lag part of the KL grows as entropy falls)
        "kl_k1_median_by_tenth": [_median([r.get("kl_k1") for r in tr[i * tenth:(i + 1) * tenth if i < 9 else None]])
                                  for i in range(10)] if len(tr) >= 10 else None,
        "entropy_first_10pct": _median([r.get("entropy_est") for r in tr[:tenth]]),
        "entropy_last_10pct": _median([r.get("entropy_est") for r in tr[-tenth:]]),
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
    lines = ["# Stability experiment", "", f"recipe `{meta.get('recipe')}`, overrides `{' '.join(effective(meta.get('overrides', [])))}`, "
             f"fast legs also `{' '.join(meta.get('fast_overrides', []))}`", "",
             "| leg | updates | D3 peak / median | D3 median first -> last 10% | KL k1 median first -> last 10% | "
             "entropy first -> last 10% | max grad norm | max IS weight | bitwise | reward first -> last 10% | "
             "eval first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, p=3):
        return "-" if x is None else (f"{x:.{p}g}" if isinstance(x, float) else str(x))

    for name, r in res["legs"].items():
        if not r.get("updates"):
            continue
        lines.append(f"| {name} | {r['updates']} | {f(r['d3_peak_over_median'])} | {f(r['d3_median_first_10pct'])} -> "
                     f"{f(r['d3_median_last_10pct'])} | {f(r['kl_k1_median_first_10pct'])} -> {f(r['kl_k1_median_last_10pct'])} | "
                     f"{f(r.get('entropy_first_10pct'))} -> {f(r.get('entropy_last_10pct'))} | "
                     f"{f(r['grad_norm_max'])} | {f(r['is_weight_max'])} | {f(r['frac_bitwise_mean'])} | "
                     f"{f(r['reward_first_10pct'])} -> {f(r['reward_last_10pct'])} | {f(r['eval_first'])} -> {f(r['eval_last'])} |")
    tenths = [(n, r["kl_k1_median_by_tenth"]) for n, r in res["legs"].items() if r.get("kl_k1_median_by_tenth")]
    if tenths:
        lines += ["", "KL k1 median in each tenth of the leg's updates:", "",
                  "| leg | " + " | ".join(str(i + 1) for i in range(10)) + " |", "|---|" + "---|" * 10]
        lines += [f"| {n} | " + " | ".join(f(x) for x in by) + " |" for n, by in tenths]
        lines.append("")
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


# ------------------------------------------------------------------ several seeds of one experiment
SEED_FIGURES = (("kl_growth", "KL k1 last / first 10%"), ("d3_peak_over_median", "D3 peak / median"),
                ("is_weight_max", "max IS weight"), ("grad_norm_max", "max grad norm"), ("eval_gain", "held-out gain"))


def _seed_row(fig: dict) -> dict:
    first, last = fig.get("kl_k1_median_first_10pct"), fig.get("kl_k1_median_last_10pct")
    ev0, ev1 = fig.get("eval_first"), fig.get("eval_last")
    return {"updates": fig.get("updates", 0),
            "kl_growth": (last / first) if isinstance(first, (int, float)) and first and isinstance(last, (int, float)) else None,
            "d3_peak_over_median": fig.get("d3_peak_over_median"), "is_weight_max": fig.get("is_weight_max"),
            "grad_norm_max": fig.get("grad_norm_max"),
            "eval_gain": (ev1 - ev0) if isinstance(ev0, (int, float)) and isinstance(ev1, (int, float)) else None}


def seeds_report(roots: list[Path], out: Path) -> dict:
    """One experiment run from several seeds (one ``run`` root each, e.g. ``schedule.seed=1``): per leg
    present in every root, each seed's figures over the same number of updates (the fewest any seed
    or mode of that lag has, so every seed and both modes get the same budget), then their min / median / max; per lag and seed, fast /
    aligned of each figure, and how many seeds have fast above aligned. Writes ``seeds.json`` and
    ``seeds.md`` into ``out`` (a new directory, or one holding a seeds report of the same roots)."""
    names = [d.name for d in roots]
    if len(set(names)) != len(names) or len(roots) < 2:
        raise SystemExit("stability: seeds needs two or more --roots with distinct directory names")
    legs_of = {}
    for r in roots:
        if not r.is_dir():
            raise SystemExit(f"stability: --roots {r} is not a directory")
        legs_of[r.name] = {d.name for d in r.iterdir() if d.is_dir() and (d / "metrics.jsonl").is_file()
                           and d.name.startswith(("aligned_lag", "fast_lag"))}
    common = sorted(set.intersection(*legs_of.values()))
    if not common:
        raise SystemExit(f"stability: no leg is in every root ({', '.join(names)})")
    if out.exists() and any(out.iterdir()):
        rep = out / "seeds.json"
        if not rep.is_file() or json.loads(rep.read_text()).get("roots") != names:
            raise SystemExit(f"stability: --out {out} holds other files or a report of other roots; give a new directory")
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"roots": names, "legs": {}, "lags": {}}
    lag_of = {leg: int(leg.split("lag")[1]) for leg in common}
    budget = {lag: min(_updates(r / leg) for r in roots for leg in common if lag_of[leg] == lag)
              for lag in set(lag_of.values())}
    for leg in common:
        n = budget[lag_of[leg]]  # both modes of a lag, every seed: the same number of updates
        per = {r.name: _seed_row(leg_figures(r / leg, n)) for r in roots}
        summary = {}
        for key, _ in SEED_FIGURES:
            xs = sorted(v[key] for v in per.values() if isinstance(v[key], (int, float)))
            summary[key] = {"min": xs[0], "median": _median(xs), "max": xs[-1]} if xs else None
        res["legs"][leg] = {"updates_each": n, "seeds": per, "summary": summary}
    for lag in sorted({int(x.split("lag")[1]) for x in common}):
        a, f = res["legs"].get(f"aligned_lag{lag}"), res["legs"].get(f"fast_lag{lag}")
        if not (a and f):
            continue
        ratios = {}
        for key, _ in SEED_FIGURES[:4]:
            rs = {s: (f["seeds"][s][key] / a["seeds"][s][key])
                  if isinstance(a["seeds"][s][key], (int, float)) and a["seeds"][s][key]
                  and isinstance(f["seeds"][s][key], (int, float)) else None for s in names}
            ratios[key] = {"per_seed": rs, "fast_above": sum(1 for x in rs.values() if x is not None and x > 1),
                           "seeds": sum(1 for x in rs.values() if x is not None)}
        res["lags"][str(lag)] = ratios

    def g(x):
        return "-" if x is None else f"{x:.3g}"

    lines = ["# Stability over seeds", "", f"roots: {', '.join(f'`{x}`' for x in names)}; every leg of a lag compared over "
             "the updates every seed and mode of that lag has", ""]
    for leg, r in res["legs"].items():
        lines += [f"## {leg} ({r['updates_each']} updates each)", "",
                  "| seed | " + " | ".join(t for _, t in SEED_FIGURES) + " |", "|---|" + "---|" * len(SEED_FIGURES)]
        lines += [f"| {s} | " + " | ".join(g(v[k]) for k, _ in SEED_FIGURES) + " |" for s, v in r["seeds"].items()]
        lines.append("| min / median / max | " + " | ".join(
            "-" if r["summary"][k] is None else f"{g(r['summary'][k]['min'])} / {g(r['summary'][k]['median'])} / "
            f"{g(r['summary'][k]['max'])}" for k, _ in SEED_FIGURES) + " |")
        lines.append("")
    for lag, ratios in res["lags"].items():
        lines += [f"## lag {lag}: fast / aligned per seed", "", "| figure | " + " | ".join(names) + " | fast above aligned |",
                  "|---|" + "---|" * (len(names) + 1)]
        lines += [f"| {t} | " + " | ".join(g(ratios[k]["per_seed"][s]) for s in names)
                  + f" | {ratios[k]['fast_above']} of {ratios[k]['seeds']} |" for k, t in SEED_FIGURES[:4]]
        lines.append("")
    (out / "seeds.json").write_text(json.dumps(res, indent=1))
    (out / "seeds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return res


# ------------------------------------------------------------------ the lr sweep (issue 35)
# aligned at lag 8 from the run's base model, one run per lr; the long runs then use the largest stable one
SWEEP_LRS = "5e-5,1e-4,2e-4,4e-4,8e-4"
SWEEP_KEYS = ("recipe", "overrides", "bf16", "mode", "lag", "steps")  # what makes two sweeps the same sweep
# an lr is stable when its run did every update and all of these hold (sweep_verdict)
KL_GROWTH_MAX = 2.0  # KL k1 median, last 10% of updates / first 10%
REWARD_DROP_MAX = 0.05  # train reward and held-out reward may fall by at most this much


def _lrs(spec: str) -> list[float]:
    try:
        lrs = sorted({float(x) for x in spec.split(",")})
    except ValueError:
        raise SystemExit(f"stability: --lrs {spec!r}: expected numbers separated by commas, e.g. {SWEEP_LRS}") from None
    if not lrs or lrs[0] <= 0:
        raise SystemExit(f"stability: --lrs {spec!r}: every lr must be > 0")
    return lrs


def _lr_dir(root: Path, meta: dict, lr: float) -> Path:
    # not <mode>_lag<L>: a sweep may share its --root (and base model) with `run`'s legs
    return root / f"sweep_{meta['mode']}_lag{meta['lag']}_lr{lr:g}"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sweep_verdict(run_dir: Path, steps: int) -> dict:
    """One lr's figures over its first ``steps`` updates and whether it stayed stable: every update done
    (none skipped, no non-finite loss or gradient norm), KL k1 median last 10% / first 10% <=
    KL_GROWTH_MAX, train reward (mean over the last 10% of updates) >= that of the first 10% - REWARD_DROP_MAX,
    final held-out reward >= the one before training - REWARD_DROP_MAX."""
    from megatron_rz.loop.metrics import read_metrics

    f = run_dir / "metrics.jsonl"
    tr = [r for r in read_metrics(f) if "max_abs_dlogp" in r][:steps] if f.is_file() else []
    out = leg_figures(run_dir, steps) if tr else {"updates": 0}
    ex = run_dir / "sweep_exit.json"
    out["exit"] = json.loads(ex.read_text()) if ex.is_file() else None
    out["nonfinite_updates"] = sum(1 for r in tr if not (_finite(r.get("loss")) and _finite(r.get("grad_norm")))
                                   or r.get("update_skipped") or r.get("update_successful") is False)
    k1a, k1b = out.get("kl_k1_median_first_10pct"), out.get("kl_k1_median_last_10pct")
    out["kl_k1_growth"] = k1b / k1a if _finite(k1a) and k1a > 0 and _finite(k1b) else None
    if not tr:
        checks = {"finished": False}
    else:
        checks = {
            "finished": len(tr) >= steps,
            "finite": out["nonfinite_updates"] == 0,
            "kl_k1_growth": out["kl_k1_growth"] is not None and out["kl_k1_growth"] <= KL_GROWTH_MAX,
            "reward": out["reward_last_10pct"] >= out["reward_first_10pct"] - REWARD_DROP_MAX,
            "held_out": _finite(out["eval_first"]) and _finite(out["eval_last"])
            and out["eval_last"] >= out["eval_first"] - REWARD_DROP_MAX,
        }
    out["checks"] = checks
    out["stable"] = all(checks.values())
    if out["stable"]:
        out["status"] = "stable"
    elif not checks["finished"] and out["exit"] is None:
        out["status"] = "incomplete"  # not run to the end yet: continue the sweep
    else:
        out["status"] = "unstable: " + ", ".join(k for k, ok in checks.items() if not ok)
    return out


def sweep_report(root: Path, out: Path, plots: bool = True) -> dict:
    """The sweep's report.json / report.md, the lrs' metrics (gzipped) and overlay plots into ``out``."""
    import gzip

    from megatron_rz.loop.metrics import plot_compare

    meta = json.loads((root / "sweep.json").read_text())
    _check_sweep_out(out, root, meta)
    out.mkdir(parents=True, exist_ok=True)
    steps = meta["steps"]
    runs = {lr: sweep_verdict(_lr_dir(root, meta, lr), steps) for lr in meta["lrs"]}
    stable = [lr for lr, r in runs.items() if r["stable"]]
    chosen = max(stable) if stable else None
    pending = [lr for lr, r in runs.items() if r["status"] == "incomplete" and (chosen is None or lr > chosen)]
    res = {"sweep": meta,
           "criterion": {"kl_k1_growth_max": KL_GROWTH_MAX, "reward_drop_max": REWARD_DROP_MAX, "updates": steps},
           "lrs": {f"{lr:g}": r for lr, r in runs.items()},
           "chosen_lr": chosen, "provisional": bool(pending),
           # a smaller lr that was not stable below the chosen one: the sweep is not monotone
           "unstable_below_chosen": [lr for lr in runs if chosen is not None and lr < chosen and not runs[lr]["stable"]]}

    def f(x, p=3):
        return "-" if x is None else (f"{x:.{p}g}" if isinstance(x, float) else str(x))

    lines = ["# Learning-rate sweep: aligned, lag " + str(meta["lag"]), "",
             f"recipe `{meta.get('recipe')}`, overrides `{' '.join(effective(meta.get('overrides', [])))}`, then `algo.lr=LR`; "
             f"{steps} updates per lr, mode {meta['mode']}, schedule.max_lag={meta['lag']}, from one base model.", "",
             f"Stable = all {steps} updates done with none skipped and every loss and gradient norm finite, KL k1 "
             f"median over the last 10% of updates <= {KL_GROWTH_MAX:g} x that of the first 10%, mean train reward "
             f"over the last 10% >= that of the first 10% - {REWARD_DROP_MAX:g}, and the final held-out greedy reward "
             f">= the one before training - {REWARD_DROP_MAX:g}.", "",
             "| lr | updates | verdict | KL k1 median first -> last 10% (ratio) | D3 peak / median | max grad norm | "
             "max IS weight | reward first -> last 10% | held-out first -> last |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lr, r in runs.items():
        lines.append(f"| {lr:g} | {r['updates']} | {r['status']} | {f(r.get('kl_k1_median_first_10pct'))} -> "
                     f"{f(r.get('kl_k1_median_last_10pct'))} ({f(r['kl_k1_growth'])}) | {f(r.get('d3_peak_over_median'))} | "
                     f"{f(r.get('grad_norm_max'))} | {f(r.get('is_weight_max'))} | {f(r.get('reward_first_10pct'))} -> "
                     f"{f(r.get('reward_last_10pct'))} | {f(r.get('eval_first'))} -> {f(r.get('eval_last'))} |")
    lines += ["", f"**Chosen lr: {f(chosen)}** (the largest stable one"
              + ("; provisional: larger lrs still incomplete " + ", ".join(f"{x:g}" for x in pending) if pending else "")
              + ("; not monotone: unstable below it " + ", ".join(f"{x:g}" for x in res["unstable_below_chosen"])
                 if res["unstable_below_chosen"] else "") + ").", "",
              "Overlay plots (reward, KL k1, D3, D3 peak / median per lr): `plots/`; metrics: `lr<LR>.metrics.jsonl.gz`.", ""]
    dirs = [_lr_dir(root, meta, lr) for lr in runs if runs[lr]["updates"]]
    for d, lr in zip(dirs, [lr for lr in runs if runs[lr]["updates"]]):
        with open(d / "metrics.jsonl", "rb") as src, gzip.GzipFile(out / f"lr{lr:g}.metrics.jsonl.gz", "wb", mtime=0) as dst:
            shutil.copyfileobj(src, dst)
    if dirs and plots:
        plot_compare(dirs, out / "plots", labels=[f"lr {lr:g}" for lr in runs if runs[lr]["updates"]])
    (out / "report.json").write_text(json.dumps(res, indent=1))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return res


def _check_sweep_out(out: Path, root: Path, meta: dict) -> None:
    """Refuse an ``--out`` that holds other files or another sweep's (or experiment's) report."""
    if out.exists() and any(out.iterdir()):
        rep = out / "report.json"
        old = json.loads(rep.read_text()) if rep.is_file() else {}
        # the sweep's id (made with its sweep.json), not its root's path: a report names no machine path
        if {k: old.get("sweep", {}).get(k) for k in (*SWEEP_KEYS, "id")} != {k: meta.get(k) for k in (*SWEEP_KEYS, "id")}:
            raise SystemExit(f"stability: --out {out} holds other files or another experiment's report; give a new "
                             "directory")


def sweep(root: Path, out: Path, recipe: str, lrs: list[float], steps: int, lag: int, budget_s: float,
          overrides: list[str], bf16: str = "rollout") -> int:
    """Aligned lag-``lag`` runs from ``root/base_model``, one per lr, ``steps`` updates each, one at a time;
    then the report into ``out``. Run it again to continue (or to add lrs): finished runs are kept."""
    root.mkdir(parents=True, exist_ok=True)
    common, _ = BF16[bf16]
    ov = DEFAULTS + common + list(overrides)
    meta = {"recipe": recipe, "overrides": ov, "bf16": bf16, "mode": "aligned", "lag": lag, "steps": steps}
    mf = root / "sweep.json"
    if mf.is_file():  # a continued sweep must be the same sweep
        old = json.loads(mf.read_text())
        if {k: old.get(k) for k in SWEEP_KEYS} != meta:
            raise SystemExit(f"stability: {root} holds a sweep with {({k: old.get(k) for k in SWEEP_KEYS})}; continue "
                             "it with the same recipe/overrides/--steps/--lag or give another --root")
        lrs = sorted(set(old["lrs"]) | set(lrs))
        sweep_id = old.get("id")
    else:
        sweep_id = uuid.uuid4().hex
    ef = root / "experiment.json"  # `run`'s legs in the same root: the base model must be theirs
    if ef.is_file():
        old = json.loads(ef.read_text())
        if (old.get("recipe"), old.get("overrides")) != (recipe, ov):
            raise SystemExit(f"stability: {root}/base_model belongs to an experiment with recipe/overrides "
                             f"{old.get('recipe')} {old.get('overrides')}; use the same ones or another --root")
    meta["lrs"], meta["id"] = lrs, sweep_id
    _check_sweep_out(out, root, meta)  # before any run starts
    mf.write_text(json.dumps(meta, indent=1))
    log = root / "stability.log"
    if not _base_model(root, recipe, ov, log):
        return 1
    t0 = time.time()
    for lr in lrs:
        rd = _lr_dir(root, meta, lr)
        if _updates(rd) >= steps:
            continue
        if (rd / "sweep_exit.json").is_file():
            print(f"stability: lr {lr:g} stopped earlier ({(rd / 'sweep_exit.json').read_text().strip()}); delete "
                  f"{rd / 'sweep_exit.json'} to try it again", flush=True)
            continue
        left = budget_s - (time.time() - t0)
        if left < 60:
            print("stability: --budget-s spent; continue with the same command", flush=True)
            break
        if not (rd / "base_model").exists():
            rd.mkdir(parents=True, exist_ok=True)
            shutil.copytree(root / "base_model", rd / "base_model")
        before, t = _updates(rd), time.time()
        rc = _rz(["train", recipe, "mode=aligned", f"schedule.max_lag={lag}", f"schedule.steps={steps}",
                  f"schedule.time_limit_s={left - 30:.0f}", "checkpoint.load=latest", f"logging.run_dir={rd}", *ov,
                  f"algo.lr={lr:g}"], log)
        print(f"stability: sweep lr {lr:g}: updates {before} -> {_updates(rd)} in {time.time() - t:.0f} s (exit {rc})",
              flush=True)
        if rc != 0:  # e.g. stopped after algo.max_bad_updates non-finite updates: this lr is not stable
            (rd / "sweep_exit.json").write_text(json.dumps({"rc": rc, "updates": _updates(rd)}) + "\n")
            print(f"stability: sweep lr {lr:g} failed; see {log}", flush=True)
    sweep_report(root, out)
    return 0


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
    e = sub.add_parser("seeds")
    e.add_argument("--roots", nargs="+", required=True)
    e.add_argument("--out", required=True)
    w = sub.add_parser("sweep")
    w.add_argument("--root", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--recipe", default="recipes/tiny_moe.yaml")
    w.add_argument("--lrs", default=SWEEP_LRS)
    w.add_argument("--lag", type=int, default=8)
    w.add_argument("--bf16", choices=sorted(BF16), default="rollout")
    w.add_argument("--steps", type=int, default=200)
    w.add_argument("--budget-s", type=float, default=3600)
    w.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    if a.cmd in ("sweep", "run"):  # a stopped runner stops its running leg too
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _stop)
    if a.cmd == "sweep":
        return sweep(Path(a.root), Path(a.out), a.recipe, _lrs(a.lrs), a.steps, a.lag, a.budget_s, a.overrides, a.bf16)
    if a.cmd == "run":
        return run(Path(a.root), a.recipe, _legs(a.legs), a.steps, a.slice_s, a.budget_s, a.overrides, a.bf16)
    if a.cmd == "seeds":
        seeds_report([Path(x) for x in a.roots], Path(a.out))
        return 0
    report(Path(a.root), Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
