"""Filesystem transport: each version a directory of safetensors bucket files (``v{version}``
under the run's weights directory, shared in a job), written under a temporary name and renamed,
so a reader never sees a partial version. The push returns a ``WeightUpdate`` (version + bucket
paths) that travels to wherever the engine is (a rollout process, a rollout node) and is applied
there; the worker reads the files itself, so tensors never cross a pipe.

Background writes (``push_background``; an asynchronous run's learner, rollout.background_write_gb > 0):
the learner's critical path holds only the copy of each bucket into host memory; one writer thread
writes the files, renames the version directory and then hands the finished ``WeightUpdate`` to the
caller's callback (which tells the rollout). Versions are written one at a time, in push order. The
host copies waiting for the writer are bounded by ``background_bytes``: a push that would exceed it
waits for the writer (a model larger than the budget is partly written on the critical path, never
held twice in host memory). A write that fails is raised by the next ``push_background`` or ``flush``.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from vllm_bridge.weights.buckets import Bucket, WeightSyncError, WeightTransport, WeightUpdate, version_dir


class FilesystemTransport(WeightTransport):
    """Versions as directories of safetensors bucket files under ``directory``; ``background_bytes``:
    the host-memory budget of background writes (0: ``push_background`` writes inline)."""

    name = "filesystem"

    def __init__(self, directory: str | os.PathLike, background_bytes: int = 0):
        self.directory = Path(directory)
        self.background_bytes = int(background_bytes)
        self._writer: _Writer | None = None

    def _begin(self, version: int) -> tuple[Path, Path]:
        final = version_dir(self.directory, version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return final, tmp

    @staticmethod
    def _write(tmp: Path, i: int, bucket: Bucket) -> int:
        from safetensors.torch import save_file

        path = tmp / f"bucket-{i:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in to_host(bucket).items()}, str(path), metadata={"format": "pt"})
        return path.stat().st_size

    @staticmethod
    def _commit(final: Path, tmp: Path, version: int, names: int, n_bytes: int, t0: float) -> WeightUpdate:
        if final.exists():  # a re-push of the same version (a restarted step): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        paths = sorted(str(p) for p in final.glob("bucket-*.safetensors"))
        return WeightUpdate(int(version), paths, {"version": int(version), "num_tensors": names,
                                                  "bytes": n_bytes, "write_s": time.perf_counter() - t0})

    def push(self, buckets: Iterable[Bucket], version: int) -> WeightUpdate:
        t0 = time.perf_counter()
        final, tmp = self._begin(version)
        names, n_bytes = 0, 0
        for i, bucket in enumerate(buckets):
            n_bytes += self._write(tmp, i, bucket)
            names += len(bucket)
        return self._commit(final, tmp, version, names, n_bytes, t0)

    def push_background(self, buckets: Iterable[Bucket], version: int,
                        on_written: Callable[[WeightUpdate], None]) -> dict:
        """Copy every bucket to host memory and queue it for the writer thread; ``on_written(update)``
        runs on that thread once the version directory is complete and renamed. Returns
        {"version", "num_tensors", "bytes" (tensor bytes), "copy_s" (this call: the critical path),
        "waited_s" (of it, waiting for the writer's budget), "background": True}. Raises the error
        of an earlier background write, if one failed. ``background_bytes`` 0: written inline."""
        if self.background_bytes <= 0:
            update = self.push(buckets, version)
            on_written(update)
            return {**update.info, "copy_s": update.info["write_s"], "waited_s": 0.0, "background": False}
        if self._writer is None:
            self._writer = _Writer(self, self.background_bytes)
        w = self._writer
        w.raise_error()
        t0 = time.perf_counter()
        w.put(("begin", int(version)), 0)
        names = n_bytes = 0
        for i, bucket in enumerate(buckets):
            # the learner's next update changes its weights in place: the writer gets its own host copy
            # (a bucket already on the host is the exporter's own clone: kept as it is)
            size = sum(t.numel() * t.element_size() for t in bucket.values())
            w.reserve(size)
            try:
                host = to_host(bucket)
            except BaseException:
                w.unreserve(size)
                raise
            w.put(("bucket", i, host), size)
            names += len(host)
            n_bytes += size
        w.put(("end", int(version), names, on_written), 0)
        return {"version": int(version), "num_tensors": names, "bytes": n_bytes,
                "copy_s": time.perf_counter() - t0, "waited_s": w.take_waited(), "background": True}

    @property
    def host_bytes_waiting(self) -> int:
        """Host bytes of background copies queued or being written now."""
        return self._writer.in_flight if self._writer is not None else 0

    @property
    def writer_running(self) -> bool:
        return self._writer is not None

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued version is written and handed on; raise a failed write's error."""
        if self._writer is not None:
            self._writer.join(timeout_s)
            self._writer.raise_error()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.stop()
            self._writer = None

    @staticmethod
    def apply(update: WeightUpdate, engine) -> dict:
        """Stage the version's bucket files (the worker reads them) and commit them."""
        return engine.apply_weights(list(update.paths), update.version)

    @staticmethod
    def release(update: WeightUpdate) -> None:
        if update.paths:
            shutil.rmtree(Path(update.paths[0]).parent, ignore_errors=True)


def to_host(bucket: Bucket) -> Bucket:
    """The bucket in host memory. CUDA tensors go into pinned buffers from torch's caching host
    allocator (reused version after version once the writer drops them), copied asynchronously and
    waited for once per bucket: on an H100, 0.85 GB in 0.016 s against 0.56-0.70 s into pageable
    memory (``.cpu()``). Host tensors are returned as they are."""
    import torch

    out, streams = {}, set()
    for k, v in bucket.items():
        v = v.detach()
        if v.is_cuda:
            h = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            h.copy_(v, non_blocking=True)
            streams.add(torch.cuda.current_stream(v.device))
            out[k] = h
        else:
            out[k] = v
    for st in streams:  # the copies are done before the caller may change the weights
        st.synchronize()
    return out


class _Writer:
    """The one background writer thread of a FilesystemTransport and its host-memory budget."""

    def __init__(self, transport: FilesystemTransport, budget: int):
        self.transport, self.budget = transport, budget
        self.items: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.in_flight = 0  # host bytes queued or being written
        self.waited = 0.0
        self.error: BaseException | None = None
        self.failed_version: int | None = None
        self.pending = 0  # items put and not yet finished by the thread (markers included)
        self.thread = threading.Thread(target=self._run, name="rz-weight-writer", daemon=True)
        self.thread.start()

    def reserve(self, size: int) -> None:
        """Count ``size`` host bytes in, first waiting while the writer holds copies and these would
        pass the budget (a single bucket larger than the budget still goes, alone)."""
        with self.cond:
            t0 = time.perf_counter()
            while self.in_flight and self.in_flight + size > self.budget and self.error is None:
                self.cond.wait(0.5)
            self.waited += time.perf_counter() - t0
            self.in_flight += size

    def unreserve(self, size: int) -> None:
        self._done(size)

    def put(self, item: tuple, size: int) -> None:
        """Queue an item whose ``size`` bytes were reserved (0 for markers)."""
        with self.cond:
            self.pending += 1
        self.items.put((item, size))

    def take_waited(self) -> float:
        with self.cond:
            w, self.waited = self.waited, 0.0
        return w

    def raise_error(self) -> None:
        if self.error is not None:
            raise WeightSyncError(f"writing weights version {self.failed_version} in the background failed: "
                                  f"{type(self.error).__name__}: {self.error}") from self.error

    def join(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while self.pending:
                if self.error is not None or (deadline is not None and time.monotonic() > deadline):
                    break
                self.cond.wait(0.2)

    def stop(self) -> None:
        self.items.put((None, 0))
        self.thread.join(5.0)

    def _done(self, size: int, item_done: bool = False) -> None:
        with self.cond:
            self.in_flight -= size
            self.pending -= int(item_done)
            self.cond.notify_all()

    def _run(self) -> None:
        final = tmp = None
        version, t0 = None, 0.0
        while True:
            item, size = self.items.get()
            if item is None:
                return
            try:
                if self.error is not None:
                    continue  # a failed version: drop what follows until the error is raised
                kind = item[0]
                if kind == "begin":
                    version, t0 = item[1], time.perf_counter()
                    final, tmp = self.transport._begin(version)
                    n_bytes = 0
                elif kind == "bucket":
                    n_bytes += self.transport._write(tmp, item[1], item[2])
                else:
                    _, version, names, on_written = item
                    on_written(self.transport._commit(final, tmp, version, names, n_bytes, t0))
            except BaseException as e:  # noqa: BLE001 - kept, raised on the learner's next push / flush
                self.error, self.failed_version = e, version
            finally:
                item = None  # the host copy goes now, before the budget is returned
                self._done(size, item_done=True)
