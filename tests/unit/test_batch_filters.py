"""DAPO batch filters against hand-computed values."""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from megatron_rz.batch_filters import (
    DynamicSamplingError,
    dynamic_sampling_keep,
    flatten_groups,
    overlong_shaping,
    refill_groups,
    token_weights_for_token_mean,
)


def test_overlong_shaping_ramp():
    # L = 10, buffer 4: no penalty up to 6 tokens, then (6 - n) / 4 * penalty down to -penalty at 10.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    out = overlong_shaping(rewards, lengths, max_new_tokens=10, buffer=4, penalty=1.0)
    assert torch.allclose(out, torch.tensor([1.0, 1.0, 0.75, -0.5, 0.0, -1.0]))
    half = overlong_shaping(rewards, lengths, max_new_tokens=10, buffer=4, penalty=0.5)
    assert torch.allclose(half, torch.tensor([1.0, 1.0, 0.875, -0.25, 0.5, -0.5]))
    assert out.dtype == torch.float32 and rewards[2] == 1.0  # input untouched


def test_overlong_shaping_disabled_and_validation():
    rewards = torch.tensor([1.0, 0.0])
    out = overlong_shaping(rewards, torch.tensor([10, 10]), max_new_tokens=10, buffer=0, penalty=1.0)
    assert torch.equal(out, rewards)
    # buffer == max_new_tokens: the ramp starts at length 0
    full = overlong_shaping(rewards, torch.tensor([5, 10]), max_new_tokens=10, buffer=10, penalty=1.0)
    assert torch.allclose(full, torch.tensor([0.5, -1.0]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_shaping(rewards, torch.tensor([1, 1]), max_new_tokens=4, buffer=5)
    with pytest.raises(ValueError, match="penalty"):
        overlong_shaping(rewards, torch.tensor([1, 1]), max_new_tokens=4, buffer=2, penalty=-1.0)


def test_dynamic_sampling_keep():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 7, 7])  # group 7: non-contiguous ids are fine
    keep = dynamic_sampling_keep(rewards, groups)
    assert keep.tolist() == [False, False, True, True, True, False, False, True, True]
    # interleaved group order
    keep2 = dynamic_sampling_keep(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 1, 0, 1]))
    assert keep2.tolist() == [False, False, False, False]
    # tolerance
    near = dynamic_sampling_keep(torch.tensor([1.0, 1.0 + 1e-9]), torch.tensor([3, 3]), atol=1e-6)
    assert near.tolist() == [False, False]
    assert dynamic_sampling_keep(torch.tensor([]), torch.tensor([], dtype=torch.long)).numel() == 0


def test_token_weights_for_token_mean():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [1, 1, 1, 0.0]])
    tw = token_weights_for_token_mean(mask)
    assert torch.allclose(tw, torch.full((3,), 3 / 6))  # B / N = 3 / 6
    # sum_i tw_i * sum_t x_it / B == batch token mean of x
    x = torch.arange(12.0).reshape(3, 4)
    assert math.isclose(((x * mask).sum(1) * tw).sum().item() / 3, (x * mask).sum().item() / 6)
    assert torch.equal(token_weights_for_token_mean(torch.zeros(2, 3)), torch.zeros(2))


def _scripted(batches):
    """generate(n, attempt) returning the attempt-th scripted list of group rewards (must match n)."""
    calls = []

    def generate(n, attempt):
        calls.append((n, attempt))
        groups = batches[attempt]
        assert len(groups) == n
        return [SimpleNamespace(group=g, reward=r, tag=(attempt, g)) for g, rs in enumerate(groups) for r in rs]

    return generate, calls


def test_refill_groups_collects_informative_groups():
    generate, calls = _scripted([
        [[1, 1], [0, 1], [0, 0], [1, 0]],  # 2 informative of 4
        [[1, 1], [0, 0]],  # 0 of 2
        [[0, 1], [1, 0]],  # 2 of 2 -> done
    ])
    res = refill_groups(generate, 4, max_attempts=5)
    assert calls == [(4, 0), (2, 1), (2, 2)]  # each call asks for the groups still missing
    assert [g[0].tag for g in res.groups] == [(0, 1), (0, 3), (2, 0), (2, 1)]
    assert all(len(g) == 2 for g in res.groups)
    assert (res.attempts, res.generated_groups, res.dropped_groups) == (3, 8, 4)
    flat = flatten_groups(res.groups)
    assert [s.group for s in flat] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.reward for s in flat] == [0, 1, 1, 0, 0, 1, 1, 0]


def test_refill_groups_oversample_discards_surplus():
    generate, calls = _scripted([
        [[1, 1], [1, 1], [0, 0], [0, 0]],  # 0 of 4 (oversample 2 x 2 missing)
        [[0, 1], [1, 1], [1, 0], [0, 1]],  # 3 informative, only 2 needed
    ])
    res = refill_groups(generate, 2, max_attempts=2, oversample=2.0)
    assert calls == [(4, 0), (4, 1)]
    assert [g[0].tag for g in res.groups] == [(1, 0), (1, 2)]
    assert res.dropped_groups == 5  # the surplus informative group is not counted as dropped


def test_refill_groups_gives_up_with_a_clear_message():
    generate, calls = _scripted([[[1, 1, 1], [1, 1, 1]], [[1, 1, 1], [0, 0, 0]], [[0, 1, 1], [1, 1, 1]]])
    with pytest.raises(DynamicSamplingError) as e:
        refill_groups(generate, 2, max_attempts=3)
    msg = str(e.value)
    assert "only 1 of 2" in msg and "3 generate() calls" in msg and "6 groups generated" in msg
    assert "reward 1.0: 4" in msg and "algo.dynamic_sampling=false" in msg
    assert len(calls) == 3


def test_flatten_groups_copies_dataclass_samples():
    from vllm_bridge.samples import Sample

    def s(g, r):
        return Sample(prompt_ids=[1], response_ids=[2, 3], logprobs=[-0.1, -0.2], versions=[0, 0],
                      finish_reason="stop", group=g, reward=r)

    groups = [[s(5, 1.0), s(5, 0.0)], [s(0, 0.0), s(0, 1.0)]]
    flat = flatten_groups(groups)
    assert [x.group for x in flat] == [0, 0, 1, 1]
    assert groups[0][0].group == 5  # originals untouched


@dataclass
class _D:
    group: int
    reward: float


def test_refill_groups_custom_accessors_and_single_sample_groups():
    # groups of one sample can never have non-constant rewards
    def generate(n, attempt):
        return [_D(group=i, reward=float(i % 2)) for i in range(n)]

    with pytest.raises(DynamicSamplingError):
        refill_groups(generate, 1, max_attempts=2)
    res = refill_groups(lambda n, a: [_D(7, 0.0), _D(7, 0.4)], 1, group_of=lambda d: d.group, max_attempts=1)
    assert len(res.groups) == 1 and len(res.groups[0]) == 2
    with pytest.raises(DynamicSamplingError):  # spread 0.4 <= atol 0.5: all-equal
        refill_groups(lambda n, a: [_D(0, 0.0), _D(0, 0.4)], 1, reward_of=lambda d: d.reward, atol=0.5,
                      max_attempts=1)
    with pytest.raises(ValueError):
        refill_groups(lambda n, a: [], 0)
