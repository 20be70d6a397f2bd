"""DAPO batch filters against hand-computed values."""

import math

import pytest
import torch

from megatron_rz.rl.batch_filters import (
    dynamic_sampling_keep,
    overlong_shaping,
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
