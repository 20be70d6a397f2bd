"""CUDA IPC transport (rollout.weight_transport=ipc): learner and engine on the same GPU(s), weights
handed over device to device, never through host memory or a serialiser.

Send side (the learner's rank 0): each bucket is packed into one contiguous CUDA byte buffer
(tensors at 256-byte aligned offsets); the buffer's CUDA IPC handle (torch's own
``torch.multiprocessing.reductions.reduce_tensor``: the caching allocator's block handle and the
offset) and the table (name, dtype, shape, offset, bytes) go to the engine's workers over
collective_rpc (``rz_stage_ipc``). Receive side (each worker, ``stage``): open the handle, copy each
tensor out of the producer's buffer into its own memory (one device-to-device copy), synchronise,
then return, so the producer may reuse its buffer for the next bucket. The staged tensors are then
committed with the one in-place reload of the staging protocol (buckets.stage_and_commit) and
verified like every other sync (verify.SyncCheck, every parameter).

An engine whose worker runs in this very process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) cannot open a
handle of its own process: the worker then takes the buffer from this module's table of live
buffers (``_LIVE``, keyed by the payload's key).

Where it applies: one engine in the trainer's process (schedule.max_lag=0, rollout.where=local)
on CUDA, learner rank 0 on the engine's GPU (the colocated layout). Engines on other GPUs of the same
host work too (CUDA IPC between peers), not measured here.
"""

from __future__ import annotations

import itertools
import os
import pickle
import time
from collections.abc import Iterable

import torch

from vllm_bridge.weights.buckets import Bucket, WeightTransport, WeightUpdate

ALIGN = 256
_LIVE: dict[int, torch.Tensor] = {}
_KEYS = itertools.count(1)


def pack(bucket: Bucket, device=None) -> tuple[torch.Tensor, list]:
    """One byte buffer on ``device`` (default: the first tensor's CUDA device) holding every tensor of
    ``bucket`` at ALIGN-byte offsets, and the table ``[(name, dtype name, shape, offset, nbytes)]``."""
    table, off = [], 0
    for name, t in bucket.items():
        n = t.numel() * t.element_size()
        table.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), off, n))
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    dev = device or next((t.device for t in bucket.values() if t.is_cuda), None) or torch.device("cuda")
    buf = torch.empty(max(off, 1), dtype=torch.uint8, device=dev)
    for (name, _, _, o, n), t in zip(table, bucket.values()):
        if n:
            buf[o:o + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
    return buf, table


def unpack(buf: torch.Tensor, table: list, device) -> dict[str, torch.Tensor]:
    """The tensors ``table`` describes inside ``buf``, as views of ONE copy of ``buf`` on ``device``
    (one allocation and one device-to-device copy per bucket, not one per tensor; the ALIGN-byte
    offsets keep every view aligned for its dtype). The copy never aliases ``buf``."""
    local = torch.empty(buf.numel(), dtype=torch.uint8, device=device)
    local.copy_(buf)
    out = {}
    for name, dtype, shape, o, n in table:
        dt = getattr(torch, dtype)
        out[name] = local[o:o + n].view(dt).view(shape) if n else torch.empty(shape, dtype=dt, device=device)
    return out


def stage(payload: dict, device) -> dict[str, torch.Tensor]:
    """The worker's half: the bucket's tensors, copied out of the producer's buffer (synchronised)."""
    if payload.get("pid") == os.getpid():
        buf = _LIVE[payload["key"]]
    else:
        rebuild, args = pickle.loads(payload["handle"])  # torch's own rebuild function and its arguments
        buf = rebuild(*args)
    tensors = unpack(buf, payload["table"], device)
    torch.cuda.synchronize(device)
    del buf
    return tensors


class IPCTransport(WeightTransport):
    """Buckets handed to an engine of this process by CUDA IPC handles (see the module docstring)."""

    name = "ipc"

    def __init__(self, engine=None):
        self.engine = engine

    def _payloads(self, buckets: Iterable[Bucket], timing: dict):
        from torch.multiprocessing.reductions import reduce_tensor

        for bucket in buckets:
            t = time.perf_counter()
            buf, table = pack({k: (v if v.is_cuda else v.cuda()) for k, v in bucket.items()})
            torch.cuda.current_stream().synchronize()  # the bytes are in place before a worker reads them
            key = next(_KEYS)
            _LIVE[key] = buf
            timing["pack_s"] += time.perf_counter() - t
            try:
                # pickled here: vLLM's RPC serialiser (msgspec) refuses the rebuild function it holds
                yield {"handle": pickle.dumps(reduce_tensor(buf)), "table": table, "key": key, "pid": os.getpid(),
                       "bytes": sum(row[4] for row in table)}
            finally:
                # the worker copied and synchronised before its RPC returned
                _LIVE.pop(key, None)
                del buf

    def push(self, buckets: Iterable[Bucket], version: int) -> WeightUpdate:
        if self.engine is None:
            raise RuntimeError("the IPC transport needs the engine of this process (deliver(buckets, version, engine))")
        if not torch.cuda.is_available():  # the recipe refuses ipc on a machine without CUDA first
            raise RuntimeError("rollout.weight_transport=ipc needs CUDA (CUDA IPC handles); use inprocess on CPU")
        t0 = time.perf_counter()
        timing = {"pack_s": 0.0}
        info = self.engine.apply_weights(self._payloads(buckets, timing), version, stage="rz_stage_ipc")
        info.update(timing, total_s=time.perf_counter() - t0)
        return WeightUpdate(int(version), [], info)

    def deliver(self, buckets: Iterable[Bucket], version: int, engine=None) -> dict:
        if engine is not None:
            self.engine = engine
        return self.push(buckets, version).info
