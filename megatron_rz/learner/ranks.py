"""This process's rank and rank 0's objects for every rank: the collectives rank-0-driven code needs."""

from __future__ import annotations

import torch.distributed as dist


def rank() -> int:
    """Global rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def broadcast_object(obj):
    """Collective: rank 0's ``obj`` on every rank (pickled; ``obj`` itself without other ranks)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj
