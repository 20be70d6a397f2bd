"""What makes a killed run resume as if it had never stopped.

- Data order is a pure function of (seed, step): `step_rng` gives each step its own generator, so
  a run resumed at step s draws exactly the prompts the uninterrupted run drew at s, s+1, ...
  (rollout sampling seeds are already per step, see RolloutSide.collect).
- Checkpoints are complete and intact or ignored: every rank writes its dist_checkpointing files
  (megatron_rz.learner.checkpoint: `__<rank>_<i>.distcp`; rank 0 also `.metadata`, `common.pt`,
  `metadata.json`) and a digest of each (`write_digest`, megatron_rz.manifest), then rank 0 writes the COMPLETE marker
  (`mark_complete`: the step and every file's size and BLAKE2b digest, written atomically). `checkpoint.load: latest` picks the newest
  checkpoint that verifies (`verify_checkpoint`): one killed while saving (no marker), with a
  missing, truncated or corrupted file, or with a torn marker is named and skipped for the one
  before. Recipe `checkpoint.verify: size` checks sizes only (no re-read of the files: for very large
  runs; `set_verify` applies it, megatron_rz.launch.runtime calls it).
- `checkpoint.keep: N` (N > 0) keeps this run's newest N complete checkpoints: after each save rank
  0 deletes the older ones of the same run directory (`prune_checkpoints`), never a newer or
  unfinished-newer one (a save in progress), never anything outside `checkpoints/step_*`.
- metrics.jsonl keeps the rows up to the resumed step and drops the ones a killed run wrote after
  its last checkpoint, so the file reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

# Imported for its side effect too: it catches SLURM's SIGUSR1 from the moment a trainer loads
# this module (the signal's default action would kill the process before the first update).
from megatron_rz.launch import preemption
from megatron_rz.launch.rundir import checkpoint_dir  # noqa: F401  (the trainers import it from here)
from megatron_rz.manifest import COMPLETE, verify_checkpoint


def step_rng(seed: int, step: int) -> random.Random:
    """The task-sampling generator of one training step."""
    return random.Random(f"rz-data-{seed}-{step}")


def latest_checkpoint(run_dir: Path, log=print) -> Path | None:
    """Newest checkpoint under run_dir/checkpoints that verifies, or None; each newer one that does
    not is named with the reason."""
    root = Path(run_dir) / "checkpoints"
    cands = sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []
    for p in cands:
        why = verify_checkpoint(p)
        if why is None:
            return p
        log(f"[rz] checkpoint {p} skipped: {why}")
    return None


def prune_checkpoints(run_dir: Path, keep: int, log=print) -> list[Path]:
    """Delete the checkpoints of run_dir older than its newest ``keep`` complete ones (those with the
    COMPLETE marker; a marker is enough here: latest_checkpoint verifies when it loads). Unfinished
    directories older than the oldest kept one go too (saves killed midway); anything newer than it
    stays (a save may be in progress). keep <= 0: nothing is deleted. Returns the deleted paths."""
    root = Path(run_dir) / "checkpoints"
    if keep <= 0 or not root.is_dir():
        return []
    steps = sorted((p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"step_\d+", p.name)),
                   key=lambda p: int(p.name[5:]), reverse=True)
    complete = [p for p in steps if (p / COMPLETE).is_file()]
    if len(complete) <= keep:
        return []
    oldest_kept = int(complete[keep - 1].name[5:])
    gone = [p for p in steps if int(p.name[5:]) < oldest_kept]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    if gone:
        log(f"[rz] checkpoint.keep={keep}: deleted {len(gone)} older checkpoint(s) of this run "
            f"({', '.join(p.name for p in reversed(gone))})")
    return gone


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
    why = verify_checkpoint(p)
    if why is not None:
        raise FileNotFoundError(f"checkpoint.load={load!r} cannot be used: {why}; use an earlier checkpoint "
                                "or checkpoint.load=latest (which skips it)")
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
    (checkpoint this step and exit for requeue, megatron_rz.launch.preemption)."""
    every, total = recipe.checkpoint.every, recipe.schedule.steps
    if every and step % every == 0 and step < total:
        learner.save_checkpoint(checkpoint_dir(run_dir, step), step=step)
        prune_after_save(recipe, run_dir)
    preemption.checkpoint_and_exit_if_requested(learner, run_dir, step, total)


def prune_after_save(recipe, run_dir: Path) -> None:
    """Rank 0, after a checkpoint save returned: apply checkpoint.keep (prune_checkpoints)."""
    import torch.distributed as dist

    if recipe.checkpoint.keep and (not dist.is_initialized() or dist.get_rank() == 0):
        prune_checkpoints(run_dir, recipe.checkpoint.keep)
