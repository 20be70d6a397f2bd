"""Resharding learner layout -> engine layout without a full copy (docs/tp.md "Resharding learner -> engine").

The full-copy weight sync (megatron_rz.loop.weights.hf_buckets) gathers every tensor whole to learner rank 0
and sends every whole tensor to every engine worker, which narrows it to its shard. Here instead:

* **Engine layout, from the engine** (``engine_layout``): every worker reports, through the worker
  extension (``worker_ext.rz_shard_layout``, reading the aligned class's own ``rz_shards``), each
  Hugging Face name it holds with the full tensor's shape and the *box* of it the worker holds
  (per dimension ``[start, stop)``; a whole tensor is the full box). No second copy of the
  sharding rules.
* **Learner pieces** (megatron_rz.learner.hf_convert.local_hf_pieces): every learner rank lists
  the HF-named pieces it holds (EP: whole experts under their global index; TP: its block; data
  parallel replicas hold the same pieces), each with its box. Only this metadata is exchanged.
* **The plan** (``plan``): every engine box intersected with every distinct learner piece of the
  same name gives the transfers (engine rank, name, box); every element of every engine parameter
  must be covered exactly once (else a one-line error naming the parameter). Each transfer goes to
  one of the learner ranks holding its piece, the least loaded so far (in bytes; largest transfers
  first), so the duty is spread over the data-parallel replicas. Every rank computes the same plan
  from the same metadata.
* **Transport** (``ShardedFilesystemTransport``): version directory ``v{version}/rank{e}/
  part-{l}.safetensors``, written by every learner rank ``l`` in parallel (only the narrows of
  pieces it holds), committed (one rename) once all learner ranks reported; each engine worker
  reads only ``rank{e}/``, assembles each of its parameters from the parts (a tensor of its own
  shard's size) and loads it in place (``rz_stage_shards`` + the usual commit / reload).
* **Verification** (``expected_checksums`` / ``check_resharded``): the exact byte checksum
  (worker_ext.tensor_bits) of *every* parameter of *every* engine worker, computed by the learner
  ranks from the parts they sent (the checksum is a sum over elements, so parts add up) and
  compared with each worker's read-back.

Framework-free (torch only; imported by the learner and the driver). The boxes, a worker's layout
and the assembly of its parts live in vllm_bridge/shards.py (what the vLLM workers import).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_bridge.shards import (Box, EngineLayout, EngineParam, assemble, box_key, box_numel, box_shape,  # noqa: F401
                                 contains, element_size, full_box, intersect, layout_from_reports, narrow,
                                 parse_key, relative, slice_box)
from vllm_bridge.weights.buckets import WeightSyncError, WeightTransport, WeightUpdate, version_dir
from vllm_bridge.worker_ext import bit_patterns, bits_weights

_MOD = 1 << 64

# ------------------------------------------------------------------ engine layout


def engine_layout(engine) -> EngineLayout:
    """The engine's own report of what each worker holds (collective_rpc rz_shard_layout)."""
    return layout_from_reports(engine.collective_rpc("rz_shard_layout"))


def worker_checksums(engine) -> list[dict]:
    """Every worker's checksum_entry of every parameter, in engine-rank order (check_resharded's
    ``reported``)."""
    return [x["sums"] for x in sorted(engine.collective_rpc("rz_shard_checksums"), key=lambda x: x["rank"])]


def layout_to_json(layout: EngineLayout) -> list[dict]:
    return [{n: {"shape": list(p.shape), "box": [list(b) for b in p.box], "dtype": p.dtype} for n, p in lay.items()}
            for lay in layout]


def layout_from_json(obj: list[dict]) -> EngineLayout:
    return layout_from_reports([{"rank": i, "params": lay} for i, lay in enumerate(obj)])


def engine_shard_bytes(layout: EngineLayout) -> list[int]:
    """Bytes of the parameters each engine worker holds (what a resharded sync must send it)."""
    return [sum(box_numel(p.box) * element_size(p.dtype) for p in lay.values()) for lay in layout]


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Piece:
    """What one learner rank holds of one HF tensor (metadata only: exchanged between ranks)."""

    name: str
    shape: tuple[int, ...]
    box: Box
    dtype: str


@dataclass(frozen=True)
class Transfer:
    engine_rank: int
    name: str
    box: Box  # in the full tensor
    piece_box: Box  # the learner piece it is cut from
    sender: int  # learner rank
    nbytes: int


def plan(pieces: list[list[Piece]], layout: EngineLayout) -> list[Transfer]:
    """The transfers of one resharded sync: ``pieces[l]`` what learner rank ``l`` holds, ``layout[e]``
    what engine rank ``e`` holds. Deterministic (every learner rank computes the same list).

    Raises ValueError (one line, naming the tensor) when the learner's pieces of a name overlap
    without being equal, disagree in shape or dtype with the engine, or leave an element of an
    engine parameter uncovered. Learner tensors no engine worker holds (MTP layers, a tied head)
    are not sent."""
    holders: dict[str, dict[Box, list[int]]] = {}
    meta: dict[str, tuple[tuple[int, ...], str]] = {}
    for rank, mine in enumerate(pieces):
        for p in mine:
            if meta.setdefault(p.name, (p.shape, p.dtype)) != (p.shape, p.dtype):
                raise ValueError(f"reshard: learner ranks disagree on {p.name}: {meta[p.name]} vs {(p.shape, p.dtype)}")
            holders.setdefault(p.name, {}).setdefault(p.box, []).append(rank)
    for name, boxes in holders.items():
        bs = list(boxes)
        for i, a in enumerate(bs):
            for b in bs[i + 1:]:
                if intersect(a, b) is not None:
                    raise ValueError(f"reshard: learner pieces of {name} overlap without being equal: {a} and {b}")
    wanted: list[tuple[int, str, Box, Box, list[int]]] = []
    for e, lay in enumerate(layout):
        for name in sorted(lay):
            p = lay[name]
            if name not in meta:
                raise ValueError(f"reshard: engine rank {e} holds {name}, which no learner rank holds")
            if meta[name] != (p.shape, p.dtype):
                raise ValueError(f"reshard: {name} is {meta[name]} on the learner but {(p.shape, p.dtype)} on "
                                 f"engine rank {e}")
            covered = 0
            for pbox in sorted(holders[name]):
                inter = intersect(pbox, p.box)
                if inter is not None:
                    covered += box_numel(inter)
                    wanted.append((e, name, inter, pbox, holders[name][pbox]))
            if covered != box_numel(p.box):
                raise ValueError(f"reshard: engine rank {e}'s {name} {p.box}: the learner pieces cover {covered} "
                                 f"of its {box_numel(p.box)} elements")
    size = {n: element_size(d) for n, (_, d) in meta.items()}
    load = [0] * len(pieces)
    order = sorted(range(len(wanted)), key=lambda i: (-box_numel(wanted[i][2]) * size[wanted[i][1]], i))
    out: list[Transfer | None] = [None] * len(wanted)
    for i in order:
        e, name, box, pbox, cands = wanted[i]
        nbytes = box_numel(box) * size[name]
        sender = min(cands, key=lambda r: (load[r], r))
        load[sender] += nbytes
        out[i] = Transfer(e, name, box, pbox, sender, nbytes)
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------ checksums


def part_bits(t: torch.Tensor, box: Box, outer: Box) -> int:
    """The contribution of part ``t`` (occupying ``box``) to worker_ext.tensor_bits of the tensor
    ``outer`` (the engine worker's parameter), mod 2^64: tensor_bits sums bit pattern x position
    weight over the flat positions of the parameter, so the parts of a parameter add up to it."""
    rel = relative(box, outer)
    shape = box_shape(outer)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    flat = torch.zeros((), dtype=torch.int64)
    for d, (s, e) in enumerate(rel):
        idx = torch.arange(s, e, dtype=torch.int64) * strides[d]
        flat = flat.unsqueeze(-1) + idx.view(*([1] * d), -1)
    x = bit_patterns(t)
    return int((x * bits_weights(flat.reshape(-1))).sum()) % _MOD


def expected_checksums(transfers: list[Transfer], tensors: list[torch.Tensor], layout: EngineLayout) -> dict:
    """{(engine rank, name): tensor_bits mod 2^64} summed over the parts this learner rank sends."""
    out: dict = {}
    for t, x in zip(transfers, tensors):
        k = (t.engine_rank, t.name)
        out[k] = (out.get(k, 0) + part_bits(x, t.box, layout[t.engine_rank][t.name].box)) % _MOD
    return out


def check_resharded(expected: dict, reported: list[dict], layout: EngineLayout, version: int) -> dict:
    """Every parameter of every engine worker against the bits the learner ranks sent (``expected``:
    the merged expected_checksums of every learner rank). ``reported[e]``: worker e's rz_checksums
    of all its parameters. Raises WeightSyncError on any difference or missing entry."""

    bad, checked = [], 0
    for e, lay in enumerate(layout):
        for name, p in lay.items():
            got = reported[e].get(name)
            want = expected.get((e, name))
            if got is None or want is None or list(got["shape"]) != list(box_shape(p.box)):
                bad.append(f"rank {e} {name} (missing or wrong shape)")
            elif (int(got["bits"]) - want) % _MOD:
                bad.append(f"rank {e} {name} (bytes differ)")
            checked += 1
    if bad:
        raise WeightSyncError(f"resharded sync to version {version}: {len(bad)}/{checked} engine parameters differ "
                              f"from what the learner sent: {', '.join(bad[:8])}")
    return {"checked": checked}


# ------------------------------------------------------------------ transport


class ShardedUpdate(WeightUpdate):
    """One committed resharded version: ``paths`` is its one version directory (``rank{e}/part-*``
    inside; the same ``v{version}`` naming as every file-backed transport)."""

    def __init__(self, version: int, directory: str, info: dict | None = None):
        super().__init__(int(version), [str(directory)], dict(info or {}))

    @property
    def directory(self) -> str:
        return self.paths[0]


class ShardedFilesystemTransport(WeightTransport):
    """Per-engine-rank part files under ``directory`` (the run's weights directory in a job; any
    local directory for an engine of this process). Learner side, collective (no bucket stream, so
    not ``push``): ``prepare`` (one rank), ``write`` (every rank, in parallel), ``commit`` (one
    rank, after all wrote); megatron_rz.loop.weights.write_resharded drives them. Engine side:
    ``apply`` and ``release`` as every transport."""

    name = "reshard"
    collective = True  # every learner rank writes its own parts

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def _final(self, version: int) -> Path:
        return version_dir(self.directory, version)

    def _tmp(self, version: int) -> Path:
        final = version_dir(self.directory, version)
        return final.with_name(final.name + ".tmp")

    def push(self, buckets, version: int):
        raise TypeError("the resharded transport takes no bucket stream: every learner rank writes its parts "
                        "(megatron_rz.loop.weights.write_resharded)")

    def prepare(self, version: int) -> None:
        tmp = self._tmp(version)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def write(self, version: int, learner_rank: int, parts: dict[int, dict[str, torch.Tensor]]) -> dict:
        """This learner rank's parts ({engine rank: {box_key: tensor}}), one file per engine rank, then
        its ``done-{l}.json`` (what commit checks). Returns {engine rank: bytes of the file}."""
        from safetensors.torch import save_file

        tmp = self._tmp(version)
        sizes = {}
        for e, tensors in sorted(parts.items()):
            d = tmp / f"rank{e}"
            d.mkdir(exist_ok=True)
            path = d / f"part-{learner_rank:05d}.safetensors"
            # own copies: parts cut from one parameter share its storage, which safetensors refuses
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path),
                      metadata={"format": "pt"})
            sizes[e] = path.stat().st_size
        (tmp / f"done-{learner_rank:05d}.json").write_text(json.dumps({str(e): s for e, s in sizes.items()}))
        return sizes

    def commit(self, version: int, learner_world: int) -> ShardedUpdate:
        tmp, final = self._tmp(version), self._final(version)
        missing = [r for r in range(learner_world) if not (tmp / f"done-{r:05d}.json").is_file()]
        if missing:
            raise RuntimeError(f"resharded version {version}: learner ranks {missing} did not finish writing to {tmp}")
        if final.exists():  # a re-push of the same version: replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        return ShardedUpdate(int(version), str(final))

    def apply(self, update: ShardedUpdate, engine, *, reload: bool = True) -> dict:
        """The engine's one staging protocol (RolloutEngine.apply_weights) on the version directory:
        every worker stages its own ``rank{e}/`` parts, then one commit (in-place reload) and the
        version label. "workers": what each worker read."""
        return engine.apply_weights([update.directory], update.version, reload=reload, stage="rz_stage_shards")

    def release(self, update: ShardedUpdate) -> None:
        shutil.rmtree(update.directory, ignore_errors=True)
