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
resumes from that checkpoint (megatron_rz.loop.resume).

SIGTERM on a learner (kill, scancel, a scheduler's stop): `rz train` exits at once (143) until the
training loop starts; from then on (`arm_sigterm_checkpoint`, called by both trainers before their
loop) the first SIGTERM is a request like SIGUSR1's: the ranks checkpoint the step they are on and
exit with 143, without the PREEMPTED marker (nothing requeues a stopped run); a second SIGTERM
exits at once.
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
_terminated = False  # a SIGTERM arrived while armed: checkpoint, then exit 143


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


def _exit_now(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _on_term(signum, frame) -> None:
    global _terminated
    if _terminated:  # the second SIGTERM: stop now
        raise SystemExit(128 + signum)
    _terminated = True
    print("[rz] SIGTERM: checkpointing after this update, then exiting (send it again to stop at once)", flush=True)


def install_sigterm_exit() -> None:
    """SIGTERM -> SystemExit(143), so cleanup handlers run and no vLLM process leaks (rz's default)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_now)


def arm_sigterm_checkpoint() -> None:
    """From here on the first SIGTERM asks for a checkpoint at the next step boundary."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_term)


def requested_locally() -> bool:
    path = os.environ.get(PREEMPT_FILE_ENV)
    return _signalled or _terminated or bool(path and os.path.exists(path))


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
    from megatron_rz.launch.rundir import checkpoint_dir

    import torch.distributed as dist

    d = learner.save_checkpoint(checkpoint_dir(Path(run_dir), step), step=step)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if _terminated:  # SIGTERM: a stop, not a preemption (no requeue marker)
        if rank0:
            print(f"[rz] stopped by SIGTERM: checkpoint {d} written at step {step}; resume with "
                  "checkpoint.load=latest", flush=True)
        raise SystemExit(128 + signal.SIGTERM)
    if rank0:
        (Path(run_dir) / MARKER).write_text(f"{step}\n")
        print(f"[rz] preempted: checkpoint {d} written at step {step}; exiting for requeue", flush=True)
    raise SystemExit(0)
