"""Which weight transport a run uses: the recipe's ``rollout.weight_transport``, one compatibility
table, one factory. Nothing else in the project chooses a transport.

    auto        for one engine in the trainer's process (schedule.max_lag=0, rollout.where=local):
                ipc on a CUDA machine (learner and engine colocated: 0.21 s for 848 MB on an H100,
                against 3.4 s in-process), inprocess on CPU; filesystem otherwise (the rollout process
                of an asynchronous run; the vLLM servers of a job)
    inprocess   safetensors bytes over collective_rpc into an engine of this process
    filesystem  a version directory of bucket files the engine's workers read themselves
    nccl        vLLM's NCCL weight-transfer API (CUDA): rank 0 broadcasts each bucket to the workers
    ipc         CUDA IPC handles (colocated learner and engine, CUDA): each bucket packed into one
                device buffer the workers copy from, device to device (weights/ipc.py)
    reshard     every learner rank writes only its slices of each engine worker's shard

Torch-free (the recipe validates with it before anything starts); the transports themselves are
imported when one is built.
"""

from __future__ import annotations

import os
from pathlib import Path

from kernels.families import FAMILIES

__all__ = ["TRANSPORTS", "WEIGHTS_DIR", "RESHARD_ARCHS", "resolve", "refusal", "make_transport"]

TRANSPORTS = ("auto", "inprocess", "filesystem", "nccl", "ipc", "reshard")
WEIGHTS_DIR = "rollout/weights"  # the one weight directory of a run (file-backed transports)
RESHARD_ARCHS = tuple(f.name for f in FAMILIES if f.reshard_pieces)  # the learners that list their HF pieces

# (transport, engine placement) -> why not; placements: "inline" (one engine in the trainer's
# process, max_lag 0), "process" (the asynchronous rollout process, max_lag > 0), "servers" (a job's
# vLLM servers). A pair missing here is supported.
_NOT_SUPPORTED = {
    ("inprocess", "process"): "schedule.max_lag > 0 puts the engine in the rollout process, not the trainer's",
    ("inprocess", "servers"): "rollout.where=servers: the engines are the job's vLLM servers",
    ("nccl", "process"): "schedule.max_lag > 0: the rollout process applies bucket files between engine steps",
    ("nccl", "servers"): "rollout.where=servers: the servers' workers read bucket files (their NCCL rendezvous is not wired)",
    ("ipc", "process"): "schedule.max_lag > 0: the rollout process applies bucket files between engine steps",
    ("ipc", "servers"): "rollout.where=servers: the servers' workers read bucket files",
    ("reshard", "process"): "schedule.max_lag > 0: the rollout process applies full-copy versions",
    ("reshard", "servers"): "rollout.where=servers: the servers read full-copy versions",
}


def placement(where: str, max_lag: int) -> str:
    if where == "servers":
        return "servers"
    return "inline" if int(max_lag) == 0 else "process"


def resolve(kind: str, *, where: str = "local", max_lag: int = 0, cuda: bool = False) -> str:
    """The concrete transport of ``kind`` for this engine placement (``auto`` decided; ``cuda``:
    the engine runs on this machine's CUDA devices)."""
    if kind != "auto":
        return kind
    if placement(where, max_lag) == "inline":
        return "ipc" if cuda else "inprocess"
    return "filesystem"


def refusal(kind: str, *, where: str, max_lag: int, mode: str, arch: str, cuda: bool | None = None) -> str | None:
    """One line naming ``rollout.weight_transport`` and the fix when the pair is not supported, else
    None. ``arch``: the recipe's model family (reshard needs one whose learner lists its HF pieces
    per rank, RESHARD_ARCHS); ``cuda``: whether this machine has CUDA (None: not checked, e.g. a
    recipe validated on a login node for a job elsewhere)."""
    if kind not in TRANSPORTS:
        return f"rollout.weight_transport={kind!r}: expected one of {', '.join(TRANSPORTS)}"
    place = placement(where, max_lag)
    why = _NOT_SUPPORTED.get((kind, place))
    if why is None and kind == "reshard":
        if mode != "aligned":
            why = f"mode={mode}: the stock vLLM classes report no shard layout (needs mode=aligned)"
        elif arch not in RESHARD_ARCHS:
            why = f"model.arch={arch}: its learner lists no per-rank HF pieces (needs {', '.join(RESHARD_ARCHS)})"
    if why is None and kind == "nccl" and cuda is False:
        why = "this machine has no CUDA device (vLLM's NCCL weight transfer is GPU only)"
    if why is None and kind == "ipc" and cuda is False:
        why = "this machine has no CUDA device (CUDA IPC handles are GPU only)"
    if why is None:
        return None
    return f"rollout.weight_transport={kind} cannot be used here: {why}; use rollout.weight_transport=auto"


def make_transport(kind: str, *, run_dir: str | os.PathLike, engine=None, where: str = "local", max_lag: int = 0,
                   cuda: bool = False, background_bytes: int = 0):
    """The transport instance for this run: ``kind`` resolved (``auto``; ``cuda``: the engine runs on
    CUDA), files under ``run_dir``/WEIGHTS_DIR; ``engine`` the in-process engine (inprocess, nccl, ipc);
    ``background_bytes``: the filesystem transport's host-memory budget for background writes."""
    kind = resolve(kind, where=where, max_lag=max_lag, cuda=cuda)
    directory = Path(run_dir) / WEIGHTS_DIR
    if kind == "inprocess":
        from vllm_bridge.weights.inprocess import InProcessTransport

        return InProcessTransport(engine)
    if kind == "filesystem":
        from vllm_bridge.weights.filesystem import FilesystemTransport

        return FilesystemTransport(directory, background_bytes=background_bytes)
    if kind == "reshard":
        from vllm_bridge.weights.reshard import ShardedFilesystemTransport

        return ShardedFilesystemTransport(directory)
    if kind == "nccl":
        from vllm_bridge.weights.nccl import nccl_for_engine

        return nccl_for_engine(engine)
    if kind == "ipc":
        from vllm_bridge.weights.ipc import IPCTransport

        return IPCTransport(engine)
    raise ValueError(f"rollout.weight_transport={kind!r}: expected one of {', '.join(TRANSPORTS)}")
