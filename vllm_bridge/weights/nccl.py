"""NCCL transport (GPU only): the learner's rank 0 broadcasts every bucket to the engine's
workers through vLLM's own weight-transfer API (init_weight_transfer_engine / start_weight_update /
update_weights / finish_weight_update, backend "nccl"); the engine then only relabels its version
and resets its prefix cache."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

import torch

from vllm_bridge.weights.buckets import Bucket, WeightTransport, WeightUpdate


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineNCCLTransport(WeightTransport):
    """rollout.weight_transport=nccl for the engine of this process (schedule.max_lag=0): an
    NCCLTransport over vLLM's weight-sync client of that engine, its group opened on the first
    delivery and opened again when the engine was replaced (a restarted engine has new workers).
    The engine must have been started with ``weight_transfer_config={"backend": "nccl"}``
    (Recipe.engine_kwargs adds it) on GPUs other than the learner's rank 0 (NCCL refuses two ranks
    on one device)."""

    name = "nccl"

    def __init__(self, engine=None):
        self.engine = engine
        self._nccl: NCCLTransport | None = None
        self._of = None

    def _for(self, engine) -> NCCLTransport:
        if self._nccl is None or self._of is not engine:
            self.close()
            workers = len(engine.worker_pids()) or 1
            self._nccl = NCCLTransport(LLMWeightSyncClient(engine.llm), master_address="127.0.0.1",
                                       master_port=_free_port(), world_size=1 + workers, engine=engine)
            self._of = engine
        return self._nccl

    def push(self, buckets: Iterable[Bucket], version: int) -> WeightUpdate:
        if self.engine is None:
            raise RuntimeError("the NCCL transport needs the engine of this process (deliver(buckets, version, engine))")
        return self._for(self.engine).push(buckets, version)

    def deliver(self, buckets: Iterable[Bucket], version: int, engine=None) -> dict:
        if engine is not None:
            self.engine = engine
        return self.push(({k: v.cuda() for k, v in b.items()} for b in buckets), version).info

    def close(self) -> None:
        nccl, self._nccl = self._nccl, None
        if nccl is not None:
            nccl.close()


def nccl_for_engine(engine=None) -> EngineNCCLTransport:
    return EngineNCCLTransport(engine)
