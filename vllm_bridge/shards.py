"""Boxes of tensors and the engine-side half of a resharded weight sync (vllm_bridge/weights/reshard.py):
a worker's layout and the assembly of its parts into its parameters' shards. Torch only; imported
by the vLLM workers (worker_ext.rz_stage_shards) and by reshard.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop)


def full_box(shape) -> Box:
    return tuple((0, int(s)) for s in shape)


def slice_box(shape, dim: int, start: int, n: int) -> Box:
    """The box of ``n`` elements from ``start`` along ``dim`` of a tensor of ``shape``."""
    return tuple((int(start), int(start) + int(n)) if d == dim else (0, int(s)) for d, s in enumerate(shape))


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(s < e for s, e in out) else None


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def relative(inner: Box, outer: Box) -> Box:
    """``inner`` in the coordinates of ``outer`` (which contains it)."""
    return tuple((i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def narrow(t: torch.Tensor, box: Box) -> torch.Tensor:
    """A view of ``t`` restricted to ``box`` (in ``t``'s own coordinates)."""
    for d, (s, e) in enumerate(box):
        if (s, e) != (0, t.shape[d]):
            t = t.narrow(d, s, e - s)
    return t


def box_key(name: str, box: Box) -> str:
    """How a part is named inside a part file: ``name@s0:e0,s1:e1``."""
    return f"{name}@" + ",".join(f"{s}:{e}" for s, e in box)


def parse_key(key: str) -> tuple[str, Box]:
    name, _, b = key.rpartition("@")
    if not name:
        raise ValueError(f"resharded part {key!r}: expected 'name@s0:e0,...'")
    return name, tuple(tuple(int(x) for x in dim.split(":")) for dim in b.split(",") if dim)


def element_size(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


# ------------------------------------------------------------------ an engine worker's layout


@dataclass(frozen=True)
class EngineParam:
    """One parameter of one engine worker: the full HF tensor's shape, the box the worker holds."""

    shape: tuple[int, ...]
    box: Box
    dtype: str


EngineLayout = list[dict[str, EngineParam]]  # index: engine rank (the worker's rank in vLLM's world)


def layout_from_reports(reports: list[dict]) -> EngineLayout:
    """The workers' ``rz_shard_layout`` replies -> one {name: EngineParam} per engine rank."""
    ranks = sorted(int(r["rank"]) for r in reports)
    if ranks != list(range(len(reports))):
        raise ValueError(f"engine layout: worker ranks {ranks}, expected 0..{len(reports) - 1}")
    out: EngineLayout = [{} for _ in reports]
    for r in reports:
        out[int(r["rank"])] = {n: EngineParam(tuple(p["shape"]), tuple(tuple(x) for x in p["box"]), p["dtype"])
                               for n, p in r["params"].items()}
    return out


def assemble(parts: dict[str, torch.Tensor], params: dict[str, EngineParam]) -> dict[str, torch.Tensor]:
    """Engine side: {box_key: tensor} of one worker -> {name: the worker's whole shard}, checking
    that the parts of each parameter tile it exactly (no gap, no overlap, no stray name)."""
    by_name: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    for key, t in parts.items():
        name, box = parse_key(key)
        if name not in params:
            raise ValueError(f"resharded parts: {name} is not a parameter of this worker")
        if tuple(t.shape) != box_shape(box) or not contains(params[name].box, box):
            raise ValueError(f"resharded parts: {key} has shape {tuple(t.shape)}, outside this worker's "
                             f"{params[name].box}")
        by_name.setdefault(name, []).append((box, t))
    out = {}
    for name, items in by_name.items():
        p = params[name]
        if len(items) == 1 and items[0][0] == p.box:
            out[name] = items[0][1]
            continue
        for i, (a, _) in enumerate(items):
            if any(intersect(a, b) is not None for b, _ in items[i + 1:]):
                raise ValueError(f"resharded parts of {name} overlap")
        if sum(box_numel(b) for b, _ in items) != box_numel(p.box):
            raise ValueError(f"resharded parts of {name} do not cover this worker's {p.box}")
        buf = torch.empty(box_shape(p.box), dtype=items[0][1].dtype)
        for b, t in items:
            narrow(buf, relative(b, p.box)).copy_(t)
        out[name] = buf
    missing = sorted(set(params) - set(out))
    if missing:
        raise ValueError(f"resharded sync: no parts for {len(missing)} parameters of this worker, e.g. {missing[0]}")
    return out
