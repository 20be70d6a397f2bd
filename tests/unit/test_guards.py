"""Non-finite updates are never applied: the guard's step skipping and its stop after N in a row,
on a small torch model with Megatron's conventions (DDP main_grad buffers, step() -> (ok, norm, _)),
in one process and on two gloo ranks of which only one gets the non-finite gradient."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rz.rl.guards import RunStopped, install_nonfinite_guard


class _Opt:
    """Megatron's fp32 optimizer as far as the guard sees it: Adam on main_grad, no inf check."""

    def __init__(self, params):
        self.params = list(params)
        self.adam = torch.optim.Adam(self.params, lr=0.1)

    def step(self):
        for p in self.params:
            p.grad = p.main_grad
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in self.params))
        self.adam.step()
        return True, norm, None


def _learner(max_bad=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)
    learner = SimpleNamespace(model=model, optimizer=_Opt(model.parameters()),
                              algo=SimpleNamespace(max_bad_updates=max_bad))
    return learner, install_nonfinite_guard(learner)


def _step(learner, loss_fn, x):
    """What Learner.train_step does around the optimizer: loss, backward into main_grad, step."""
    for p in learner.model.parameters():
        p.main_grad.zero_()
        p.grad = None
    out = learner.model(x).squeeze(-1)
    loss_sum, _ = loss_fn(out, {})
    params = list(learner.model.parameters())
    for p, g in zip(params, torch.autograd.grad(loss_sum, params, allow_unused=True)):
        if g is not None:
            p.main_grad += g
    ok, norm, _ = learner.optimizer.step()
    return {"loss": float(loss_sum), "grad_norm": float(norm), "update_successful": ok}


def _state(learner):
    return ({k: v.clone() for k, v in learner.model.state_dict().items()},
            copy.deepcopy(learner.optimizer.adam.state_dict()))


def _same(a, b):
    pa, oa = a
    pb, ob = b
    same_p = all(torch.equal(pa[k], pb[k]) for k in pa)
    return same_p and repr(oa) == repr(ob)


X = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
GOOD = lambda y, rows: ((y - 1.0) ** 2).sum()  # noqa: E731


@pytest.mark.parametrize("poison", ["nan_loss", "inf_loss", "nan_grad", "inf_grad", "nan_constant_in_loss"])
def test_non_finite_update_is_not_applied(poison):
    learner, guard = _learner()
    _step(learner, guard.wrap_loss(lambda y, r: (GOOD(y, r), {})), X)  # one real update: Adam has state
    before = _state(learner)
    if poison == "nan_loss":
        fn = lambda y, r: (GOOD(y, r) * float("nan"), {})  # noqa: E731
    elif poison == "inf_loss":
        fn = lambda y, r: (GOOD(y, r) + y[0] * float("inf"), {})  # noqa: E731
    elif poison == "nan_constant_in_loss":  # the loss is NaN although its gradient is finite
        fn = lambda y, r: (GOOD(y, r) + torch.tensor(float("nan")), {})  # noqa: E731
    else:
        bad = float("nan") if poison == "nan_grad" else float("inf")
        fn = lambda y, r: (GOOD(y, r) + _Hook.apply(y, bad).sum(), {})  # noqa: E731  (finite loss)
    out = _step(learner, guard.wrap_loss(fn), X)
    assert out["update_successful"] is False and math.isnan(out["grad_norm"])
    assert _same(before, _state(learner)), "a non-finite update changed parameters or optimizer state"
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in learner.model.parameters())
    guard.after_update(out, 2)
    assert out["update_skipped"] == 1 and out["skipped_updates"] == 1
    # the next finite update is applied normally
    good = _step(learner, guard.wrap_loss(lambda y, r: (GOOD(y, r), {})), X)
    assert good["update_successful"] and not _same(before, _state(learner))
    assert guard.after_update(good, 3)["update_skipped"] == 0


class _Hook(torch.autograd.Function):
    """Identity forward (finite loss), a non-finite gradient backward."""

    @staticmethod
    def forward(ctx, y, bad):
        ctx.bad = bad
        return y * 0.0

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, ctx.bad), None


def test_run_stops_after_n_skipped_in_a_row_and_a_good_update_resets_the_count():
    learner, guard = _learner(max_bad=3)
    nan = guard.wrap_loss(lambda y, r: (GOOD(y, r) * float("nan"), {}))
    good = guard.wrap_loss(lambda y, r: (GOOD(y, r), {}))
    seq = [nan, nan, good, nan, nan]
    for i, fn in enumerate(seq, 1):
        guard.after_update(_step(learner, fn, X), i)
    assert guard.skipped == 4 and guard.in_a_row == 2
    with pytest.raises(RunStopped) as e:
        guard.after_update(_step(learner, nan, X), 6)
    msg = str(e.value)
    assert "3 updates in a row" in msg and "4, 5, 6" in msg and "max_bad_updates=3" in msg and "\n" not in msg


def test_guard_is_installed_once():
    learner, guard = _learner()
    assert install_nonfinite_guard(learner) is guard


# ------------------------------------------------------------------ two ranks, one non-finite


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks: the same small model on both (no gradient all-reduce: each rank's
    gradients are its own, as a TP or EP rank's shards are); update 2 gets a NaN gradient on rank 1
    only. The guard's one all-reduce must skip it on both ranks."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        learner, guard = _learner()
        good = guard.wrap_loss(lambda y, r: (GOOD(y, r), {}))
        first = _step(learner, good, X)  # a real update on both ranks: Adam has state
        before = _state(learner)
        fn = guard.wrap_loss(lambda y, r: (GOOD(y, r) + _Hook.apply(y, float("nan")).sum(), {})) if rank == 1 else good
        poisoned = guard.after_update(_step(learner, fn, X), 2)
        unchanged = _same(before, _state(learner))
        zeroed = all(torch.count_nonzero(p.main_grad) == 0 for p in learner.model.parameters())
        after = _step(learner, good, X)  # the next finite update is applied on both
        torch.save({"first": first, "poisoned": poisoned, "unchanged": unchanged, "after": after,
                    "moved": not _same(before, _state(learner)), "zeroed": zeroed},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_non_finite_gradient_on_one_of_two_ranks_is_applied_by_no_rank(tmp_path):
    import socket

    import torch.multiprocessing as tmp_mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp_mp.start_processes(_two_rank_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r, x in enumerate(res):
        assert x["first"]["update_successful"], (r, x["first"])
        p = x["poisoned"]
        assert p["update_successful"] is False and math.isnan(p["grad_norm"]) and p["update_skipped"] == 1, (r, p)
        assert x["unchanged"], f"rank {r} applied the update that was non-finite on rank 1"
        assert x["zeroed"], f"rank {r} kept the skipped update's gradients"
        assert x["after"]["update_successful"] and x["moved"], (r, x["after"])
    assert math.isfinite(res[0]["poisoned"]["loss"])  # rank 0's own loss and gradients were finite
