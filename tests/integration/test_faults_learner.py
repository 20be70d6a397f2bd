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
