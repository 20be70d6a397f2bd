"""Preemption: on SLURM's warning, checkpoint at the next step boundary and exit so the job requeues.

The batch script of `rz submit` receives the warning signal (`#SBATCH --signal=B:USR1@secs`) and
forwards it as a file, $RZ_PREEMPT_FILE: a signal sent through srun and torchrun would reach the
torchrun agents too, whose default action on SIGUSR1 is to die. A SIGUSR1 delivered to a learner
process itself (e.g. `kill -USR1` on a run outside SLURM) counts as well.

The trainers call `checkpoint_and_exit_if_requested(learner, run_dir, step + 1, steps)` after each
step. It is collective: every rank calls it every step, and the ranks agree through one tiny
all-reduce, so all of them save the same step (save_checkpoint is collective too). Then it writes
PREEMPTED in the run dir and raises SystemExit(0); the batch script sees PREEMPTED, runs
`scontrol requeue`, and the requeued job starts `rz train ... checkpoint.load=latest`, which
resumes from that checkpoint (megatron_rz.resume).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

PREEMPT_FILE_ENV = "RZ_PREEMPT_FILE"
MARKER = "PREEMPTED"  # in the run dir: this run stopped for preemption after checkpointing

_signalled = False
_installed = False


def _on_usr1(signum, frame) -> None:
    global _signalled
    _signalled = True


def install() -> None:
    """Catch SIGUSR1 in this process (main thread only; elsewhere the file is the channel)."""
    global _installed
    if not _installed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, _on_usr1)
        _installed = True


# Importing this module (the trainers do) is enough to catch the signal from the start of the run.
install()


def requested_locally() -> bool:
    path = os.environ.get(PREEMPT_FILE_ENV)
    return _signalled or bool(path and os.path.exists(path))


def _agree(flag: bool) -> bool:
    """True on every rank if any rank saw the request."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def checkpoint_and_exit_if_requested(learner, run_dir, step: int, total_steps: int) -> None:
    """Collective, after a step: on a preemption request save `step` and exit(0).

    The last step is left to finish: the trainer saves its final checkpoint right after it."""
    install()
    if step >= total_steps or not _agree(requested_locally()):
        return
    from megatron_rz.resume import checkpoint_dir

    import torch.distributed as dist

    d = learner.save_checkpoint(checkpoint_dir(Path(run_dir), step), step=step)
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(run_dir) / MARKER).write_text(f"{step}\n")
        print(f"[rz] preempted: checkpoint {d} written at step {step}; exiting for requeue", flush=True)
    raise SystemExit(0)
