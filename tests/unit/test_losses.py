"""REINFORCE Zero loss and diagnostics against hand-computed values."""

import math

import torch

from megatron_rz.diagnostics import RunningRatio, mismatch_stats
from megatron_rz.losses import group_advantages, make_loss_fn, reinforce_zero_loss


def test_group_advantages_subtract_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    assert torch.allclose(adv, expected, atol=1e-7)


def test_loss_hand_computed_example():
    # Two responses. Row 0: 2 response tokens, log w = [0.1, -0.2], A = 0.5.
    # Row 1: 1 response token, log w = 0.3, A = -1. Padding/prompt positions masked.
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, 0.0, 0.0]])
    new = torch.tensor([[9.0, -0.9, -2.2, 5.0], [7.0, -0.2, 3.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([0.5, -1.0])
    loss_sum, metrics = reinforce_zero_loss(new, old, adv, mask)
    row0 = -(math.exp(0.1) + math.exp(-0.2)) * 0.5 / 2
    row1 = -(math.exp(0.3)) * -1.0 / 1
    assert math.isclose(loss_sum.item(), row0 + row1, rel_tol=1e-6)
    loss_sum.backward()
    # d/dlogp of -w*A/T is -w*A/T; masked positions get exactly zero gradient.
    g = new.grad
    assert math.isclose(g[0, 1].item(), -math.exp(0.1) * 0.5 / 2, rel_tol=1e-6)
    assert math.isclose(g[0, 2].item(), -math.exp(-0.2) * 0.5 / 2, rel_tol=1e-6)
    assert math.isclose(g[1, 1].item(), math.exp(0.3), rel_tol=1e-6)
    assert g[0, 0] == 0 and g[0, 3] == 0 and g[1, 2] == 0 and g[1, 3] == 0
    assert math.isclose(metrics["is_weight_mean"].item(), (math.exp(0.1) + math.exp(-0.2)) / 2 + math.exp(0.3), rel_tol=1e-6)


def test_untruncated_weights_are_not_clipped():
    old = torch.tensor([[0.0, -10.0]])
    new = torch.tensor([[0.0, 0.0]], requires_grad=True)  # w = e^10, no clipping anywhere
    loss_sum, _ = make_loss_fn("reinforce_zero")(new, {"old_logprobs": old, "advantages": torch.tensor([1.0]), "loss_mask": torch.tensor([[0.0, 1.0]])})
    assert math.isclose(loss_sum.item(), -math.exp(10), rel_tol=1e-6)


def test_on_policy_loss_gradient_is_plain_reinforce():
    logp = torch.tensor([[-0.3, -1.2]], requires_grad=True)
    loss_sum, _ = reinforce_zero_loss(logp, logp.detach().clone(), torch.tensor([2.0]), torch.ones(1, 2))
    loss_sum.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]]))  # -A / T with w == 1


def test_mismatch_stats():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    same = mismatch_stats(old.clone(), old, torch.tensor([[0.0, 1.0, 1.0]]))
    assert same["d3"] == 0.0 and same["frac_bitwise"] == 1.0 and same["max_abs_dlogp"] == 0.0 and same["ess"] == 1.0
    new = torch.tensor([[5.0, -0.5, -2.0]])
    s = mismatch_stats(new, old, torch.tensor([[0.0, 1.0, 1.0]]))
    w = math.exp(0.5)
    assert math.isclose(s["d3"], (w - 1 - 0.5) / 2, rel_tol=1e-9)
    assert math.isclose(s["kl_k1"], -0.25, rel_tol=1e-9)
    assert s["frac_bitwise"] == 0.5 and s["max_abs_dlogp"] == 0.5


def test_running_ratio():
    r = RunningRatio()
    r.add(1.0)
    r.add(3.0)
    assert r.add(2.0) == 1.5
