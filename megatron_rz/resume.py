"""What makes a killed run resume as if it had never stopped.

- Data order is a pure function of (seed, step): `step_rng` gives each step its own generator, so
  a run resumed at step s draws exactly the prompts the uninterrupted run drew at s, s+1, ...
  (rollout sampling seeds are already per step, see RolloutSide.collect).
- Checkpoints are complete or ignored: `save_checkpoint` writes a COMPLETE marker after every rank
  has written its file; `checkpoint.load: latest` picks the newest complete one in the run dir
  (a run killed while saving falls back to the one before).
- metrics.jsonl keeps the rows up to the resumed step and drops the ones a killed run wrote after
  its last checkpoint, so the file reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Imported for its side effect too: it catches SLURM's SIGUSR1 from the moment a trainer loads
# this module (the signal's default action would kill the process before the first update).
from megatron_rz import preemption

COMPLETE = "COMPLETE"


def step_rng(seed: int, step: int) -> random.Random:
    """The task-sampling generator of one training step."""
    return random.Random(f"rz-data-{seed}-{step}")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint under run_dir/checkpoints, or None."""
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / COMPLETE).exists()) if root.is_dir() else []
    return done[-1] if done else None


def resolve_load(load: str | None, run_dir: Path) -> Path | None:
    """checkpoint.load -> a checkpoint dir or None (start fresh).

    "latest": the newest complete checkpoint of this run dir, None when there is none yet (so a
    requeued job that was preempted before its first checkpoint simply starts over).
    A path: must be a complete checkpoint, else a clear error before anything starts."""
    if not load:
        return None
    if load == "latest":
        return latest_checkpoint(run_dir)
    p = Path(load)
    if not p.is_dir():
        raise FileNotFoundError(
            f"checkpoint.load={load!r}: no such directory. Use a checkpoint dir such as "
            f"{checkpoint_dir(run_dir, 10)} or checkpoint.load=latest"
        )
    if not (p / COMPLETE).exists():
        raise FileNotFoundError(
            f"checkpoint.load={load!r} is incomplete (no {COMPLETE} marker: the run was killed while saving "
            "it); use an earlier checkpoint or checkpoint.load=latest"
        )
    return p


def truncate_metrics(path: Path, start_step: int) -> list[dict]:
    """Drop rows after start_step (written by the killed run after its last checkpoint); returns
    the rows kept, from which the trainer restores its running statistics (D3 peak/median) and
    the run's evaluation before training."""
    path = Path(path)
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if r["step"] <= start_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def eval_before(rows: list[dict]) -> float | None:
    """The run's evaluation before its first update (the step-0 eval row), if logged."""
    return next((r["eval_reward"] for r in rows if r["step"] == 0 and "eval_reward" in r), None)


def checkpoint_after_step(learner, recipe, run_dir: Path, step: int) -> None:
    """Collective, after update `step` (1-based) in both trainers: the periodic checkpoint
    (checkpoint.every; the final one is saved after the loop), then SLURM's preemption request
    (checkpoint this step and exit for requeue, megatron_rz.preemption)."""
    every, total = recipe.checkpoint.every, recipe.schedule.steps
    if every and step % every == 0 and step < total:
        learner.save_checkpoint(checkpoint_dir(run_dir, step), step=step)
    preemption.checkpoint_and_exit_if_requested(learner, run_dir, step, total)
