"""Metrics: one JSON line per update, wandb (offline by default) and PNG plots of the run."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from megatron_rz.recipe import Recipe

PLOTS = {
    "reward.png": [("reward_mean", "train reward (mean)"), ("eval_reward", "held-out reward (greedy)")],
    "kl.png": [("kl_k1", "KL k1 (rollout || learner)"), ("d3", "D3 = mean(w - 1 - log w)")],
    "mismatch.png": [("max_abs_dlogp", "max |dlogp| rollout vs learner"), ("mean_abs_dlogp", "mean |dlogp|")],
    "step_time.png": [("time_rollout", "rollout"), ("time_learner", "learner"), ("time_sync", "weight sync")],
    "is_weight.png": [("is_w_max", "IS weight max"), ("is_w_mean", "IS weight mean"), ("ess", "ESS / N")],
    "grad_norm.png": [("grad_norm", "grad norm (before clipping)")],
    "lag.png": [("lag_mean", "policy lag mean (updates)"), ("lag_max", "policy lag max")],
    "entropy.png": [("entropy_est", "entropy (MC estimate, nats/token)"), ("response_len", "response length")],
}

# symlog linear range per plot: |dlogp| of stock fp32 kernels reaches 1e-13, so the mismatch plot
# resolves that far; KL k1 is a noisy estimator that goes negative, drawn linear below 1e-6.
LOG_SCALE = {"kl.png": 1e-6, "mismatch.png": 1e-16}

# Overlays for comparing runs (`rz plot RUN_A RUN_B ... --out DIR`): one line per run; the last
# field is the symlog linear range (None: a linear axis). D3 is exactly 0 where aligned; KL k1 is a
# noisy estimator that goes negative, drawn linear below 1e-6 (as in kl.png).
COMPARE = {
    "compare_d3.png": ("d3", "D3 = mean(w - 1 - log w) per update", 1e-12),
    "compare_d3_peak_over_median.png": ("d3_peak_over_median", "D3 running peak / median", None),
    "compare_reward.png": ("reward_mean", "train reward (mean)", None),
    "compare_kl.png": ("kl_k1", "KL k1 (rollout || learner)", 1e-6),
}
# A run of more updates than this is drawn as its per-update values, faint, under their running
# median over 1% of its updates (thousands of noisy points are otherwise one solid band).
SMOOTH_ABOVE = 400


def running_median(ys, window: int) -> list:
    """Centred running median of ``ys`` over ``window`` points (shorter at the ends)."""
    import numpy as np

    y = np.asarray(ys, dtype=float)
    h = max(0, int(window) // 2)
    if h == 0 or len(y) < 3:
        return y.tolist()
    pad = np.concatenate([np.full(h, np.nan), y, np.full(h, np.nan)])
    win = np.lib.stride_tricks.sliding_window_view(pad, 2 * h + 1)
    return np.nanmedian(win, axis=1).tolist()


class MetricsLogger:
    def __init__(self, recipe: Recipe, run_dir: Path, resume: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            # A fresh start over an earlier file (checkpoint.load=latest before any checkpoint; rz
            # train's run-dir check refuses the other cases): keep it beside, never delete it.
            aside = self.path.with_name(f"metrics.jsonl.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            self.path.rename(aside)
            print(f"[rz] starting over: the earlier {self.path.name} is kept as {aside.name}", flush=True)
        self.run = None
        if recipe.logging.wandb and recipe.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=recipe.logging.wandb_project,
                name=recipe.name,
                dir=str(run_dir),
                mode=recipe.logging.wandb_mode,
                config=recipe.model_dump(),
                resume="allow" if resume else None,
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def check_metrics_file(path: Path) -> None:
    """A RecipeError naming the file and line unless every line is a JSON object with a step."""
    from megatron_rz.recipe import RecipeError

    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path} cannot be read as text ({e}); is it a metrics.jsonl written by rz train?") from None
    rows = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecipeError(f"{path} line {n} is not JSON ({e.msg}): truncated or not written by rz train; "
                              "delete that line or pass another run dir") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise RecipeError(f"{path} line {n} is not a metrics row (a JSON object with an integer step)")
        rows += 1
    if not rows:
        raise RecipeError(f"{path} has no rows yet: nothing to plot")


def plot_run(run_dir: Path) -> list[Path]:
    """Write the PNG plots for a run directory from its metrics.jsonl. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    out = []
    for fname, series in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drew = False
        for key, label in series:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                if key == "eval_reward":  # evaluated at a few steps only: points, not a line between them
                    ax.plot(xs, ys, linestyle="none", marker="o", ms=6, label=label)
                else:
                    ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3, label=label)
                drew = True
        if not drew:
            plt.close(fig)
            continue
        if fname in LOG_SCALE:
            # Mismatch spans orders of magnitude and is exactly 0 when aligned: symlog shows both.
            ax.set_yscale("symlog", linthresh=LOG_SCALE[fname])
        ax.set_xlabel("update")
        ax.set_title(fname.removesuffix(".png").replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(run_dir) / "plots" / fname
        path.parent.mkdir(exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)
    out += plot_eval(run_dir, rows)
    return out


def eval_series(rows: list[dict]) -> dict[str, list[str]]:
    """Eval set name -> its metric names (greedy, avg@k, pass@1, pass@k) found in metrics rows."""
    sets: dict[str, list[str]] = {}
    for r in rows:
        for key in r:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and isinstance(r[key], (int, float)):
                names = sets.setdefault(parts[1], [])
                if parts[2] not in names:
                    names.append(parts[2])
    return sets


def eval_points(rows: list[dict], name: str, metric: str) -> list[tuple[int, float]]:
    """(update, value) of eval set ``name``'s ``metric`` at every evaluation, by update: the update
    count of the weights evaluated (an asynchronous run's periodic evaluations are logged with a later
    row and carry it as ``eval_version``; elsewhere the row's step is that count)."""
    key = f"eval/{name}/{metric}"
    return sorted((r.get("eval_version", r["step"]), r[key]) for r in rows if isinstance(r.get(key), (int, float)))


def plot_eval(run_dir: Path, rows: list[dict]) -> list[Path]:
    """One figure per eval set (plots/eval_<set>.png): greedy accuracy, avg@k, pass@1 and pass@k
    at every evaluation (megatron_rz.rl.evaluation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for name, metrics in eval_series(rows).items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for m in metrics:
            xs, ys = zip(*eval_points(rows, name, m))
            ax.plot(xs, ys, marker="o", ms=5, label=m)
        ax.set_xlabel("update")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"held-out set {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(run_dir) / "plots" / f"eval_{name}.png"
        path.parent.mkdir(exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)
    return out


def plot_compare(run_dirs: list[Path], out_dir: Path, labels: list[str] | None = None) -> list[Path]:
    """Overlay one metric of several runs per figure (e.g. D3 of aligned vs fast at lag 2 and 8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [Path(d).name for d in run_dirs]
    runs = [read_metrics(Path(d) / "metrics.jsonl") for d in run_dirs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, (key, title, linthresh) in COMPARE.items():
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        smoothed = False
        for i, (rows, label) in enumerate(zip(runs, labels)):
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if not pts:
                continue
            xs, ys = zip(*pts)
            color = f"C{i}"  # run i's colour in every figure, smoothed or not (explicit colours do not advance the cycle)
            if len(pts) > SMOOTH_ABOVE and key != "d3_peak_over_median":  # a running figure already
                ax.plot(xs, ys, lw=0.5, alpha=0.2, color=color)
                ax.plot(xs, running_median(ys, len(pts) // 100), lw=1.6, color=color, label=label)
                smoothed = True
            else:
                ax.plot(xs, ys, lw=1.2, color=color, label=label)
        if linthresh is not None:
            ax.set_yscale("symlog", linthresh=linthresh)
        if smoothed:
            title += " (bold: running median over 1% of updates)"
        ax.set_xlabel("update")
        ax.set_title(title, fontsize=9 if smoothed else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=100)
        plt.close(fig)
        written.append(out_dir / fname)
    return written


def run_summary(recipe: Recipe, run_dir: Path, start_step: int, eval_before, eval_after, times: dict,
                end_step: int | None = None, stopped_by: str | None = None, learner_spec: str | None = None) -> dict:
    """The end-of-run summary (both trainers) from the run's metrics.jsonl, written to summary.json.
    ``learner_spec``: the layers the learner was built from (aligned | te | local: Learner.spec).

    Stability figures of the paper: D3's running peak/median, KL (k1 and k3 = D3) averaged over the
    first and the last 10% of updates (growth = last / first), the largest gradient norm."""
    run_dir = Path(run_dir)
    tr = [r for r in read_metrics(run_dir / "metrics.jsonl") if "max_abs_dlogp" in r]
    n = max(1, len(tr))
    tenth = max(1, len(tr) // 10)

    def mean(key, rows):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    total_time = sum(r.get("time_step", 0.0) for r in tr)
    end = recipe.schedule.steps if end_step is None else end_step
    summary = {
        "recipe": recipe.name,
        "mode": recipe.mode,
        "learner_spec": learner_spec,
        "runtime_te": recipe.runtime.te,
        "steps": end - start_step,
        "end_step": end,
        "stopped_by": stopped_by,  # None: schedule.steps reached
        "max_lag": recipe.schedule.max_lag,
        "eval_reward_before": eval_before,
        "eval_reward_after": eval_after,
        "train_reward_first": tr[0]["reward_mean"] if tr else None,
        "train_reward_last": tr[-1]["reward_mean"] if tr else None,
        "train_reward_first_10pct": mean("reward_mean", tr[:tenth]),
        "train_reward_last_10pct": mean("reward_mean", tr[-tenth:]),
        "mismatch_max_abs_dlogp": max((r["max_abs_dlogp"] for r in tr), default=None),
        "mismatch_mean_abs_dlogp": sum(r["mean_abs_dlogp"] for r in tr) / n,
        "mismatch_frac_bitwise": sum(r["frac_bitwise"] for r in tr) / n,
        "d3_mean": sum(r["d3"] for r in tr) / n,
        "d3_peak_over_median": tr[-1].get("d3_peak_over_median") if tr else None,
        "kl_k1_first_10pct": mean("kl_k1", tr[:tenth]),
        "kl_k1_last_10pct": mean("kl_k1", tr[-tenth:]),
        "kl_k3_first_10pct": mean("d3", tr[:tenth]),
        "kl_k3_last_10pct": mean("d3", tr[-tenth:]),
        "grad_norm_max": max((r["grad_norm"] for r in tr if isinstance(r.get("grad_norm"), (int, float))), default=None),
        "updates_per_s": len(tr) / total_time if total_time > 0 else None,
        # `times` covers this process only (a resumed run: the updates since the resume)
        "time_per_step": {k: v / max(1, end - start_step) for k, v in times.items()},
        "run_dir": str(run_dir),
    }
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary["reward_errors"] = sum(r.get("reward_errors", 0) + r.get("eval/reward_errors", 0) for r in rows)
    summary["reward_timeouts"] = sum(r.get("reward_timeouts", 0) + r.get("eval/reward_timeouts", 0) for r in rows)
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if evals:  # the first and the last evaluation's per-set figures (greedy, avg@k, pass@1, pass@k)
        for tag, r in (("before", evals[0]), ("after", evals[-1])):
            summary[f"eval_{tag}"] = {k[5:]: v for k, v in r.items() if k.startswith("eval/") and k.count("/") == 2}
    if recipe.schedule.max_lag:
        summary["lag_mean"] = mean("lag_mean", tr)
        summary["lag_max"] = max((r.get("lag_max", 0) for r in tr), default=0)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
