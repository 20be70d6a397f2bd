"""Batch-level pieces of the DAPO baseline: overlong reward shaping, dynamic sampling, token weights.

Pure functions on CPU tensors; nothing here imports Megatron or vLLM. How the one rollout producer
(megatron_rz.loop.rollout.Producer) and the loop use them for algo.name == "dapo":

    rewards = overlong_shaping(rewards, response_lengths, max_new_tokens, buffer, penalty)  # if buffer > 0
    a group with dynamic_sampling_keep(...) all False is dropped and a fresh prompt submitted
    advantages = group_advantages(rewards, group_ids)
    token_weight = token_weights_for_token_mean(loss_mask)  # passed to train_step as a per-row tensor

(dynamic sampling judges a group on its shaped rewards.)
"""

from __future__ import annotations

import torch


def overlong_shaping(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    max_new_tokens: int,
    buffer: int,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the rewards.

    With L = max_new_tokens, c = buffer, n = response length (generated tokens, EOS included):
        n <= L - c          -> + 0
        L - c < n <= L      -> + ((L - c) - n) / c * penalty   (linear, -penalty at n = L)
        n > L               -> - penalty
    buffer == 0 disables the shaping (rewards returned unchanged, as float32).
    """
    if buffer < 0 or buffer > max_new_tokens:
        raise ValueError(f"overlong buffer={buffer} must be in [0, max_new_tokens={max_new_tokens}]")
    if penalty < 0:
        raise ValueError(f"overlong penalty={penalty} must be >= 0 (it is subtracted)")
    rewards = rewards.to(torch.float32)
    if buffer == 0:
        return rewards.clone()
    n = response_lengths.to(torch.float64)
    start = float(max_new_tokens - buffer)
    ramp = ((start - n) / buffer * penalty).clamp(min=-penalty, max=0.0)
    return (rewards.to(torch.float64) + ramp).to(torch.float32)


def dynamic_sampling_keep(rewards: torch.Tensor, group_ids: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Bool mask [B]: True for rows whose group's rewards are not all equal (max - min > atol).

    Groups with all-equal rewards have zero group-mean advantage everywhere and no gradient; DAPO
    drops them and refills the batch (megatron_rz.loop.rollout.Producer.collect).
    """
    rewards = rewards.to(torch.float64).reshape(-1)
    group_ids = group_ids.reshape(-1)
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} differ")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    hi = torch.full((len(groups),), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, rewards, "amax")
    lo = torch.full((len(groups),), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, rewards, "amin")
    return ((hi - lo) > atol)[inverse]


def token_weights_for_token_mean(loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-row weights [B] that turn the learner's "sum over rows / B" into the batch token mean.

    token_weight[i] = B / N for every row, B = loss_mask.shape[0], N = loss_mask.sum() (response
    tokens of the WHOLE batch). A loss returning sum_i token_weight[i] * sum_t l_it is then divided
    by B in the learner, giving sum_it l_it / N. Compute it on the whole batch before the learner
    splits rows across micro batches / data-parallel ranks. N == 0 gives all-zero weights.
    """
    B = loss_mask.shape[0]
    N = float(loss_mask.to(torch.float64).sum())
    value = B / N if N > 0 else 0.0
    return torch.full((B,), value, dtype=torch.float32)


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling could not collect enough groups with non-constant rewards."""
