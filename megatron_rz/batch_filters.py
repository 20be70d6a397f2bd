"""Batch-level pieces of the DAPO baseline: overlong reward shaping, dynamic sampling, token weights.

Pure functions on CPU tensors (plus one refill loop over a user-supplied generator); nothing here
imports Megatron or vLLM. The order the trainer is expected to use for algo.name == "dapo":

    samples = refill_groups(generate, recipe.rollout.prompts_per_step, ...)  # if algo.dynamic_sampling
    rewards = overlong_shaping(rewards, response_lengths, max_new_tokens, buffer, penalty)  # if buffer > 0
    advantages = group_advantages(rewards, group_ids)
    token_weight = token_weights_for_token_mean(loss_mask)  # passed to train_step as a per-row tensor

(dynamic sampling judges a group on the rewards its `reward_of` returns; the trainer picks whether
those are the task rewards or the length-shaped ones.)
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

S = TypeVar("S")


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
    drops them and refills the batch (see refill_groups).
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


@dataclasses.dataclass
class RefillResult:
    groups: list[list[Any]]  # exactly num_groups groups, each the samples of one prompt, in arrival order
    attempts: int  # generate() calls made
    generated_groups: int  # groups generated in total
    dropped_groups: int  # groups dropped for all-equal rewards (surplus informative groups not counted)


def refill_groups(
    generate: Callable[[int, int], Sequence[S]],
    num_groups: int,
    *,
    max_attempts: int = 8,
    group_of: Callable[[S], Any] = lambda s: s.group,
    reward_of: Callable[[S], float] = lambda s: s.reward,
    oversample: float = 1.0,
    atol: float = 0.0,
) -> RefillResult:
    """DAPO dynamic sampling: keep generating until num_groups groups with non-constant rewards.

    generate(n, attempt) must return the samples (rewards already set) of n new prompts, attempt
    being 0, 1, ...; group ids need only be distinct within one call. Each call asks for
    ceil(missing * oversample) groups. Groups whose rewards are all equal (max - min <= atol) are
    dropped; the first num_groups informative groups are kept, the surplus discarded. After
    max_attempts calls without enough groups, raises DynamicSamplingError saying how many were
    found and what the dropped groups' rewards were.

    Use flatten_groups(result.groups) to get one sample list with group ids 0..num_groups-1.
    """
    if num_groups < 1:
        raise ValueError(f"num_groups={num_groups} must be >= 1")
    if max_attempts < 1:
        raise ValueError(f"max_attempts={max_attempts} must be >= 1")
    if oversample < 1.0:
        raise ValueError(f"oversample={oversample} must be >= 1")
    kept: list[list[S]] = []
    generated = dropped = 0
    dropped_rewards: Counter = Counter()
    attempt = 0
    while len(kept) < num_groups and attempt < max_attempts:
        missing = num_groups - len(kept)
        ask = math.ceil(missing * oversample)
        samples = list(generate(ask, attempt))
        attempt += 1
        by_group: dict[Any, list[S]] = {}
        for s in samples:
            by_group.setdefault(group_of(s), []).append(s)
        generated += len(by_group)
        for members in by_group.values():
            rs = [float(reward_of(s)) for s in members]
            if len(rs) >= 2 and max(rs) - min(rs) > atol:
                if len(kept) < num_groups:
                    kept.append(members)
            else:
                dropped += 1
                dropped_rewards[round(rs[0], 6) if rs else None] += 1
    if len(kept) < num_groups:
        common = ", ".join(f"reward {r}: {c}" for r, c in dropped_rewards.most_common(5))
        raise DynamicSamplingError(
            f"dynamic sampling found only {len(kept)} of {num_groups} groups with non-constant rewards after "
            f"{attempt} generate() calls ({generated} groups generated, {dropped} dropped as all-equal: {common}). "
            "The task is too easy or too hard for the policy at this point: raise the attempt limit, lower "
            "rollout.prompts_per_step, raise rollout.samples_per_prompt, or set algo.dynamic_sampling=false"
        )
    return RefillResult(groups=kept, attempts=attempt, generated_groups=generated, dropped_groups=dropped)


def flatten_groups(groups: Sequence[Sequence[S]], field: str = "group") -> list[S]:
    """One sample list with `field` renumbered to the group's index (0..len(groups)-1).

    Dataclass samples are copied with dataclasses.replace (the inputs are not modified); other
    objects get the attribute set in place.
    """
    out: list[S] = []
    for gi, members in enumerate(groups):
        for s in members:
            if dataclasses.is_dataclass(s) and not isinstance(s, type):
                out.append(dataclasses.replace(s, **{field: gi}))
            else:
                setattr(s, field, gi)
                out.append(s)
    return out
