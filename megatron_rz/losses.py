"""Policy-gradient losses.

REINFORCE Zero: per-token importance weight w = exp(logp_learner - logp_rollout), untruncated (no
clip, no mask, no gate); advantage A = reward - mean reward of the prompt's group; each response's
loss is the token mean of -w * A; the batch loss is the mean over responses; no critic.

Since d/dtheta w = w * d/dtheta logp, the gradient of -w * A is the importance-weighted
policy gradient -w * A * grad logp, which is unbiased for the current policy however old the
rollout policy was (up to the variance the weight brings).

Losses follow the learner's convention (megatron_rz.learner.Learner.train_step): they return the
SUM over the micro batch's responses; the learner divides by the number of responses in the
whole batch, so micro-batching and data parallelism do not change the result.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """reward - mean reward of the same group (prompt). No std normalisation (it biases the gradient)."""
    rewards = rewards.to(torch.float64)
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    sums = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, inverse, rewards)
    counts = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))
    return (rewards - (sums / counts)[inverse]).to(torch.float32)


def reinforce_zero_loss(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over rows of token-mean(-w * A). Shapes: logp, old_logprobs, loss_mask [B, S]; advantages [B]."""
    mask = loss_mask.to(logp.dtype)
    w = torch.exp(logp - old_logprobs) * mask  # masked tokens: exp(0-0)=1 times 0
    tokens = mask.sum(dim=1).clamp_min(1.0)
    per_row = -(w * advantages[:, None].to(logp.dtype)).sum(dim=1) / tokens
    metrics = {"loss": per_row.detach().sum(), "is_weight_mean": ((w.detach().sum(dim=1)) / tokens).sum()}
    return per_row.sum(), metrics


def make_loss_fn(name: str):
    """The loss callable the learner calls per micro batch: loss_fn(logp, rows) -> (loss_sum, metric_sums)."""
    if name != "reinforce_zero":
        raise ValueError(f"unknown algo.name {name!r}; available: reinforce_zero")

    def loss_fn(logp: torch.Tensor, rows: dict[str, torch.Tensor]):
        return reinforce_zero_loss(logp, rows["old_logprobs"], rows["advantages"], rows["loss_mask"])

    return loss_fn
