"""Non-finite updates are never applied.

`install_nonfinite_guard(learner)` wraps the learner's Megatron optimizer `step`: before it runs,
every rank checks its gradients (the DDP `main_grad` buffers the optimizer reads, and `.grad`) for
NaN/inf and the ranks agree through one all-reduce; if any is non-finite, the step is skipped on
every rank (no parameter, no Adam moment, no step count changes), the gradients are zeroed and
the step reports `update_successful = False` with a NaN grad norm. (A NaN or inf loss reaches the
gradients through backward, so it is caught there too.) Megatron's fp32 optimizer applies such a
step as it comes: its found-inf check exists only for loss-scaled fp16.

`NonFiniteGuard.after_update(out)` is called by both trainers with the train_step result: it adds
`update_skipped` (0/1) and `skipped_updates` (count in this process) to the metrics row and stops
the run with `RunStopped` after `algo.max_bad_updates` skipped updates in a row. The weight
version still advances on a skipped update (the engine then gets the same weights again), so the
learner and rollout bookkeeping stays in step.
"""

from __future__ import annotations

import math


class RunStopped(RuntimeError):
    """The run cannot continue; the message says why and what to change (rz prints one line)."""


def _grads(learner):
    for p in learner.model.parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is not None:
            yield g


def grads_finite(learner, local_ok: bool = True) -> bool:
    """True on every rank iff every rank's gradients are finite and every rank's `local_ok`
    (collective when distributed)."""
    import torch

    flags = [torch.isfinite(g).all() for g in _grads(learner)]
    ok = local_ok and (bool(torch.stack(flags).all()) if flags else True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        t = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ok = not bool(t.item())
    return ok


def install_nonfinite_guard(learner) -> "NonFiniteGuard":
    opt = learner.optimizer
    if getattr(opt, "_rz_guarded", False):
        return learner._rz_guard
    inner = opt.step
    guard = NonFiniteGuard(learner.algo.max_bad_updates)

    def step():
        loss_ok, guard.bad_loss = not guard.bad_loss, False
        if not grads_finite(learner, loss_ok):
            for g in _grads(learner):
                g.zero_()
            return False, float("nan"), None
        return inner()

    opt.step = step
    opt._rz_guarded = True
    learner._rz_guard = guard
    return guard


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.skipped = 0
        self.steps: list[int] = []
        self.bad_loss = False  # a micro batch's loss was non-finite since the last optimizer step

    def wrap_loss(self, loss_fn):
        """The trainer's loss function, noting a non-finite loss (then the step is skipped even if
        its gradient happened to be finite)."""

        import torch

        def fn(logp, rows):
            loss_sum, metrics = loss_fn(logp, rows)
            if not bool(torch.isfinite(loss_sum.detach()).all()):
                self.bad_loss = True
            return loss_sum, metrics

        return fn

    def after_update(self, out: dict, step: int) -> dict:
        """Count a skipped update (train_step's out, update `step`, 1-based); adds the metrics."""
        skipped = not out.get("update_successful", True) or not math.isfinite(out.get("loss", 0.0))
        if skipped:
            self.in_a_row += 1
            self.skipped += 1
            self.steps.append(step)
            print(f"[rz] update {step} skipped: non-finite loss {out.get('loss')} / grad norm "
                  f"{out.get('grad_norm')} (not applied; {self.in_a_row} in a row)", flush=True)
        else:
            self.in_a_row = 0
        out["update_skipped"] = int(skipped)
        out["skipped_updates"] = self.skipped
        if self.in_a_row >= self.max_in_a_row:
            raise RunStopped(
                f"{self.in_a_row} updates in a row had a non-finite loss or gradient (updates "
                f"{', '.join(map(str, self.steps[-self.in_a_row:]))}); none was applied, the weights are those "
                f"of update {step - self.in_a_row}. Lower algo.lr or set algo.grad_clip, check the task's "
                f"rewards, then resume with checkpoint.load=latest (algo.max_bad_updates={self.max_in_a_row})")
        return out
