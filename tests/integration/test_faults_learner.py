"""Faults on the real Megatron learner (one tiny model shared by the assertions, ~10 s): a NaN
update is not applied by Megatron's optimizer behind the guard, and a corrupted newest checkpoint
is skipped by checkpoint.load=latest for the previous one, which restores the weights exactly, as is
a checkpoint whose write failed on a full disk."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")


def test_real_learner_skips_nan_updates_and_resumes_past_a_corrupted_checkpoint(tmp_path):
    from megatron_rz.rl.guards import install_nonfinite_guard
    from megatron_rz.learner.learner import Learner
    from megatron_rz.recipe import load_recipe
    from megatron_rz.loop.resume import checkpoint_dir, latest_checkpoint
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    r = load_recipe(None, ["algo.lr=3e-3"])
    make_random_checkpoint(r, tmp_path / "hf", seed=0)
    learner = Learner(r.model, r.parallel, r.algo, str(tmp_path / "hf"), seed=0)
    guard = install_nonfinite_guard(learner)
    ids = torch.randint(2, r.model.vocab_size, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[:, 0] = 0

    def nll(logp, rows):
        return -(logp * rows["loss_mask"]).sum(), {}

    def nan(logp, rows):
        return nll(logp, rows)[0] * float("nan"), {}

    weights = lambda: {k: v.clone() for k, v in learner.export_hf_weights()}  # noqa: E731
    w0 = weights()
    out = guard.after_update(learner.train_step(ids, guard.wrap_loss(nan), loss_mask=mask), 1)
    assert out["update_successful"] is False and out["update_skipped"] == 1 and math.isnan(out["grad_norm"])
    assert all(torch.equal(w0[k], v) for k, v in weights().items()), "Megatron applied a NaN update"
    out = guard.after_update(learner.train_step(ids, guard.wrap_loss(nll), loss_mask=mask), 2)
    assert out["update_successful"] and out["update_skipped"] == 0
    w2 = weights()
    assert any(not torch.equal(w0[k], v) for k, v in w2.items())
    assert all(torch.isfinite(v).all() for v in w2.values())

    learner.save_checkpoint(checkpoint_dir(tmp_path, 2), step=2)
    learner.train_step(ids, nll, loss_mask=mask)
    newest = learner.save_checkpoint(checkpoint_dir(tmp_path, 3), step=3)
    f = newest / "__0_0.distcp"  # this rank's tensors (dist_checkpointing)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, in the middle of the tensors
    f.write_bytes(bytes(raw))
    said = []
    ckpt = latest_checkpoint(tmp_path, log=said.append)
    assert ckpt == checkpoint_dir(tmp_path, 2) and "step_000003" in said[0] and "__0_0.distcp" in said[0]
    assert learner.load_checkpoint(ckpt) == 2
    assert all(torch.equal(w2[k], v) for k, v in weights().items())

    # the disk fills up while step 5 is written: the error propagates, step 5 never counts
    import errno

    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def full_disk(state, path, **kw):
        real_save(state, path, **kw)
        with open(f"{path}/__0_0.distcp", "r+b") as f:
            f.truncate(4096)  # what was on disk when the write failed
        raise OSError(errno.ENOSPC, "No space left on device", f"{path}/__0_0.distcp")

    dist_checkpointing.save = full_disk
    try:
        with pytest.raises(OSError, match="No space left"):
            learner.save_checkpoint(checkpoint_dir(tmp_path, 5), step=5)
    finally:
        dist_checkpointing.save = real_save
    said.clear()
    assert latest_checkpoint(tmp_path, log=said.append) == checkpoint_dir(tmp_path, 2)
    assert "step_000005" in said[0] and "no COMPLETE marker" in said[0]



def test_real_learner_rolls_back_a_step_that_makes_weights_non_finite(tmp_path):
    """Finite loss and gradients, but one Adam moment corrupted (inf; a flipped bit in optimizer
    memory): Megatron's real Adam step writes a non-finite value into that weight. The guard puts
    the weights and the optimizer state back as they were before the step, counts the step, and,
    the fault persisting, stops after algo.max_bad_updates such steps in a row with the weights of
    the last good update; a good step after a rolled-back one is applied from the restored state."""
    from megatron_rz.rl.guards import RunStopped, _torch_optimizers, install_nonfinite_guard
    from megatron_rz.learner.learner import Learner
    from megatron_rz.recipe import load_recipe
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    r = load_recipe(None, ["algo.lr=3e-3", "algo.max_bad_updates=2"])
    make_random_checkpoint(r, tmp_path / "hf", seed=0)
    learner = Learner(r.model, r.parallel, r.algo, str(tmp_path / "hf"), seed=0)
    guard = install_nonfinite_guard(learner)
    opts = _torch_optimizers(learner.optimizer)
    assert len(opts) == 2, "dense and expert parameter groups: two torch optimizers inside Megatron's"
    ids = torch.randint(2, r.model.vocab_size, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[:, 0] = 0

    def nll(logp, rows):
        return -(logp * rows["loss_mask"]).sum(), {}

    def params():
        return [p for o in opts for g in o.param_groups for p in g["params"]]

    def state():
        weights = {k: v.clone() for k, v in learner.export_hf_weights()}
        adam = [{k: v.clone() if torch.is_tensor(v) else v for k, v in o.state[p].items()}
                for o in opts for p in (p for g in o.param_groups for p in g["params"])]
        return weights, adam

    def bits(t):  # bit for bit, NaN included
        return t.contiguous().reshape(-1).view(torch.uint8)

    def same(a, b):
        return (a[0].keys() == b[0].keys() and all(torch.equal(bits(a[0][k]), bits(b[0][k])) for k in a[0])
                and len(a[1]) == len(b[1]) and all(x.keys() == y.keys() and all(
                    torch.equal(bits(x[k]), bits(y[k])) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
                    for x, y in zip(a[1], b[1])))

    def step(n):
        return guard.after_update(learner.train_step(ids, guard.wrap_loss(nll), loss_mask=mask), n)

    out = step(1)  # a good update: Adam now has moments and a step count
    assert out["update_successful"] and out["skipped_nonfinite_weights"] == 0
    good = state()
    expert = next(p for o in opts[1:] for g in o.param_groups for p in g["params"])
    m = opts[1].state[expert]["exp_avg"]
    m.view(-1)[3] = float("inf")  # the fault: in optimizer memory, not in the loss or the gradients
    faulty = state()
    out = step(2)
    assert out["update_successful"] is False and out["update_skipped"] == 1
    assert out["skipped_nonfinite_weights"] == 1 and math.isfinite(out["grad_norm"]) and math.isfinite(out["loss"])
    assert same(state(), faulty), "a step that made a weight non-finite was applied (or its Adam state kept)"
    assert all(torch.isfinite(v).all() for v in state()[0].values())
    m.view(-1)[3] = good[1][[id(p) for p in params()].index(id(expert))]["exp_avg"].view(-1)[3]  # repaired
    out = step(3)  # applied from the restored state
    assert out["update_successful"] and out["skipped_updates"] == 1 and out["skipped_nonfinite_weights"] == 1
    w3 = state()
    assert not same(w3, good) and all(torch.isfinite(v).all() for v in w3[0].values())
    opts[0].state[params()[0]]["exp_avg_sq"].view(-1)[0] = float("nan")  # a fault that persists
    faulty = state()
    out = step(4)
    assert out["update_skipped"] == 1 and out["skipped_nonfinite_weights"] == 2
    with pytest.raises(RunStopped, match="2 updates in a row.*weights after the step.*updates 4, 5.*update 3"):
        step(5)
    assert same(state(), faulty)
