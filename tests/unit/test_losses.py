"""REINFORCE Zero loss and diagnostics against hand-computed values."""

import math

import torch

from megatron_rz.rl.diagnostics import RunningRatio, mismatch_stats
from megatron_rz.rl.losses import group_advantages, make_loss_fn, reinforce_zero_loss


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


# --------------------------------------------------------------------------- comparison baselines

import pytest  # noqa: E402

from megatron_rz.rl.batch_filters import token_weights_for_token_mean  # noqa: E402
from megatron_rz.rl.losses import dapo_loss, icepop_loss, mis_loss, tis_loss  # noqa: E402
from megatron_rz.recipe import AlgoConfig  # noqa: E402

L = math.log


def _rows(log_w, adv, pad=1):
    """logp/old/mask for rows of response log-ratios, each followed by `pad` masked positions
    (with wild logp there, which must not matter) and preceded by one masked prompt position."""
    S = 1 + max(len(r) for r in log_w) + pad
    old = torch.full((len(log_w), S), -1.0)
    new = torch.full((len(log_w), S), 5.0)  # masked positions: huge "ratio" exp(6)
    mask = torch.zeros(len(log_w), S)
    for i, r in enumerate(log_w):
        for t, lw in enumerate(r):
            old[i, 1 + t] = -1.0 - 0.1 * t
            new[i, 1 + t] = old[i, 1 + t] + lw
            mask[i, 1 + t] = 1.0
    return new.clone().requires_grad_(True), old, torch.tensor(adv), mask


def test_dapo_hand_computed_asymmetric_clipping_and_token_mean():
    # eps_low=0.2, eps_high=0.28: clip range [0.8, 1.28].
    # row 0 A=+1 : r = 1.5 (clipped high), 1.1 (inside), 0.5 (below range but A>0: not clipped)
    # row 1 A=-2 : r = 0.5 (clipped low), 1.5 (above range but A<0: not clipped), 0.9 (inside)
    # row 2 A=+.5: r = 1.25 (inside only because eps_high=0.28 > 0.2)
    # row 3 A=-1 : r = 0.75 (clipped low because eps_low=0.2 < 0.28)
    new, old, adv, mask = _rows([[L(1.5), L(1.1), L(0.5)], [L(0.5), L(1.5), L(0.9)], [L(1.25)], [L(0.75)]],
                                [1.0, -2.0, 0.5, -1.0])
    per_tok = [[-1.28, -1.1, -0.5], [1.6, 3.0, 1.8], [-0.625], [0.8]]
    N, B = 8, 4
    tw = token_weights_for_token_mean(mask)
    assert torch.allclose(tw, torch.full((4,), B / N))
    loss_sum, m = dapo_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28, token_weight=tw)
    token_mean = sum(map(sum, per_tok)) / N  # 3.695 / 8
    assert math.isclose(loss_sum.item() / B, token_mean, rel_tol=1e-6)
    assert math.isclose(loss_sum.item() / B, 0.461875, rel_tol=1e-6)
    loss_sum.backward()
    g = new.grad
    # d l_t / d logp_t = -r A on unclipped tokens, 0 on clipped ones; times token_weight B/N = 0.5.
    expected = torch.zeros_like(g)
    expected[0, 1:4] = torch.tensor([0.0, -0.5 * 1.1, -0.5 * 0.5])
    expected[1, 1:4] = torch.tensor([0.0, 0.5 * 1.5 * 2, 0.5 * 0.9 * 2])
    expected[2, 1] = -0.5 * 1.25 * 0.5
    expected[3, 1] = 0.0
    assert torch.allclose(g, expected, atol=1e-6)
    # metrics / B = batch token fractions
    assert math.isclose(m["clip_frac_high"].item() / B, 1 / 8, rel_tol=1e-6)
    assert math.isclose(m["clip_frac_low"].item() / B, 2 / 8, rel_tol=1e-6)
    assert math.isclose(m["clip_frac"].item() / B, 3 / 8, rel_tol=1e-6)
    ratios = [1.5, 1.1, 0.5, 0.5, 1.5, 0.9, 1.25, 0.75]
    assert math.isclose(m["ratio_mean"].item() / B, sum(ratios) / 8, rel_tol=1e-6)


def test_dapo_matches_min_formula_with_random_inputs():
    g = torch.Generator().manual_seed(0)
    B, S = 6, 7
    old = -torch.rand(B, S, generator=g) * 3
    new = (old + torch.randn(B, S, generator=g) * 0.4).requires_grad_(True)
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    adv = torch.randn(B, generator=g)
    tw = token_weights_for_token_mean(mask)
    loss, _ = dapo_loss(new, old, adv, mask, 0.2, 0.28, tw)
    loss.backward()
    new2 = new.detach().clone().requires_grad_(True)
    r = torch.exp(new2 - old)
    A = adv[:, None]
    ref_tok = -torch.minimum(r * A, r.clamp(0.8, 1.28) * A) * mask
    ref = ref_tok.sum() / mask.sum()
    ref.backward()
    assert math.isclose(loss.item() / B, ref.item(), rel_tol=1e-5)
    assert torch.allclose(new.grad / B, new2.grad, atol=1e-6)


def test_dapo_token_level_aggregation_is_batch_token_mean_under_micro_batching():
    # Simulate the learner: micro batches of 2 rows, loss = sum over micro batches of loss_sum / B.
    g = torch.Generator().manual_seed(1)
    B, S = 5, 9
    old = -torch.rand(B, S, generator=g) * 2
    logp = (old + torch.randn(B, S, generator=g) * 0.1).requires_grad_(True)
    lens = [1, 8, 3, 5, 2]  # very different lengths: token mean != mean of response means
    mask = torch.zeros(B, S)
    for i, n in enumerate(lens):
        mask[i, 1 : 1 + n] = 1.0
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0])
    loss_fn = make_loss_fn(AlgoConfig(name="dapo", dapo_eps_low=0.2, dapo_eps_high=0.28))
    rows = {"old_logprobs": old, "advantages": adv, "loss_mask": mask, "token_weight": token_weights_for_token_mean(mask)}
    total = 0.0
    for i in range(0, B, 2):
        sl = slice(i, i + 2)
        ls, _ = loss_fn(logp[sl], {k: v[sl] for k, v in rows.items()})
        total = total + ls / B
    total.backward()
    r = torch.exp(logp.detach() - old)
    A = adv[:, None]
    tok = -torch.minimum(r * A, r.clamp(0.8, 1.28) * A) * mask
    assert math.isclose(total.item(), (tok.sum() / mask.sum()).item(), rel_tol=1e-6)
    per_response_mean = ((tok.sum(1) / mask.sum(1)).mean()).item()
    assert not math.isclose(total.item(), per_response_mean, rel_tol=1e-3)
    # each unclipped token's gradient is -r A / N, independent of its response's length
    clipped = mask.bool() & (((A > 0) & (r > 1.28)) | ((A < 0) & (r < 0.8)))
    expected = torch.where(clipped, torch.zeros_like(r), torch.where(mask.bool(), -r * A / mask.sum(), torch.zeros_like(r)))
    assert torch.allclose(logp.grad, expected, atol=1e-7)


def test_dapo_without_token_weight_is_per_response_mean_and_loss_fn_requires_it():
    new, old, adv, mask = _rows([[L(1.1), L(0.9)], [L(1.05)]], [1.0, -1.0])
    loss_sum, _ = dapo_loss(new, old, adv, mask)
    assert math.isclose(loss_sum.item(), -(1.1 + 0.9) / 2 + 1.05, rel_tol=1e-6)
    fn = make_loss_fn(AlgoConfig(name="dapo"))
    with pytest.raises(KeyError, match="token_weight"):
        fn(new, {"old_logprobs": old, "advantages": adv, "loss_mask": mask})


def test_tis_truncation_values_and_gradient():
    # cap C = 2. row 0 A=1: w = 3 (truncated), 1.5, e^200 (truncated; must not give NaN);
    # row 1 A=-1: w = 0.5.
    new, old, adv, mask = _rows([[L(3.0), L(1.5), 200.0], [L(0.5)]], [1.0, -1.0])
    loss_sum, m = tis_loss(new, old, adv, mask, cap=2.0)
    row0 = -(2.0 + 1.5 + 2.0) / 3
    row1 = -(0.5 * -1.0) / 1
    assert math.isclose(loss_sum.item(), row0 + row1, rel_tol=1e-6)
    loss_sum.backward()
    g = new.grad
    assert torch.isfinite(g).all()
    expected = torch.zeros_like(g)
    expected[0, 1] = -2.0 / 3  # truncated: -C A / T (TIS keeps the capped coefficient)
    expected[0, 2] = -1.5 / 3  # -w A / T where w < C
    expected[0, 3] = -2.0 / 3  # w = e^200 truncated to C, finite gradient
    expected[1, 1] = 0.5  # -0.5 * -1 / 1
    assert torch.allclose(g, expected, atol=1e-6)
    assert math.isclose(m["tis_trunc_frac"].item(), 2 / 3, rel_tol=1e-6)
    assert math.isclose(m["tis_weight_mean"].item(), (2 + 1.5 + 2) / 3 + 0.5, rel_tol=1e-6)


def test_icepop_masks_tokens_outside_band():
    # [low, high] = [0.5, 2]. row 0 A=1: w = 3 (masked), 1.2, 0.4 (masked);
    # row 1 A=-0.5: w = 0.6, 2.5 (masked).
    new, old, adv, mask = _rows([[L(3.0), L(1.2), L(0.4)], [L(0.6), L(2.5)]], [1.0, -0.5])
    loss_sum, m = icepop_loss(new, old, adv, mask, low=0.5, high=2.0)
    row0 = -(1.2 * 1.0) / 3  # masked tokens still count in the denominator
    row1 = -(0.6 * -0.5) / 2
    assert math.isclose(loss_sum.item(), row0 + row1, rel_tol=1e-6)
    loss_sum.backward()
    expected = torch.zeros_like(new)
    expected[0, 2] = -1.2 / 3
    expected[1, 1] = 0.3 / 2
    assert torch.allclose(new.grad, expected, atol=1e-6)
    assert math.isclose(m["icepop_masked_frac"].item(), 2 / 3 + 1 / 2, rel_tol=1e-6)
    assert math.isclose(m["is_weight_mean"].item(), (3 + 1.2 + 0.4) / 3 + (0.6 + 2.5) / 2, rel_tol=1e-6)


def test_mis_drops_responses_above_sequence_threshold():
    # threshold 2 (log 2 = 0.693). Sequence log-ratio = sum of token log-ratios.
    # row 0 A=1: [0.5, 0.5] -> 1.0 > log 2: dropped (each token ratio e^.5 = 1.65 < 2 on its own).
    # row 1 A=1: [0.5, -0.5] -> 0: kept.   row 2 A=-1: [-3] -> kept (no lower gate).
    # row 3 A=1: [300] -> dropped; its overflowing ratio must not produce NaN gradients.
    new, old, adv, mask = _rows([[0.5, 0.5], [0.5, -0.5], [-3.0], [300.0]], [1.0, 1.0, -1.0, 1.0])
    loss_sum, m = mis_loss(new, old, adv, mask, threshold=2.0)
    row1 = -(math.exp(0.5) + math.exp(-0.5)) / 2
    row2 = math.exp(-3.0)
    assert math.isclose(loss_sum.item(), row1 + row2, rel_tol=1e-6)
    loss_sum.backward()
    g = new.grad
    assert torch.isfinite(g).all()
    expected = torch.zeros_like(g)
    expected[1, 1:3] = torch.tensor([-math.exp(0.5) / 2, -math.exp(-0.5) / 2])
    expected[2, 1] = math.exp(-3.0)
    assert torch.allclose(g, expected, atol=1e-6)
    assert m["mis_dropped"].item() == 2
    assert math.isclose(m["mis_log_seq_ratio"].item(), 1.0 + 0.0 - 3.0 + 300.0, rel_tol=1e-6)


@pytest.mark.parametrize("name", ["dapo", "tis", "icepop", "mis"])
def test_baselines_equal_reinforce_zero_when_no_safeguard_fires(name):
    # mild ratios (|log w| < 0.05), equal lengths (token mean == mean of response means): every
    # baseline must reduce to reinforce_zero, in value and gradient.
    g = torch.Generator().manual_seed(2)
    B, S = 4, 6
    old = -torch.rand(B, S, generator=g) - 0.5
    logp = old + (torch.rand(B, S, generator=g) - 0.5) * 0.02
    mask = torch.zeros(B, S)
    mask[:, 2:5] = 1.0
    adv = torch.randn(B, generator=g)
    rows = {"old_logprobs": old, "advantages": adv, "loss_mask": mask, "token_weight": token_weights_for_token_mean(mask)}
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    la, _ = make_loss_fn(AlgoConfig(name=name))(a, rows)
    lb, _ = make_loss_fn("reinforce_zero")(b, rows)
    la.backward()
    lb.backward()
    assert math.isclose(la.item(), lb.item(), rel_tol=1e-5)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_make_loss_fn_dispatch_and_validation():
    assert make_loss_fn("reinforce_zero").algo_name == "reinforce_zero"
    assert make_loss_fn(AlgoConfig()).algo_name == "reinforce_zero"
    for name in ["dapo", "tis", "icepop", "mis"]:
        assert make_loss_fn(AlgoConfig(name=name)).algo_name == name
    with pytest.raises(ValueError, match="AlgoConfig"):
        make_loss_fn("dapo")  # hyperparameters would silently be defaults
    with pytest.raises(ValueError, match="tis_cap"):
        make_loss_fn(AlgoConfig(name="tis", tis_cap=0.0))
    with pytest.raises(ValueError, match="icepop"):
        make_loss_fn(AlgoConfig(name="icepop", icepop_low=1.5, icepop_high=2.0))
    with pytest.raises(ValueError, match="dapo_eps"):
        make_loss_fn(AlgoConfig(name="dapo", dapo_eps_low=1.0))
    with pytest.raises(ValueError, match="mis_threshold"):
        make_loss_fn(AlgoConfig(name="mis", mis_threshold=-1.0))
