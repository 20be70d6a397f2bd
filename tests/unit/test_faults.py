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


# Every kind of tensor of a tiny Qwen3-MoE (embeddings, attention, experts, norms, router), held by a
# two-worker tensor-parallel engine as the aligned class holds them: attention and experts split
# (dim, in two), the rest whole on both workers.
ALL = {"model.embed_tokens.weight": ((64, 128), None), "lm_head.weight": ((64, 128), None),
       "model.norm.weight": ((128,), None), "model.layers.0.input_layernorm.weight": ((128,), None),
       "model.layers.0.self_attn.q_norm.weight": ((32,), None),
       "model.layers.0.self_attn.q_proj.weight": ((128, 128), 0), "model.layers.0.self_attn.k_proj.weight": ((64, 128), 0),
       "model.layers.0.self_attn.v_proj.weight": ((64, 128), 0), "model.layers.0.self_attn.o_proj.weight": ((128, 128), 1),
       "model.layers.0.mlp.gate.weight": ((8, 128), None),
       **{f"model.layers.0.mlp.experts.{e}.{k}.weight": ((128, 128), 0 if k != "down_proj" else 1)
          for e in range(8) for k in ("gate_proj", "up_proj", "down_proj")}}


def _tp2_reports(dtype: str) -> list[dict]:
    """What two workers' rz_verify_layout report for ALL (the box of each full tensor they hold)."""
    out = []
    for r in (0, 1):
        params = {}
        for n, (shape, dim) in ALL.items():
            box = [[0, s] for s in shape]
            if dim is not None:
                half = shape[dim] // 2
                box[dim] = [r * half, (r + 1) * half]
            params[n] = {"shape": list(shape), "box": box, "dtype": dtype}
        out.append({"rank": r, "params": params, "unverified": {}})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_flipped_byte_in_any_parameter_of_any_worker_is_caught(dtype):
    """transport.SyncCheck against what each worker's rz_shard_checksums reports (worker_ext.bits_entry
    of the shard it holds): 600 random flips, each in a byte drawn uniformly from all the bytes the two
    workers hold, are all caught, each naming the worker and the parameter, nothing else."""
    from vllm_bridge.shards import narrow
    from vllm_bridge.weights.verify import SyncCheck
    from vllm_bridge.worker_ext import bits_entry

    g = torch.Generator().manual_seed(0)
    learner = {n: (torch.randn(shape, generator=g) * 0.02).to(dtype) for n, (shape, _) in ALL.items()}
    reports = _tp2_reports(str(dtype).replace("torch.", ""))
    check = SyncCheck(reports).named(learner.items())
    held = [{n: narrow(learner[n], tuple(map(tuple, p["box"]))).clone() for n, p in rep["params"].items()}
            for rep in reports]
    reported = [{n: bits_entry(t) for n, t in w.items()} for w in held]
    assert check.compare(reported, 1)["checked"] == 2 * len(ALL)  # no false alarm
    slots = [(r, n) for r in (0, 1) for n in sorted(held[r])]
    sizes = [held[r][n].numel() * held[r][n].element_size() for r, n in slots]
    rng, kinds = random.Random(1), {}
    for _ in range(600):
        r, n = rng.choices(slots, weights=sizes)[0]
        bad, _, _ = _flip(held[r][n], rng)
        got = [dict(w) for w in reported]
        got[r][n] = bits_entry(bad)
        with pytest.raises(WeightSyncError) as e:
            check.compare(got, 1)
        assert f"(worker {r})" in str(e.value) and f": rank {r} {n} (bytes differ)." in str(e.value), e.value
        kind = "experts" if ".experts." in n else "attention" if "_proj" in n else "other"
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"\n{dtype}: 600/600 flips caught over {len(slots)} (worker, parameter) pairs: {kinds}")
    assert set(kinds) == {"experts", "attention", "other"}


def test_every_parameter_check_names_missing_and_misshapen_tensors():
    from vllm_bridge.shards import narrow
    from vllm_bridge.weights.verify import SyncCheck
    from vllm_bridge.worker_ext import bits_entry

    reports = _tp2_reports("float32")
    g = torch.Generator().manual_seed(0)
    learner = {n: torch.randn(shape, generator=g) for n, (shape, _) in ALL.items()}
    reported = [{n: bits_entry(narrow(learner[n], tuple(map(tuple, p["box"])))) for n, p in rep["params"].items()}
                for rep in reports]
    name = "model.layers.0.mlp.experts.5.up_proj.weight"
    check = SyncCheck(reports).named((k, v) for k, v in learner.items() if k != name)  # a dropped tensor
    with pytest.raises(WeightSyncError, match=f": 2/{2 * len(ALL)} parameters: rank 0 {name} \\(not sent by the learner\\), "
                       f"rank 1 {name} \\(not sent by the learner\\)\\."):
        check.compare(reported, 3)
    check = SyncCheck(reports).named(learner.items())
    with pytest.raises(WeightSyncError, match=f"\\(worker 1\\).*: 1/{2 * len(ALL)} parameters: rank 1 {name} \\(not reported"):
        check.compare([reported[0], {k: v for k, v in reported[1].items() if k != name}], 3)  # a worker lost one
    check = SyncCheck(reports).named({**learner, "model.norm.weight": torch.ones(64)}.items())
    with pytest.raises(WeightSyncError, match="rank 0 model.norm.weight \\(shape: learner \\(64,\\), engine full tensor "
                       "\\(128,\\)\\)"):
        check.compare(reported, 3)
    with pytest.raises(WeightSyncError, match="reported 1 workers, its layout has 2"):
        SyncCheck(reports).named(learner.items()).compare(reported[:1], 3)
    with pytest.raises(WeightSyncError, match="holds no parameter the check can compare"):  # a stock class, all packed
        SyncCheck([{"rank": 0, "params": {}, "unverified": {"model.layers.0.mlp.experts.w13_weight": 1 << 20}}]).compare([{}], 3)


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


# ------------------------------------------------------------------------ how a stopped run reports


@pytest.mark.parametrize("error", ["RolloutProcessError", "WeightSyncError", "OSError"])
def test_stopping_error_is_one_line_naming_the_checkpoint(tmp_path, capsys, monkeypatch, error):
    """The CLI's handling of the errors that stop a run (cli._train_or_stop), with train() replaced by
    one that writes a checkpoint and raises: the async rollout process died, a sync failed its
    verification, the disk filled up. One line, exit 1, the checkpoint load=latest resumes from, the
    lock released. (A really dead engine on a real run: tests/integration/test_reliability_dead_engine.py;
    engine restarts through the loop: tests/integration/test_verify_sync.py.)"""
    import errno

    import megatron_rz.loop.rollout_process as at
    import megatron_rz.loop.trainer as tr
    import vllm_bridge.engine as eng
    from megatron_rz import cli

    run = tmp_path / "run"
    cls = {"RolloutProcessError": at.RolloutProcessError, "WeightSyncError": eng.WeightSyncError, "OSError": OSError}[error]

    def stops(recipe):
        _save(run, 4)
        if cls is OSError:  # the disk filled up while a checkpoint was written
            raise OSError(errno.ENOSPC, "No space left on device")
        raise cls("rollout process (pid 1234) exited with code -9")

    monkeypatch.setattr(tr, "train", stops)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # keep pytest's own SIGTERM handling
    rc = cli.main(["train", str(ROOT / "recipes" / "tiny_moe.yaml"), f"logging.run_dir={run}", "logging.wandb=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "Traceback" not in err[0], err
    said = "[Errno 28] No space left on device" if cls is OSError else "rollout process (pid 1234) exited with code -9"
    assert err[0].startswith(f"rz: stopped: {error}: {said}")
    assert str(checkpoint_dir(run, 4)) in err[0] and "checkpoint.load=latest" in err[0]
    assert not (run / "rz.lock").exists()  # the lock is released on the way out


# ------------------------------------------------------------------------ weight-push errors (trainer)


class _FailingPush:
    """The rollout as push_weights uses it, whose push raises ``error``; records restart requests."""

    def __init__(self, error):
        self.error, self.restart_calls = error, []

    def push_weights(self, buckets, version, verify=False):
        next(iter(buckets))
        raise self.error

    def restart(self, error, step, version):
        self.restart_calls.append(type(error).__name__)
        return False  # the budget is spent (the real rule: test_verify_sync.py)


class _PushLearner:
    version = 7

    def export_hf_weights(self):
        yield "model.norm.weight", torch.ones(2)
        yield "model.embed_tokens.weight", torch.ones(2, 2)


def test_weight_push_asks_for_a_restart_only_when_the_engine_died():
    """push_weights (trainer._on_rank0): a dead engine (RolloutEngineError) asks the rollout for a
    restart and, refused, stops the run with the engine's error; any other error (a bad bucket, a
    failed verification) is raised at once, never retried."""
    from megatron_rz.loop.trainer import push_weights
    from vllm_bridge.engine import RolloutEngineError

    dead = _FailingPush(RolloutEngineError("engine core died (-9) during the weight push"))
    with pytest.raises(RolloutEngineError, match="died"):
        push_weights(_PushLearner(), dead, 3, verify=True)
    assert dead.restart_calls == ["RolloutEngineError"]
    for error in (ValueError("bad bucket"), WeightSyncError("the rollout engine (worker 0): its weights differ")):
        ro = _FailingPush(error)
        with pytest.raises(type(error)):
            push_weights(_PushLearner(), ro, 3, verify=True)
        assert ro.restart_calls == []
