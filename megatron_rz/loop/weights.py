"""The learner's weights on their way to the rollout: the full-copy bucket stream and the resharded
parts. The one place where megatron_rz.learner (which yields HF-named tensors and pieces and never
imports vllm_bridge) meets vllm_bridge's bucketing and resharding.

    hf_buckets(learner)                       collective; rank 0 gets {HF name: full tensor} buckets
    write_resharded(learner, layout, ...)     collective; every rank writes its narrows of each
                                              engine worker's shard (no full tensor anywhere)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rz.learner.ranks import rank as global_rank
from vllm_bridge.weights.buckets import DEFAULT_BUCKET_BYTES, iter_buckets

__all__ = ["hf_buckets", "write_resharded", "DEFAULT_BUCKET_BYTES"]


def hf_buckets(learner, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Collective generator of the learner's weights as buckets ({HF name: tensor} of about
    ``bucket_bytes``) for a WeightTransport (vllm_bridge.weights). Every rank must walk it to the
    end in step (Learner.export_hf_weights gathers TP/EP shards inside the iteration); global rank 0
    yields the buckets, the other ranks yield nothing. No rank holds more than the bucket being
    filled plus the tensor being gathered beyond its own shards (never a whole model). Tensors are
    detached copies on the learner's device."""
    stream = learner.export_hf_weights()
    if global_rank() != 0:
        for _ in stream:
            pass
        return
    yield from iter_buckets(stream, bucket_bytes, device=None)


def write_resharded(learner, layout, transport, version: int) -> dict:
    """Collective: this version of the learner's weights as each engine worker's shard, without a
    full tensor on any rank (vllm_bridge/weights/reshard.py; docs/tp.md "Resharding learner -> engine").

    ``layout``: the engine's reshard.EngineLayout (engine_layout(engine), the same on every rank);
    ``transport``: a reshard.ShardedFilesystemTransport on a directory every rank can write.
    Every rank lists the HF pieces it holds (Learner.local_hf_pieces: no collective), the pieces'
    metadata is all-gathered (names, shapes, boxes: no tensor data), every rank computes the same
    plan and writes only the narrows of its own pieces that the plan gives it, one part file per
    engine rank; global rank 0 commits once every rank wrote. Returns, on every rank,
    {"update" (rank 0; None elsewhere), "written" {engine rank: file bytes}, "sent_bytes",
    "transfers" (this rank's), "pieces" (what it holds), "expected" (rank 0: the merged checksums
    of every engine parameter, for reshard.check_resharded)}."""
    from vllm_bridge.weights import reshard

    rank, world = dist.get_rank(), dist.get_world_size()
    pieces, tensors = [], {}
    for name, t, full, box in learner.local_hf_pieces():
        p = reshard.Piece(name, tuple(full), tuple(box), str(t.dtype).replace("torch.", ""))
        pieces.append(p)
        tensors[(name, p.box)] = t
    everyone = [None] * world
    dist.all_gather_object(everyone, pieces)
    transfers = reshard.plan(everyone, layout)
    mine = [t for t in transfers if t.sender == rank]
    if rank == 0:
        transport.prepare(version)
    dist.barrier()
    parts: dict[int, dict[str, torch.Tensor]] = {}
    sent = []
    for t in mine:
        x = reshard.narrow(tensors[(t.name, t.piece_box)], reshard.relative(t.box, t.piece_box)).cpu()
        parts.setdefault(t.engine_rank, {})[reshard.box_key(t.name, t.box)] = x
        sent.append(x)
    written = transport.write(version, rank, parts)
    expected = reshard.expected_checksums(mine, sent, layout)
    gathered = [None] * world
    dist.all_gather_object(gathered, expected)
    dist.barrier()  # every rank's parts are on disk
    update = transport.commit(version, world) if rank == 0 else None
    merged: dict = {}
    for part in gathered:
        for k, v in part.items():
            merged[k] = (merged.get(k, 0) + v) % (1 << 64)
    return {"update": update, "written": written, "sent_bytes": sum(t.nbytes for t in mine), "transfers": mine,
            "pieces": pieces, "expected": merged if rank == 0 else None}
