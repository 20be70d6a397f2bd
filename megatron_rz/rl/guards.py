"""Non-finite updates are never applied.

`install_nonfinite_guard(learner)` wraps the learner's Megatron optimizer `step`: before it runs,
every rank checks its gradients (the DDP `main_grad` buffers the optimizer reads, and `.grad`) for
NaN/inf and the ranks agree through one all-reduce; if any is non-finite, the step is skipped on
every rank (no parameter, no Adam moment, no step count changes), the gradients are zeroed and
the step reports `update_successful = False` with a NaN grad norm. (A NaN or inf loss reaches the
gradients through backward, so it is caught there too.) Megatron's fp32 optimizer applies such a
step as it comes: its found-inf check exists only for loss-scaled fp16.

The parameters are checked too, after the step: a step from finite gradients can still make a
weight non-finite (a huge learning rate, an overflowing Adam moment). Before each step the guard
keeps a copy of what the step changes (the model's parameters, the optimizer's main parameters and
its per-parameter state: Adam moments and step counts); when any rank finds a non-finite parameter
after it, every rank puts that copy back and the step reports `update_successful = False`, so the
engine never receives those weights. (The copy costs, per rank, the bytes of its parameters, main
parameters and optimizer state once more.)

`NonFiniteGuard.after_update(out)` is called by both trainers with the train_step result: it adds
`update_skipped` (0/1), `skipped_updates` (count in this process) and
`skipped_nonfinite_weights` (those of them rolled back after the step) to the metrics row and stops
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
    return _all_finite(list(_grads(learner)), local_ok)


def _torch_optimizers(opt) -> list:
    """The torch optimizers inside a Megatron optimizer (ChainedOptimizer: one per parameter group
    kind, e.g. dense and expert); their param_groups hold the main parameters the step updates."""
    import torch

    inner = [getattr(o, "optimizer", None) for o in getattr(opt, "chained_optimizers", [opt])]
    return [o for o in inner if isinstance(o, torch.optim.Optimizer)]


def _step_tensors(learner, opts) -> list:
    """Every tensor an optimizer step may change, each once: model parameters, main parameters."""
    seen, out = set(), []
    for p in [*learner.model.parameters(), *(p for o in opts for g in o.param_groups for p in g["params"])]:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _clone(v):
    import torch

    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _snapshot(learner, opts) -> tuple:
    tensors = _step_tensors(learner, opts)
    values = [t.detach().clone() for t in tensors]
    states = [{id(p): {k: _clone(v) for k, v in o.state[p].items()} if p in o.state else None
               for g in o.param_groups for p in g["params"]} for o in opts]
    groups = [[{k: _clone(v) for k, v in g.items() if k != "params"} for g in o.param_groups] for o in opts]
    return tensors, values, states, groups


def _restore(snap, opts) -> None:
    import torch

    tensors, values, states, groups = snap
    with torch.no_grad():
        for t, v in zip(tensors, values):
            t.copy_(v)
    for o, state, gs in zip(opts, states, groups):
        for g, saved in zip(o.param_groups, gs):
            g.update(saved)
            for p in g["params"]:
                old = state[id(p)]
                if old is None:
                    o.state.pop(p, None)  # the step created it (a first step)
                    continue
                now = o.state[p]  # in place: the same tensors (anything holding them sees the restore)
                for k in [k for k in now if k not in old]:
                    del now[k]
                for k, v in old.items():
                    cur = now.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                        with torch.no_grad():
                            cur.copy_(v)
                    else:
                        now[k] = v


def _all_finite(tensors, local_ok: bool = True) -> bool:
    """True on every rank iff every rank's ``tensors`` are finite and its ``local_ok`` holds."""
    import torch

    flags = [torch.isfinite(g).all() for g in tensors]
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

    opts = _torch_optimizers(opt)

    def step():
        loss_ok, guard.bad_loss = not guard.bad_loss, False
        guard.bad_weights = False
        if not grads_finite(learner, loss_ok):
            for g in _grads(learner):
                g.zero_()
            return False, float("nan"), None
        snap = _snapshot(learner, opts)
        ok, grad_norm, extra = inner()
        if not _all_finite(_step_tensors(learner, opts)):  # collective: every rank rolls back or none
            _restore(snap, opts)
            for g in _grads(learner):
                g.zero_()
            guard.bad_weights = True
            return False, grad_norm, extra
        return ok, grad_norm, extra

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
        self.bad_weights = False  # the last step made a parameter non-finite (it was rolled back)
        self.bad_weight_steps = 0

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
        weights, self.bad_weights = self.bad_weights, False
        if skipped:
            self.in_a_row += 1
            self.skipped += 1
            self.bad_weight_steps += int(weights)
            self.steps.append(step)
            why = (f"the step made a weight non-finite (grad norm {out.get('grad_norm')}; rolled back)" if weights
                   else f"non-finite loss {out.get('loss')} / grad norm {out.get('grad_norm')}")
            print(f"[rz] update {step} skipped: {why} (not applied; {self.in_a_row} in a row)", flush=True)
        else:
            self.in_a_row = 0
        out["update_skipped"] = int(skipped)
        out["skipped_updates"] = self.skipped
        out["skipped_nonfinite_weights"] = self.bad_weight_steps
        if self.in_a_row >= self.max_in_a_row:
            raise RunStopped(
                f"{self.in_a_row} updates in a row had a non-finite loss, gradient or weights after the step (updates "
                f"{', '.join(map(str, self.steps[-self.in_a_row:]))}); none was applied, the weights are those "
                f"of update {step - self.in_a_row}. Lower algo.lr or set algo.grad_clip, check the task's "
                f"rewards, then resume with checkpoint.load=latest (algo.max_bad_updates={self.max_in_a_row})")
        return out
