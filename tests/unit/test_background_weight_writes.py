"""Background weight writes of the filesystem transport (an asynchronous run's learner): the learner's
weights may change as soon as the push returns, and the files still hold the pushed values; versions
reach the rollout complete and in push order; the host copies waiting for the writer stay within the
budget; a failed write is raised by the learner's next push or flush, naming the version, and the
rollout is never told about a version that was not written."""

from __future__ import annotations

import threading

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file

from vllm_bridge.weights.buckets import WeightSyncError, iter_buckets
from vllm_bridge.weights.filesystem import FilesystemTransport


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(64, 32, generator=g) for i in range(6)} | {"emb": torch.randn(100, 32, generator=g)}


def _read(update) -> dict[str, torch.Tensor]:
    out = {}
    for p in update.paths:
        out.update(load_file(p))
    return out


def test_files_hold_the_pushed_values_although_the_learner_moves_on(tmp_path):
    params = _params()
    want = {k: v.clone() for k, v in params.items()}
    t = FilesystemTransport(tmp_path / "weights", background_bytes=1 << 30)
    got = []
    info = t.push_background(iter_buckets(params.items(), bucket_bytes=20_000, device=None), 1, got.append)
    for v in params.values():  # the optimizer's next step, in place, before the writer is done
        v.add_(1.0)
    t.flush()
    assert info["background"] and info["num_tensors"] == len(params)
    assert info["bytes"] == sum(v.numel() * v.element_size() for v in params.values())
    assert [u.version for u in got] == [1]
    files = _read(got[0])
    assert files.keys() == want.keys() and all(torch.equal(files[k], want[k]) for k in want)
    assert len(got[0].paths) > 1  # several buckets, all in the renamed directory
    assert not list((tmp_path / "weights").glob("*.tmp"))
    t.close()


def test_versions_reach_the_rollout_complete_and_in_push_order(tmp_path):
    t = FilesystemTransport(tmp_path / "weights", background_bytes=1 << 30)
    seen = []

    def on_written(update):  # what the rollout gets: the directory is complete when it is told
        seen.append((update.version, _read(update)))

    pushed = {}
    for version in range(1, 6):
        params = _params(seed=version)
        pushed[version] = {k: v.clone() for k, v in params.items()}
        t.push_background(iter_buckets(params.items(), bucket_bytes=30_000, device=None), version, on_written)
    t.flush()
    assert [v for v, _ in seen] == [1, 2, 3, 4, 5]
    for v, files in seen:
        assert all(torch.equal(files[k], pushed[v][k]) for k in pushed[v])
    t.close()


def test_host_copies_waiting_for_the_writer_stay_within_the_budget(tmp_path, monkeypatch):
    budget = 30_000  # about three buckets of ~8 KB-12.8 KB
    t = FilesystemTransport(tmp_path / "weights", background_bytes=budget)
    peak = [0]
    gate = threading.Semaphore(0)
    real_save = safetensors.torch.save_file

    def slow_save(*a, **k):  # the writer takes a bucket only when the test lets it
        gate.acquire()
        peak[0] = max(peak[0], t.host_bytes_waiting)
        return real_save(*a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", slow_save)
    params = _params()
    got = []
    # the push runs beside a writer that is held: without the budget every copy would be queued at
    # once (peak = the whole model); with it the push waits at ~budget until the writer is let go
    pusher = threading.Thread(target=lambda: t.push_background(
        iter_buckets(params.items(), bucket_bytes=10_000, device=None), 1, got.append))
    pusher.start()
    pusher.join(0.3)
    assert pusher.is_alive()  # still waiting for the writer's budget
    for _ in range(100):
        gate.release()
    pusher.join()
    t.flush()
    total = sum(v.numel() * v.element_size() for v in params.values())
    biggest = max(v.numel() * v.element_size() for v in params.values())
    assert total > budget and 0 < peak[0] <= max(budget, biggest)
    assert [u.version for u in got] == [1] and _read(got[0]).keys() == params.keys()
    t.close()


def test_a_budget_of_zero_writes_inline_before_returning(tmp_path):
    t = FilesystemTransport(tmp_path / "weights", background_bytes=0)
    got = []
    info = t.push_background(iter_buckets(_params().items(), device=None), 7, got.append)
    assert not info["background"] and [u.version for u in got] == [7] and not t.writer_running
    assert _read(got[0]).keys() == _params().keys()


@pytest.mark.parametrize("where", ["directory", "bucket"])
def test_a_failed_write_is_raised_next_and_its_version_never_announced(tmp_path, monkeypatch, where):
    blocker = tmp_path / "weights"
    t = FilesystemTransport(blocker, background_bytes=1 << 30)
    if where == "directory":
        blocker.write_text("a file where the weights directory should be")
    else:
        def broken(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(safetensors.torch, "save_file", broken)
    got = []
    t.push_background(iter_buckets(_params().items(), device=None), 3, got.append)  # returns: the writer fails later
    with pytest.raises(WeightSyncError, match="writing weights version 3 in the background failed"):
        t.flush()
    with pytest.raises(WeightSyncError, match="version 3"):
        t.push_background(iter_buckets(_params().items(), device=None), 4, got.append)
    assert got == []
    t.close()


def test_flush_returns_only_after_the_rollout_was_told_of_the_last_version(tmp_path):
    # the run's end flushes, then asks for the final evaluation: the last version must be announced first
    t = FilesystemTransport(tmp_path / "weights", background_bytes=1 << 30)
    told, gate = [], threading.Event()

    def on_written(update):  # the announcement is held until the test lets it go
        gate.wait()
        told.append(update.version)

    t.push_background(iter_buckets(_params().items(), device=None), 9, on_written)
    flusher = threading.Thread(target=t.flush)
    flusher.start()
    flusher.join(0.3)
    assert flusher.is_alive() and told == []  # every byte is written; the announcement is not yet made
    gate.set()
    flusher.join()
    assert told == [9]
    t.close()
