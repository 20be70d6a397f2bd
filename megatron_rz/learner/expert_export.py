"""Expert parallelism for the learners written as plain modules (DeepSeek-V4, Kimi-K3): which
routed expert a parameter belongs to, the expert-parallel group, and the full-weight export that
all-gathers the routed experts over it (what vLLM and the checkpoint hold)."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn


def expert_group():
    """(expert-parallel size, rank, group) from Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_group())


def expert_id(name: str) -> int | None:
    """The routed-expert index in a parameter name (``...experts.{e}....``), None for the rest."""
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


@torch.no_grad()
def gather_full_weights(model: nn.Module, num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter and buffer of ``model``, each rank holding
    ``num_experts / ep`` consecutive routed experts under their global names.

    Collective under expert parallelism (every rank iterates to the end): each routed-expert tensor
    is all-gathered over the expert group in the same iteration order on every rank, so every rank
    yields all experts, renamed to their global index."""
    import torch.distributed as dist

    ep, _, group = expert_group()
    per = num_experts // ep if num_experts else 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        e = expert_id(name)
        if e is None or ep == 1:
            yield name, t.detach()
            continue
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        local = e % per  # same local slot on every rank: the iteration orders match
        for r, part in enumerate(parts):
            yield name.replace(f"experts.{e}.", f"experts.{r * per + local}."), part
