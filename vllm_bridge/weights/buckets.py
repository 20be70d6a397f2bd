"""The weight stream and the engines' one staging protocol: buckets of (Hugging Face name,
tensor), their safetensors form, a pushed version as a receiver sees it (``WeightUpdate``), the
version-directory naming every file-backed transport uses, the ``WeightTransport`` interface and
``stage_and_commit`` (abort -> stage every payload -> commit with one in-place reload).

Runs on both sides; never imports megatron.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_BUCKET_BYTES = 64 << 20
Bucket = dict[str, torch.Tensor]


class WeightSyncError(RuntimeError):
    """The engine's weights do not match what the learner pushed."""


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 device: str | torch.device | None = "cpu") -> Iterator[Bucket]:
    """Group a (name, tensor) stream into buckets of at most ``bucket_bytes`` (a single larger
    tensor is a bucket of its own). Tensors are detached, contiguous copies that share no storage
    (safetensors refuses tied embeddings), moved to ``device`` (None: where they are)."""
    bucket: Bucket = {}
    size = 0
    for name, t in named_tensors:
        t = t.detach()
        if device is not None:
            t = t.to(device)
        t = t.contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def to_safetensors(bucket: Bucket) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in bucket.items()})


@dataclass
class WeightUpdate:
    """One pushed version as a receiver sees it: the version and, for the filesystem transport, the
    bucket files (in stream order). ``info``: the sender's timings and sizes."""

    version: int
    paths: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of a file-backed update, one bucket file in memory at a time."""
        from safetensors.torch import load_file

        for p in self.paths:
            yield from load_file(p).items()


def stage_and_commit(rpc: Callable[..., list], payloads: Iterable[bytes | str | os.PathLike], version: int, *,
                     reload: bool = True, alive: Callable[[], bool] = lambda: True,
                     stage: str = "rz_stage_weights") -> dict:
    """The workers' half of the staging protocol, however they are reached (``rpc(method, *args)``
    returns the per-worker results: RolloutEngine's collective_rpc, a server's /collective_rpc):
    abort whatever is half-staged, stage each payload (safetensors bytes, the path of a
    safetensors file the worker reads itself, or a dict: a CUDA IPC handle and its table, for
    ``stage="rz_stage_ipc"``), commit them all with one in-place reload
    (worker_ext). On failure the staged buckets are aborted (when ``alive()``) and the error
    re-raised: the old weights stay. Returns the first worker's commit info plus "staged"
    (payloads), "bytes" and "workers" (the last stage call's per-worker results). ``stage``: the
    worker method that stages one payload; "rz_stage_shards" stages a resharded version directory,
    each worker reading only its own rank's parts (vllm_bridge.weights.reshard). The caller then sets the
    version label and resets the prefix cache."""
    staged = n_bytes = 0
    workers: list = []
    rpc("rz_abort_weights")
    try:
        for payload in payloads:
            if isinstance(payload, dict):  # a device handle and its table (weights.ipc): sent as is
                n_bytes += int(payload["bytes"])
                workers = rpc(stage, payload)
            else:
                raw = isinstance(payload, (bytes, bytearray))
                n_bytes += len(payload) if raw else _path_bytes(payload)
                workers = rpc(stage, payload if raw else str(payload))
            staged += 1
        info = rpc("rz_commit_weights", int(version), bool(reload))[0]
    except BaseException:
        if alive():
            with contextlib.suppress(Exception):
                rpc("rz_abort_weights")
        raise
    return {**(info if isinstance(info, dict) else {}), "staged": staged, "bytes": n_bytes, "workers": workers}


def _path_bytes(path: str | os.PathLike) -> int:
    """A payload file's size; a version directory's files, all of them."""
    p = Path(path)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


class WeightTransport:
    """Send side: ``push(buckets, version)`` on the learner's rank 0 (the other ranks only walk
    the learner's collective bucket stream). Receive side: ``apply(update, engine)`` where the
    engine runs; ``release(update)`` once an update is applied or superseded."""

    name = "base"

    def push(self, buckets: Iterable[Bucket], version: int) -> WeightUpdate:
        raise NotImplementedError

    def apply(self, update: WeightUpdate, engine) -> dict:
        """Load a pushed version into ``engine`` (a transport that applies as it pushes returns the
        push's info)."""
        return dict(update.info)

    def release(self, update: WeightUpdate) -> None:
        return None

    def deliver(self, buckets: Iterable[Bucket], version: int, engine) -> dict:
        """The whole trip for an engine this side can reach: push, apply, release. Returns the
        apply's sizes and timings (the push's for transports that apply as they push)."""
        update = self.push(buckets, version)
        try:
            return self.apply(update, engine)
        finally:
            self.release(update)

    def close(self) -> None:
        return None


def version_dir(directory: str | os.PathLike, version: int) -> Path:
    return Path(directory) / f"v{int(version):06d}"


