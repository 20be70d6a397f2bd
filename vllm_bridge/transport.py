"""Weight transport: how a learner's new weights reach a rollout engine.

What travels is a *bucketed stream* of (Hugging Face name, tensor) plus one version number: the
learner (megatron_rz.loop.weights.hf_buckets) yields buckets of about ``bucket_bytes``
on its rank 0, so no rank ever holds more than one bucket beyond its own shards. A transport
moves the stream to an engine; the engine applies it with its one staging protocol
(RolloutEngine.apply_weights: abort -> stage every bucket -> commit (one in-place reload) ->
version -> prefix-cache reset). Implementations:

* ``InProcessTransport(engine)``: the engine lives in this process (RolloutEngine on rank 0);
  each bucket is serialised to safetensors bytes and staged over vLLM's collective_rpc.
* ``FilesystemTransport(directory)``: each version becomes a directory of safetensors bucket
  files on the run directory (shared in a job), written under a temporary name and renamed
  (a reader never sees a partial version). The push returns a ``WeightUpdate`` (version +
  bucket paths) that travels to wherever the engine is (a rollout process, a rollout node) and is
  applied there with ``apply``; the worker reads the files itself, so tensors never cross a pipe.
* ``NCCLTransport``: GPU only; the learner's rank 0 broadcasts each bucket to the engine's
  workers through vLLM's own weight-transfer API (init_weight_transfer_engine /
  start_weight_update / update_weights / finish_weight_update, backend "nccl"); the engine
  then only relabels its version and resets its prefix cache.
* ``vllm_bridge.reshard.ShardedFilesystemTransport`` (rollout.weight_sync=reshard): no bucket
  stream; every learner rank writes its slices of each engine worker's shard and each worker reads
  only its own (docs/tp.md "Resharding learner -> engine"), verified per parameter by
  ``reshard.check_resharded``.

Verification after a sync, every parameter (``SyncCheck``; the training loop's, for every
transport): each engine worker reports what it holds (worker_ext.rz_verify_layout: every parameter of
an aligned class with the box of the Hugging Face tensor it holds, a TP shard or the whole tensor);
while the learner's tensors stream past, the exact byte checksum (worker_ext.tensor_bits) of each
worker's box of each tensor is computed, in the engine parameter's dtype; after the commit every
worker checksums every parameter where it lives (rz_shard_checksums, on the device on GPU) and
any difference, missing or unexpected parameter raises WeightSyncError naming it. The same bits
and boxes as the resharded sync's check (vllm_bridge.reshard). A stock vLLM class (mode=fast)
keeps only embeddings, norms and router gates in checkpoint layout: only those are compared, and
the rest is reported as unverified. ``check_weights`` is the older readable-tensor comparison
(RolloutEngine.verify_sync).

Runs on both sides; never imports megatron (the learner imports this module, not the reverse).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_bridge.worker_ext import is_readable_name, tensor_bits, tensor_checksum

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
    abort whatever is half-staged, stage each payload (safetensors bytes, or the path of a
    safetensors file the worker reads itself), commit them all with one in-place reload
    (worker_ext). On failure the staged buckets are aborted (when ``alive()``) and the error
    re-raised: the old weights stay. Returns the first worker's commit info plus "staged"
    (payloads), "bytes" and "workers" (the last stage call's per-worker results). ``stage``: the
    worker method that stages one payload; "rz_stage_shards" stages a resharded version directory,
    each worker reading only its own rank's parts (vllm_bridge.reshard). The caller then sets the
    version label and resets the prefix cache."""
    staged = n_bytes = 0
    workers: list = []
    rpc("rz_abort_weights")
    try:
        for payload in payloads:
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
        raise NotImplementedError(f"the {self.name} transport applies as it pushes")

    def release(self, update: WeightUpdate) -> None:
        return None

    def close(self) -> None:
        return None


class InProcessTransport(WeightTransport):
    """Buckets staged straight into an engine of this process (safetensors bytes per RPC)."""

    name = "inprocess"

    def __init__(self, engine):
        self.engine = engine

    def push(self, buckets: Iterable[Bucket], version: int, *, reload: bool = True) -> WeightUpdate:
        t0 = time.perf_counter()
        info = self.engine.apply_weights((to_safetensors(b) for b in buckets), version, reload=reload)
        info["total_s"] = time.perf_counter() - t0
        return WeightUpdate(int(version), [], info)


def version_dir(directory: str | os.PathLike, version: int) -> Path:
    return Path(directory) / f"v{int(version):06d}"


class FilesystemTransport(WeightTransport):
    """Versions as directories of safetensors bucket files under ``directory``."""

    name = "filesystem"

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def push(self, buckets: Iterable[Bucket], version: int) -> WeightUpdate:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        final = version_dir(self.directory, version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        names, n_bytes = 0, 0
        for i, bucket in enumerate(buckets):
            path = tmp / f"bucket-{i:05d}.safetensors"
            save_file({k: v.detach().cpu().contiguous() for k, v in bucket.items()}, str(path),
                      metadata={"format": "pt"})
            names += len(bucket)
            n_bytes += path.stat().st_size
        if final.exists():  # a re-push of the same version (a restarted step): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        paths = sorted(str(p) for p in final.glob("bucket-*.safetensors"))
        return WeightUpdate(int(version), paths, {"version": int(version), "num_tensors": names,
                                                  "bytes": n_bytes, "write_s": time.perf_counter() - t0})

    @staticmethod
    def apply(update: WeightUpdate, engine) -> dict:
        """Stage the version's bucket files (the worker reads them) and commit them."""
        return engine.apply_weights(list(update.paths), update.version)

    @staticmethod
    def release(update: WeightUpdate) -> None:
        if update.paths:
            shutil.rmtree(Path(update.paths[0]).parent, ignore_errors=True)


class LLMWeightSyncClient:
    """vLLM's trainer-side weight-sync protocol (VLLMWeightSyncClient: four calls taking dicts)
    over an offline ``vllm.LLM`` of this process (RolloutEngine.llm). A vLLM server is driven the
    same way by vLLM's own HTTPVLLMWeightSyncClient."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update()  # the version: RolloutEngine.set_weight_version (0.26 has no argument)


def _fields(cls) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {}))


class NCCLTransport(WeightTransport):
    """The learner's rank 0 (NCCL rank 0) broadcasts every bucket to the engine's workers (ranks
    1..world_size-1) through vLLM's weight-transfer API; the engine must have been started with
    ``weight_transfer_config={"backend": "nccl"}``. CUDA only. ``client``: vLLM's four-call
    weight-sync client (LLMWeightSyncClient for an engine of this process, vLLM's
    HTTPVLLMWeightSyncClient for a server); ``engine``: what gets ``set_weight_version`` at the end.

    One push: start_weight_update (the workers begin a layerwise reload), then per bucket one
    update_weights round (that bucket's names / dtypes / shapes; the workers receive while this
    side broadcasts), then finish_weight_update (the reload is finalised) and the engine's
    set_weight_version (label + prefix-cache reset): the tail of the staging protocol.

    Written against vLLM 0.32 (packed-transfer settings agreed once at init) and 0.26 (the CUDA
    build on the H200, where they travel with every update): the differences are dict keys."""

    name = "nccl"

    def __init__(self, client, *, master_address: str, master_port: int, world_size: int, engine=None,
                 packed: bool = True):
        from concurrent.futures import ThreadPoolExecutor

        from vllm.distributed.weight_transfer import nccl_common, nccl_engine
        from vllm.distributed.weight_transfer.packed_tensor import (DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                                                                    DEFAULT_PACKED_NUM_BUFFERS)

        if not torch.cuda.is_available():
            raise RuntimeError("NCCLTransport needs CUDA (vLLM's NCCL weight transfer); use the filesystem "
                               "or in-process transport on CPU")
        self.client, self.engine, self.packed = client, engine, bool(packed)
        self.wire = {"packed": self.packed, "packed_buffer_size_bytes": DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                     "packed_num_buffers": DEFAULT_PACKED_NUM_BUFFERS}
        rendezvous = {"master_address": master_address, "master_port": int(master_port), "world_size": int(world_size)}
        worker = {**rendezvous, "rank_offset": 1}
        if "packed" in _fields(nccl_common.NCCLWeightTransferInitInfo):  # 0.32: agreed once, here
            worker.update(self.wire)
            self.per_update: dict = {}
        else:  # 0.26: with every update_weights
            self.per_update = self.wire if "packed" in _fields(nccl_engine.NCCLWeightTransferUpdateInfo) else {}
        # the workers block in their rendezvous until this side opens NCCL rank 0: both at once
        with ThreadPoolExecutor(max_workers=1) as ex:
            fut = ex.submit(client.init_weight_transfer_engine, worker)
            self.group = nccl_common.trainer_init(rendezvous)
            fut.result()

    def _broadcast(self, bucket: Bucket) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        if self.packed:
            packed_nccl_broadcast_producer(
                iterator=iter(list(bucket.items())), group=self.group, src=0, post_iter_func=lambda item: item[1],
                buffer_size_bytes=self.wire["packed_buffer_size_bytes"], num_buffers=self.wire["packed_num_buffers"])
        else:
            stream = torch.cuda.current_stream()
            for t in bucket.values():
                self.group.broadcast(t, src=0, stream=stream)

    def push(self, buckets: Iterable[Bucket], version: int) -> WeightUpdate:
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()
        n_tensors = n_bytes = 0
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as ex:
            for bucket in buckets:
                bucket = {k: v.detach().cuda().contiguous() for k, v in bucket.items()}
                meta = {"names": list(bucket), "dtype_names": [str(v.dtype).split(".")[-1] for v in bucket.values()],
                        "shapes": [list(v.shape) for v in bucket.values()], **self.per_update}
                fut = ex.submit(self.client.update_weights, meta)  # the workers receive ...
                self._broadcast(bucket)  # ... while rank 0 sends
                fut.result()
                n_tensors += len(bucket)
                n_bytes += sum(v.numel() * v.element_size() for v in bucket.values())
        torch.cuda.current_stream().synchronize()
        self.client.finish_weight_update(str(int(version)))
        if self.engine is not None:
            self.engine.set_weight_version(int(version))
        return WeightUpdate(int(version), [], {"version": int(version), "num_tensors": n_tensors, "bytes": n_bytes,
                                               "total_s": time.perf_counter() - t0})

    def close(self) -> None:
        group, self.group = getattr(self, "group", None), None
        if group is not None:
            with contextlib.suppress(Exception):
                group.destroy()


def check_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], checksums: dict | Callable[[list[str]], dict],
                  version: int, *, rtol: float = 1e-6, min_checked: int = 1) -> dict:
    """The one weight verification, whatever the transport: the learner's readable tensors
    against an engine's checksums.

    ``checksums`` is the engine's {name: {"shape", "dtype", "sum", "wsum"[, "bits"]}} or a function
    of the wanted names returning it (RolloutEngine.engine_checksums). Only names that stay
    readable inside vLLM are compared (worker_ext.READABLE_SUFFIXES); "bits" (when reported) makes
    the comparison exact. Raises WeightSyncError on a mismatch or when fewer than ``min_checked``
    tensors could be compared (a check that checks nothing is not a check). Returns
    {"checked": [...], "max_rel_err": float}."""
    want = {n: t for n, t in named_tensors if is_readable_name(n)}
    got = checksums(sorted(want)) if callable(checksums) else checksums
    checked, bad, max_rel = [], [], 0.0
    for name, t in want.items():
        g = got.get(name)
        if g is None or list(t.shape) != g["shape"]:
            continue
        same_dtype = t.detach().cpu().to(getattr(torch, g["dtype"]))
        s, ws = tensor_checksum(same_dtype)
        scale = float(t.detach().double().abs().sum()) + 1e-12
        err = max(abs(s - g["sum"]), abs(ws - g["wsum"])) / scale
        max_rel = max(max_rel, err)
        checked.append(name)
        if not math.isfinite(err) or err > rtol:
            bad.append(f"{name} (rel err {err:.3g})")
        elif "bits" in g and tensor_bits(same_dtype) != g["bits"]:  # exact: any changed byte
            bad.append(f"{name} (bytes differ; rel err only {err:.3g})")
    if bad:
        raise WeightSyncError(
            f"engine weights differ from the learner's after sync to version {version}: "
            f"{len(bad)}/{len(checked)} checked tensors mismatch: {', '.join(bad[:8])}. The "
            "update did not reach the model (wrong names, dropped buckets, reload skipped)."
        )
    if len(checked) < min_checked:
        raise WeightSyncError(
            f"verify_sync could compare only {len(checked)} tensors (need {min_checked}); "
            f"names given: {len(want)} readable of those passed"
        )
    return {"checked": checked, "max_rel_err": max_rel}


def readable(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors check_weights can compare, copied out of a stream (a small part of a model:
    embeddings, norms, router gates), so a bucket stream can be verified after it was sent."""
    return {n: t.detach().cpu().clone() for n, t in named_tensors if is_readable_name(n)}


def verify_weights(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], **kw: Any) -> dict:
    """check_weights against an engine (anything with engine_checksums(names) and weight_version)."""
    return check_weights(named_tensors, engine.engine_checksums, engine.weight_version, **kw)


# ------------------------------------------------------------------ every parameter, every sync

_MOD = 1 << 64


def worker_targets(engine) -> list[tuple[str, Callable[..., list]]]:
    """(label, rpc) per engine process group: a local RolloutEngine is one (its collective_rpc reaches
    every worker); the vLLM servers' RolloutClient one per server (``worker_rpcs``)."""
    if hasattr(engine, "worker_rpcs"):
        return list(engine.worker_rpcs())
    return [("the rollout engine", engine.collective_rpc)]


class SyncCheck:
    """The every-parameter verification of one sync (see the module docstring).

    ``reports``: the workers' rz_verify_layout replies (``SyncCheck.layout_of(engine)``; ask once per
    engine and keep them). Feed it the learner's tensors as they are sent (``stream(buckets)``,
    ``add(name, tensor)``), then ``verify(engine, version)`` after the commit."""

    def __init__(self, reports: list[dict]):
        from vllm_bridge.shards import layout_from_reports

        reports = sorted(reports, key=lambda r: int(r["rank"]))
        self.layout = layout_from_reports([{"rank": r["rank"], "params": r["params"]} for r in reports])
        self.unverified = {n: b for r in reports for n, b in r.get("unverified", {}).items()}
        self.expected: dict[tuple[int, str], int] = {}
        self.wrong_shape: dict[tuple[int, str], str] = {}
        self._holders: dict[str, list[tuple[int, object]]] = {}
        for e, lay in enumerate(self.layout):
            for name, p in lay.items():
                self._holders.setdefault(name, []).append((e, p))
        self.bytes = 0
        self.seconds = 0.0

    @staticmethod
    def layout_of(engine) -> list[dict]:
        """The first engine target's rz_verify_layout replies (every worker's)."""
        return worker_targets(engine)[0][1]("rz_verify_layout")

    def add(self, name: str, t: torch.Tensor) -> None:
        """One learner tensor (its full Hugging Face tensor): the bits of every worker's box of it."""
        from vllm_bridge.shards import narrow

        held = self._holders.get(name)
        if not held:
            return  # no worker holds it (a tied lm_head, MTP layers, another stage's layers)
        t0 = time.perf_counter()
        done: dict = {}
        for e, p in held:
            if tuple(t.shape) != tuple(p.shape):
                self.wrong_shape[(e, name)] = f"learner {tuple(t.shape)}, engine full tensor {tuple(p.shape)}"
                continue
            key = (p.box, p.dtype)
            if key not in done:
                x = narrow(t.detach(), p.box)
                if str(x.dtype).replace("torch.", "") != p.dtype:
                    x = x.to(getattr(torch, p.dtype))
                done[key] = tensor_bits(x) % _MOD
                self.bytes += x.numel() * x.element_size()
            self.expected[(e, name)] = done[key]
        self.seconds += time.perf_counter() - t0

    def stream(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """The bucket stream, unchanged, with every tensor added as it passes."""
        for b in buckets:
            for n, t in b.items():
                self.add(n, t)
            yield b

    def named(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "SyncCheck":
        for n, t in named_tensors:
            self.add(n, t)
        return self

    def compare(self, reported: list[dict], version: int, where: str = "the rollout engine") -> dict:
        """``reported[e]``: worker e's rz_shard_checksums "sums". Raises WeightSyncError (one line)
        naming every parameter whose bytes differ, that the learner did not send, or that the
        worker did not report."""
        bad, ranks, checked = [], [], 0
        if len(reported) != len(self.layout):
            raise WeightSyncError(f"weight sync to version {version}: {where} reported {len(reported)} workers, its "
                                  f"layout has {len(self.layout)}")
        for e, lay in enumerate(self.layout):
            for name, p in lay.items():
                got, want = reported[e].get(name), self.expected.get((e, name))
                if (e, name) in self.wrong_shape:
                    bad.append(f"rank {e} {name} (shape: {self.wrong_shape[(e, name)]})")
                elif want is None:
                    bad.append(f"rank {e} {name} (not sent by the learner)")
                elif got is None or [b - a for a, b in p.box] != list(got["shape"]):
                    bad.append(f"rank {e} {name} (not reported, or shape {None if got is None else got['shape']})")
                elif (int(got["bits"]) - want) % _MOD:
                    bad.append(f"rank {e} {name} (bytes differ)")
                if len(bad) > len(ranks):
                    ranks.append(e)
                checked += 1
        if bad:
            raise WeightSyncError(
                f"{where} (worker {ranks[0]}): its weights differ from the learner's after the sync to version "
                f"{version}: {len(bad)}/{checked} parameters: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}. "
                "The update did not reach the model intact (a corrupted transfer, dropped buckets, a skipped reload)")
        if checked == 0:
            raise WeightSyncError(f"weight sync to version {version}: {where} holds no parameter the check can compare "
                                  "(rollout.verify_sync=false turns the check off)")
        return {"checked": checked}

    def verify(self, engine, version: int) -> dict:
        """Every worker of every engine target against the learner's bits. Returns {"checked"
        (parameters per target), "targets", "bytes" (learner bytes checksummed), "learner_s",
        "engine_s" (read-back, all targets), "unverified" (parameters a stock class holds in a
        layout that is not the checkpoint's), "unverified_bytes"}."""
        t0 = time.perf_counter()
        checked = 0
        targets = worker_targets(engine)
        names = sorted({n for lay in self.layout for n in lay})
        for label, rpc in targets:
            reported = [x["sums"] for x in sorted(rpc("rz_shard_checksums", names), key=lambda x: int(x["rank"]))]
            checked = self.compare(reported, version, label)["checked"]
        return {"checked": checked, "targets": len(targets), "bytes": self.bytes, "learner_s": self.seconds,
                "engine_s": time.perf_counter() - t0, "unverified": len(self.unverified),
                "unverified_bytes": sum(self.unverified.values())}
