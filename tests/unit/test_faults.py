"""Faults survived with nothing lost, unit level: a weight sync with one flipped byte, corrupted /
interrupted checkpoints, SIGTERM on the learner. (Non-finite updates: test_guards.py.)"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from pathlib import Path

from megatron_rz.launch import preemption
from megatron_rz.loop.resume import checkpoint_dir, latest_checkpoint, resolve_load
from megatron_rz.manifest import COMPLETE, mark_complete, verify_checkpoint, write_digest
from vllm_bridge.engine import WeightSyncError, check_weights
from vllm_bridge.worker_ext import checksum_entry

# ------------------------------------------------------------------------ weight sync, flipped byte

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"model.embed_tokens.weight": (64, 64), "model.layers.0.input_layernorm.weight": (64,),
         "model.layers.1.mlp.gate.weight": (8, 64), "model.norm.weight": (64,)}


def _flip(t: torch.Tensor, rng: random.Random) -> tuple[torch.Tensor, int, int]:
    raw = t.clone().contiguous().view(-1).view(torch.uint8)
    i, x = rng.randrange(raw.numel()), rng.randrange(1, 256)
    raw[i] ^= x
    return raw.view(t.dtype).view(t.shape), i, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_flipped_byte_in_a_sync_is_caught_every_time(dtype):
    g = torch.Generator().manual_seed(0)
    learner = {n: (torch.randn(s, generator=g) * 0.02 + (1.0 if "norm" in n else 0.0)).to(dtype)
               for n, s in NAMES.items()}
    engine = {n: checksum_entry(t) for n, t in learner.items()}
    assert len(check_weights(learner.items(), engine, 1)["checked"]) == len(NAMES)  # no false alarm
    rng = random.Random(1)
    trials, missed_by_float_sums = 600, 0
    for _ in range(trials):
        name = rng.choice(sorted(NAMES))
        bad, i, x = _flip(learner[name], rng)
        got = dict(engine, **{name: checksum_entry(bad)})  # what the engine reports after that sync
        with pytest.raises(WeightSyncError, match=name.replace(".", r"\.")):
            check_weights(learner.items(), got, 1)
        floats_only = {n: {k: v for k, v in e.items() if k != "bits"} for n, e in got.items()}
        try:
            check_weights(learner.items(), floats_only, 1)
            missed_by_float_sums += 1
        except WeightSyncError:
            pass
    print(f"\n{dtype}: {trials}/{trials} flips caught; the float sums alone would have missed {missed_by_float_sums}")
    assert missed_by_float_sums > 0  # the exact check is what catches low-mantissa flips


# ------------------------------------------------------------------------ checkpoints


def _save(run_dir, step: int, ranks: int = 2, size: int = 4096):
    """What Learner.save_checkpoint writes: every rank's file + digest, then the COMPLETE manifest."""
    d = checkpoint_dir(run_dir, step)
    d.mkdir(parents=True)
    for r in range(ranks):
        f = d / f"rank{r:05d}.pt"
        f.write_bytes(os.urandom(size))
        write_digest(f)
    mark_complete(d, step)
    return d


def test_manifest_records_every_rank_file(tmp_path):
    d = _save(tmp_path, 2)
    files = json.loads((d / COMPLETE).read_text())["files"]
    assert sorted(files) == ["rank00000.pt", "rank00001.pt"] and verify_checkpoint(d) is None


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_rank_file", "torn_marker", "no_marker",
                                    "append"])
def test_damaged_newest_checkpoint_is_named_and_skipped_for_the_previous(tmp_path, damage):
    older, newest = _save(tmp_path, 2), _save(tmp_path, 4)
    f = newest / "rank00001.pt"
    if damage == "flip_byte":
        raw = bytearray(f.read_bytes())
        raw[1234] ^= 0x10
        f.write_bytes(bytes(raw))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:1000])
    elif damage == "append":
        f.write_bytes(f.read_bytes() + b"x")
    elif damage == "delete_rank_file":
        f.unlink()
    elif damage == "torn_marker":
        (newest / COMPLETE).write_text((newest / COMPLETE).read_text()[:25])
    else:
        (newest / COMPLETE).unlink()
    said = []
    assert latest_checkpoint(tmp_path, log=said.append) == older
    assert len(said) == 1 and str(newest) in said[0], said
    if damage in ("flip_byte", "truncate", "delete_rank_file", "append"):
        assert "rank00001.pt" in said[0]
    with pytest.raises(FileNotFoundError, match="step_000004"):  # named explicitly: refused, not loaded
        resolve_load(str(newest), tmp_path)
    assert resolve_load("latest", tmp_path) == older


def test_size_only_verification_still_catches_truncation(tmp_path):
    from megatron_rz.manifest import set_verify, verify_mode

    set_verify("size")  # recipe checkpoint.verify=size (megatron_rz.launch.runtime applies it)
    try:
        older, newest = _save(tmp_path, 1), _save(tmp_path, 2)
        (newest / "rank00000.pt").write_bytes(b"")
        assert latest_checkpoint(tmp_path, log=lambda m: None) == older
        flipped = _save(tmp_path, 3)  # same size, other bytes: sizes only do not re-read it
        f = flipped / "rank00000.pt"
        f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:])
        assert latest_checkpoint(tmp_path, log=lambda m: None) == flipped
        set_verify("hash")
        assert latest_checkpoint(tmp_path, log=lambda m: None) == older
    finally:
        set_verify("hash")
    assert verify_mode() == "hash"
    with pytest.raises(ValueError, match="'hash' or 'size'"):
        set_verify("md5")


def test_checkpoint_write_killed_midway_leaves_the_previous_loadable(tmp_path):
    """A process killed (SIGKILL) while writing step 6: no marker, so load=latest takes step 3."""
    older = _save(tmp_path, 3)
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from megatron_rz.loop.resume import checkpoint_dir
d = checkpoint_dir({str(tmp_path)!r}, 6); d.mkdir(parents=True)
with open(d / "rank00000.pt", "wb") as f:
    while True:
        f.write(os.urandom(1 << 16)); f.flush()
"""
    proc = subprocess.Popen([sys.executable, "-c", code])
    target = checkpoint_dir(tmp_path, 6) / "rank00000.pt"
    deadline = time.time() + 30
    while (not target.exists() or target.stat().st_size < 1 << 20) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert target.stat().st_size >= 1 << 20
    said = []
    assert latest_checkpoint(tmp_path, log=said.append) == older and "no COMPLETE marker" in said[0]


def test_legacy_marker_without_manifest_still_counts(tmp_path):
    d = checkpoint_dir(tmp_path, 5)
    d.mkdir(parents=True)
    (d / COMPLETE).write_text("step 5\n")
    assert latest_checkpoint(tmp_path) == d


# ------------------------------------------------------------------------ SIGTERM on the learner


class _Learner:
    def __init__(self):
        self.saved = []

    def save_checkpoint(self, d, step):
        d.mkdir(parents=True)
        (d / COMPLETE).write_text(f"step {step}\n")
        self.saved.append(step)
        return d


@pytest.fixture
def sigterm(monkeypatch):
    old = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(preemption, "_terminated", False)
    monkeypatch.setattr(preemption, "_signalled", False)
    monkeypatch.delenv(preemption.PREEMPT_FILE_ENV, raising=False)
    yield
    signal.signal(signal.SIGTERM, old)


def test_sigterm_before_the_loop_exits_at_once(sigterm):
    preemption.install_sigterm_exit()
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert e.value.code == 143


def test_sigterm_in_the_loop_checkpoints_that_step_then_exits_143(sigterm, tmp_path):
    preemption.arm_sigterm_checkpoint()
    lrn = _Learner()
    preemption.checkpoint_and_exit_if_requested(lrn, tmp_path, 1, 10)  # no signal yet: nothing
    os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 2: only noted
    assert lrn.saved == []
    with pytest.raises(SystemExit) as e:
        preemption.checkpoint_and_exit_if_requested(lrn, tmp_path, 2, 10)
    assert e.value.code == 143 and lrn.saved == [2]
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)
    assert not (tmp_path / preemption.MARKER).exists()  # a stop, not a preemption: nothing requeues it
    with pytest.raises(SystemExit):  # a second SIGTERM stops at once
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)


# ------------------------------------------------------------------------ a dead rollout engine


@pytest.mark.parametrize("error", ["RolloutEngineError", "RolloutProcessError", "WeightSyncError", "OSError"])
def test_dead_engine_stops_the_run_with_one_line_naming_the_checkpoint(tmp_path, capsys, monkeypatch, error):
    """What rz train prints when the engine dies mid-run (SIGKILL of vLLM: RolloutEngineError from
    the engine client, RolloutProcessError from the async rollout process) or a sync fails its
    verification, or the disk fills up: one line, exit 1, and the checkpoint load=latest will resume from."""
    import megatron_rz.loop.rollout_process as at
    import megatron_rz.loop.trainer as tr
    import vllm_bridge.engine as eng
    from megatron_rz import cli

    run = tmp_path / "run"
    import errno

    cls = {"RolloutEngineError": eng.RolloutEngineError, "RolloutProcessError": at.RolloutProcessError,
           "WeightSyncError": eng.WeightSyncError, "OSError": OSError}[error]

    def dies(recipe):
        _save(run, 4)
        if cls is OSError:  # the disk filled up while a checkpoint was written
            raise OSError(errno.ENOSPC, "No space left on device")
        raise cls("vLLM engine core (pid 1234) died during generate (exit -9)")

    monkeypatch.setattr(tr, "train", dies)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # keep pytest's own SIGTERM handling
    rc = cli.main(["train", str(ROOT / "recipes" / "tiny_moe.yaml"), f"logging.run_dir={run}", "logging.wandb=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "Traceback" not in err[0], err
    said = "[Errno 28] No space left on device" if cls is OSError else "vLLM engine core (pid 1234) died"
    assert err[0].startswith(f"rz: stopped: {error}: {said}")
    assert str(checkpoint_dir(run, 4)) in err[0] and "checkpoint.load=latest" in err[0]
    assert not (run / "rz.lock").exists()  # the lock is released on the way out


# ------------------------------------------------------------------------ engine restart (sync trainer)


class _Rollout:
    """InlineRollout as fetch_batch uses it; its engine dies `deaths` times mid-batch."""

    pad_id = 0

    def __init__(self, deaths: int, restartable: bool = True, budget: int = 2):
        self.deaths, self.restarts, self.calls, self.pushed = deaths, 0, [], []
        self.restartable, self.budget = restartable, budget

    def batch(self, k):
        from megatron_rz.loop.resume import step_rng
        from vllm_bridge.samples import Sample

        self.calls.append((k, step_rng(0, 5 + k).random()))
        if len(self.calls) <= self.deaths:
            raise __import__("vllm_bridge.engine", fromlist=["x"]).RolloutEngineError("engine core died (-9)")
        s = [Sample([1, 2], [3, 4], [-0.5, -0.25], [7, 7], "stop", group=0, reward=r) for r in (0.0, 1.0)]
        return s, {"k": k}

    def restart(self, error, step, version):  # InlineRollout.restart's budget rule
        if not self.restartable or self.restarts >= self.budget:
            return False
        self.restarts += 1
        return True

    def push_weights(self, buckets, version, verify=False):
        self.pushed.append((list(buckets), version))


class _PushLearner:
    version = 7

    def hf_weight_buckets(self):
        yield {"model.norm.weight": torch.ones(2)}


class _DyingPush(_Rollout):
    """Its engine dies during the first ``pushes_dying`` weight pushes, after reading one bucket."""

    def __init__(self, pushes_dying: int, error=None, **kw):
        super().__init__(deaths=0, **kw)
        self.pushes_dying, self.error, self.attempts = pushes_dying, error, 0

    def push_weights(self, buckets, version, verify=False):
        from vllm_bridge.engine import RolloutEngineError

        self.attempts += 1
        if self.attempts <= self.pushes_dying:
            next(iter(buckets))
            raise self.error or RolloutEngineError("engine core died (-9) during the weight push")
        super().push_weights(buckets, version, verify)


def test_weight_push_restarts_a_dead_engine_and_pushes_again():
    from megatron_rz.loop.trainer import push_weights
    from vllm_bridge.engine import RolloutEngineError

    ro = _DyingPush(1)
    assert push_weights(_PushLearner(), ro, 3, verify=False) == 8  # the second push's bytes (2 fp32)
    assert ro.restarts == 1 and ro.attempts == 2 and [v for _, v in ro.pushed] == [7]
    with pytest.raises(RolloutEngineError):  # past the restart budget the error stops the run
        push_weights(_PushLearner(), _DyingPush(3), 3, verify=False)
    with pytest.raises(ValueError, match="bad bucket"):  # any other error is not retried
        push_weights(_PushLearner(), _DyingPush(1, error=ValueError("bad bucket")), 3, verify=False)


def test_dead_engine_is_restarted_with_current_weights_and_the_batch_reruns_identically():
    from megatron_rz.loop.rollout_process import RolloutProcessError
    from megatron_rz.loop.trainer import fetch_batch
    from vllm_bridge.engine import RolloutEngineError

    ro = _Rollout(deaths=2)
    batch, meta = fetch_batch(_PushLearner(), ro, 0, 5, 0)
    assert meta == {"k": 0} and batch.rewards.tolist() == [0.0, 1.0]
    assert ro.restarts == 2 and [v for _, v in ro.pushed] == [7, 7]  # the new engine got version 7 each time
    assert all(torch.equal(b[0]["model.norm.weight"], torch.ones(2)) for b, _ in ro.pushed)
    assert len(set(ro.calls)) == 1, "the re-run must draw the same prompts (same rng per step)"
    with pytest.raises(RolloutEngineError):  # the budget is per run: the third death stops it
        fetch_batch(_PushLearner(), _Rollout(deaths=3), 0, 5, 0)
    with pytest.raises(RolloutEngineError):  # remote engines (vLLM servers) are not restarted
        fetch_batch(_PushLearner(), _Rollout(deaths=1, restartable=False), 0, 5, 0)
    with pytest.raises(RolloutProcessError, match="lag bound violated"):  # the consumer-side check
        fetch_batch(type("L", (), {"version": 9})(), _Rollout(deaths=0), 0, 5, 0)
