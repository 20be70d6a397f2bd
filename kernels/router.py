"""MoE router: deterministic top-k in fp32 with lowest-expert-id tie-breaking.

Semantics follow Hugging Face:
* Qwen3-MoE (``score="softmax"``): ``p = softmax(logits)`` over all experts, top-k of ``p``;
  if ``norm_topk_prob`` the k weights are divided by their sum.
* DeepSeek-V3 ``noaux_tc`` (``score="sigmoid"``, ``expert_bias`` = e_score_correction_bias):
  ``s = sigmoid(logits)``; selection uses ``s + bias``; a group's score is the sum of its top-2 biased
  scores; the ``group_topk`` best groups are kept (others masked to -inf); top-k over the kept experts;
  weights are the UNBIASED ``s`` of the chosen experts, divided by ``sum + 1e-20`` if
  ``norm_topk_prob``; finally multiplied by ``scaling_factor`` (routed_scaling_factor).

Dtype and order rules (all fp32):
* softmax = ``exp(x - max) / tree_sum(exp(x - max))``; sigmoid = ``1 / (1 + exp(-x))``
  (``torch.sigmoid`` is avoided: its vectorised and scalar CPU paths differ in fp32).
* Top-k = the first k of a *stable* descending sort, so equal scores are taken lowest id first; the
  returned slots are ordered by descending score (slot 0 = best). Same for group selection.
* The top-2 group score is ``top1 + top2``; the normalising sum is a left fold over slots 0..k-1.
The weights are differentiable w.r.t. ``logits`` (plain autograd); the ids are not.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import fold_sum, tree_sum
from .gemm import linear

__all__ = ["router_logits", "route", "stable_topk"]


def stable_topk(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along ``dim``, descending, ties broken by lowest index."""
    vals, idx = torch.sort(x, dim=dim, descending=True, stable=True)
    return vals.narrow(dim, 0, k), idx.narrow(dim, 0, k)


def router_logits(
    hidden: torch.Tensor, gate_weight: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``hidden[..., H] @ gate_weight[E, H].T`` with the row-invariant linear, fp32 by default
    (DeepSeek-V3 semantics; pass ``out_dtype=hidden.dtype`` to round like HF Qwen3-MoE)."""
    return linear(hidden, gate_weight, out_dtype=out_dtype)


def softmax_scores(x: torch.Tensor) -> torch.Tensor:
    """Softmax router scores over the last dim (exact max, tree sum): the reference and its backward."""
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / tree_sum(e, dim=-1, keepdim=True)


def sigmoid_scores(x: torch.Tensor) -> torch.Tensor:
    """Sigmoid router scores, written as 1 / (1 + exp(-x)) (torch.sigmoid is not row-invariant on CPU)."""
    return 1.0 / (1.0 + torch.exp(-x))


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    num_groups: int = 1,
    group_topk: Optional[int] = None,
    norm_topk_prob: bool = False,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``logits[T, E]`` -> ``(topk_ids int64 [T, k], topk_weights fp32 [T, k])``."""
    if logits.dim() != 2:
        raise ValueError("route: logits must be [T, E]")
    T, E = logits.shape
    x = logits.to(torch.float32)
    if score == "softmax":
        scores = softmax_scores(x)
    elif score == "sigmoid":
        scores = sigmoid_scores(x)
    elif score == "sqrtsoftplus":  # DeepSeek-V4
        from .dsv4 import sqrtsoftplus

        scores = sqrtsoftplus(x)
    else:
        raise ValueError(f"route: unknown score {score!r}")
    choice = scores.detach()
    if expert_bias is not None:
        choice = choice + expert_bias.detach().to(torch.float32)
    if num_groups > 1:
        if E % num_groups:
            raise ValueError(f"route: E={E} not divisible by num_groups={num_groups}")
        keep_groups = num_groups if group_topk is None else group_topk
        grouped = choice.view(T, num_groups, E // num_groups)
        top2, _ = stable_topk(grouped, 2, dim=-1)
        group_scores = top2[..., 0] + top2[..., 1]
        _, gidx = stable_topk(group_scores, keep_groups, dim=-1)
        keep = torch.zeros(T, num_groups, dtype=torch.bool, device=x.device)
        keep.scatter_(1, gidx, True)
        keep = keep.repeat_interleave(E // num_groups, dim=1)
        choice = choice.masked_fill(~keep, float("-inf"))
    _, ids = stable_topk(choice, top_k, dim=-1)
    w = scores.gather(1, ids)
    if norm_topk_prob:
        denom = fold_sum([w[:, j : j + 1] for j in range(top_k)])
        if score != "softmax":
            denom = denom + 1e-20
        w = w / denom
    if scaling_factor != 1.0:
        w = w * scaling_factor
    return ids, w
