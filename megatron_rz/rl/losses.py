"""Policy-gradient losses.

REINFORCE Zero: per-token importance weight w = exp(logp_learner - logp_rollout), untruncated (no
clip, no mask, no gate); advantage A = reward - mean reward of the prompt's group; each response's
loss is the token mean of -w * A; the batch loss is the mean over responses; no critic.

Since d/dtheta w = w * d/dtheta logp, the gradient of -w * A is the importance-weighted
policy gradient -w * A * grad logp, which is unbiased for the current policy however old the
rollout policy was (up to the variance the weight brings).

Losses follow the learner's convention (megatron_rz.learner.learner.Learner.train_step): they return the
SUM over the micro batch's responses; the learner divides by the number of responses in the
whole batch, so micro-batching and data parallelism do not change the result.

Comparison baselines (same convention, chosen by `make_loss_fn(recipe.algo)`): dapo (clip-higher
ratio clipping, token-level aggregation), tis (truncated weight min(w, C)), icepop (tokens with w
outside [low, high] masked), mis (responses whose sequence ratio exceeds a threshold dropped).
Batch-level pieces of DAPO (overlong shaping, dynamic sampling, token weights) live in
megatron_rz.rl.batch_filters.
"""

from __future__ import annotations

import math

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


# --------------------------------------------------------------------------- comparison baselines
#
# Shared conventions of the baselines below (same as reinforce_zero_loss):
#   logp, old_logprobs, loss_mask: [b, S]; advantages: [b]; w = exp(logp - old_logprobs) per token.
#   The returned loss and every metric are SUMS over the micro batch's rows; the learner divides
#   both by B, the number of responses in the whole batch. Each metric's docstring line says what
#   that division yields.
# Non-response positions (loss_mask == 0) and tokens a loss discards get log w := 0 BEFORE the exp,
# so an overflowing ratio on a discarded token cannot turn its zero gradient into NaN (0 * inf).


def _log_ratio(logp: torch.Tensor, old_logprobs: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """logp - old on active tokens, exactly 0 (no gradient) elsewhere."""
    return torch.where(active, logp - old_logprobs.to(logp.dtype), torch.zeros_like(logp))


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of x over response tokens: [b, S] -> [b]. Rows without tokens give 0."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


def dapo_loss(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    token_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO clipped surrogate with clip-higher and token-level aggregation.

    Per token, with r = exp(logp - old) and the response's advantage A:
        l_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    i.e. the constant -(1 + eps_high) * A where A > 0 and r > 1 + eps_high (clipped high), the
    constant -(1 - eps_low) * A where A < 0 and r < 1 - eps_low (clipped low), -r * A otherwise.
    Gradient w.r.t. logp_t: -r * A on unclipped tokens, exactly 0 on clipped ones. There is no
    upper bound for A < 0 (DAPO has no dual clip).

    Aggregation. DAPO's objective is the mean of l_t over ALL response tokens of the batch
    (sum_i sum_t l_it / sum_i |y_i|), so long responses weigh more than in a per-response mean.
    The learner computes sum over rows / B, so the trainer passes the per-row tensor

        token_weight[i] = B / N,   B = rows in the batch, N = sum of loss_mask over the whole batch

    (megatron_rz.rl.batch_filters.token_weights_for_token_mean) and this returns
    sum_i token_weight[i] * sum_t l_it; then sum / B = sum_it l_it / N, the batch token mean,
    whatever the micro-batching or data-parallel split (token_weight is computed on the whole batch
    before it is split). token_weight=None falls back to the per-response token mean (GRPO-style
    aggregation), for use outside the trainer.

    Metrics (sums; /B gives the batch token fraction with token_weight, else the mean over
    responses of the per-response fraction): clip_frac_low, clip_frac_high, clip_frac, ratio_mean.
    """
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"dapo needs 0 <= eps_low < 1 and eps_high >= 0 (got {eps_low}, {eps_high})")
    active = loss_mask > 0
    mask = loss_mask.to(logp.dtype)
    A = advantages.to(logp.dtype)[:, None].expand_as(logp)
    with torch.no_grad():
        log_r = (logp - old_logprobs.to(logp.dtype)).detach()
        clip_high = active & (A > 0) & (log_r > math.log1p(eps_high))
        clip_low = active & (A < 0) & (log_r < math.log1p(-eps_low))
        clipped = clip_high | clip_low
    r = torch.exp(_log_ratio(logp, old_logprobs, active & ~clipped))
    per_tok = torch.where(
        clip_high, -(1.0 + eps_high) * A, torch.where(clip_low, -(1.0 - eps_low) * A, -r * A)
    )
    per_tok = per_tok * mask

    if token_weight is None:
        row_w = 1.0 / mask.sum(dim=1).clamp_min(1.0)
    else:
        row_w = token_weight.to(logp.dtype).reshape(-1)
        if row_w.shape[0] != logp.shape[0]:
            raise ValueError(f"token_weight has {row_w.shape[0]} rows, logp has {logp.shape[0]}")
    loss = (per_tok.sum(dim=1) * row_w).sum()

    def agg(x: torch.Tensor) -> torch.Tensor:
        return ((x.to(logp.dtype) * mask).sum(dim=1) * row_w).sum().detach()

    r_all = torch.exp(_log_ratio(logp.detach(), old_logprobs, active))
    metrics = {
        "clip_frac_low": agg(clip_low),
        "clip_frac_high": agg(clip_high),
        "clip_frac": agg(clipped),
        "ratio_mean": agg(r_all),
    }
    return loss, metrics


def tis_loss(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling (Yao et al., 2025): the policy gradient weighted by the
    truncated ratio min(w, C) used as a constant coefficient.

    Per token l_t = -min(w_t, C).detach() * exp(logp_t - logp_t.detach()) * A: its value is
    -min(w_t, C) * A and its gradient w.r.t. logp_t is -min(w_t, C) * A / T_i, so truncated tokens
    still push with weight C (unlike PPO-style clipping, which zeroes them). Each response's loss
    is the token mean; the sum over rows is returned.

    Metrics (sums; /B gives means over responses of per-response token means): tis_trunc_frac,
    is_weight_mean (untruncated w), tis_weight_mean (min(w, C)).
    """
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0 (got {cap})")
    active = loss_mask > 0
    mask = loss_mask.to(logp.dtype)
    with torch.no_grad():
        log_w = _log_ratio(logp.detach(), old_logprobs, active)
        trunc = active & (log_w >= math.log(cap))
        coef = torch.where(trunc, torch.full_like(log_w, cap), log_w.exp())
    # exp(logp - logp.detach()) == 1 in value, d/dlogp == 1: carries the gradient of logp.
    w_t = coef * torch.exp(torch.where(active, logp - logp.detach(), torch.zeros_like(logp)))
    per_row = -_row_mean(w_t * advantages.to(logp.dtype)[:, None], mask)
    metrics = {
        "tis_trunc_frac": _row_mean(trunc.to(logp.dtype), mask).sum().detach(),
        "is_weight_mean": _row_mean(log_w.exp(), mask).sum(),
        "tis_weight_mean": _row_mean(coef, mask).sum(),
    }
    return per_row.sum(), metrics


def icepop_loss(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IcePop token masking on top of reinforce_zero.

    Tokens with w outside [low, high] (bounds inclusive: kept iff low <= w <= high) contribute
    nothing; the rest contribute -w * A as in reinforce_zero. Each response's loss is the sum over
    kept tokens divided by ALL its response tokens (masking removes tokens, it does not re-weight
    the survivors). Gradient w.r.t. logp_t: -w_t * A / T_i on kept tokens, 0 on masked ones.

    Metrics (sums; /B gives means over responses): icepop_masked_frac (per-response fraction of
    masked tokens), is_weight_mean (all response tokens, unmasked w).
    """
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"icepop needs 0 <= low <= 1 <= high (got low={low}, high={high})")
    active = loss_mask > 0
    mask = loss_mask.to(logp.dtype)
    with torch.no_grad():
        log_w = _log_ratio(logp.detach(), old_logprobs, active)
        w_d = log_w.exp()
        keep = active & (w_d >= low) & (w_d <= high)
    w = torch.exp(_log_ratio(logp, old_logprobs, keep)) * keep.to(logp.dtype)
    per_row = -_row_mean(w * advantages.to(logp.dtype)[:, None], mask)
    metrics = {
        "icepop_masked_frac": _row_mean((active & ~keep).to(logp.dtype), mask).sum(),
        "is_weight_mean": _row_mean(w_d, mask).sum(),
    }
    return per_row.sum(), metrics


def mis_loss(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sequence-level masked importance sampling (MIS) gate on top of reinforce_zero.

    Sequence ratio: the full likelihood ratio of the response, as in sequence-level MIS,
        rho_i = pi_learner(y_i) / pi_rollout(y_i) = exp(sum_t (logp_it - old_it))
    (the product of token ratios, not their geometric mean), compared in log space
    (sum_t log w_it > log threshold) so it never overflows. Responses with rho_i > threshold are
    dropped: zero loss and zero gradient. Kept responses contribute their reinforce_zero loss
    (token mean of -w * A), so this is reinforce_zero with a one-sided sequence gate; the gate is
    computed without gradient. Only ratios above the threshold are gated (rho small is not).

    Metrics (sums; /B gives fractions / means over responses): mis_dropped (count of dropped
    responses), mis_log_seq_ratio (sum_t log w), is_weight_mean.
    """
    if threshold <= 0:
        raise ValueError(f"mis threshold must be > 0 (got {threshold})")
    active = loss_mask > 0
    mask = loss_mask.to(logp.dtype)
    with torch.no_grad():
        log_w = _log_ratio(logp.detach(), old_logprobs, active)
        log_rho = log_w.sum(dim=1)
        dropped = log_rho > math.log(threshold)
    kept_tokens = active & ~dropped[:, None]
    w = torch.exp(_log_ratio(logp, old_logprobs, kept_tokens)) * kept_tokens.to(logp.dtype)
    per_row = -_row_mean(w * advantages.to(logp.dtype)[:, None], mask)
    metrics = {
        "mis_dropped": dropped.to(torch.float64).sum(),
        "mis_log_seq_ratio": log_rho.to(torch.float64).sum(),
        "is_weight_mean": _row_mean(log_w.exp(), mask).sum(),
    }
    return per_row.sum(), metrics


LOSS_NAMES = ("reinforce_zero", "dapo", "tis", "icepop", "mis")


def make_loss_fn(algo):
    """The loss callable the learner calls per micro batch: loss_fn(logp, rows) -> (loss_sum, metric_sums).

    `algo` is the recipe's AlgoConfig (its name picks the loss, its fields the hyperparameters).
    A plain string is accepted for "reinforce_zero" only (it has no hyperparameters); the baselines
    need the AlgoConfig so that their settings cannot silently fall back to defaults.

    rows always carries old_logprobs [b, S], advantages [b], loss_mask [b, S]; "dapo" also needs
    token_weight [b] (batch_filters.token_weights_for_token_mean on the WHOLE batch's loss_mask).
    """
    if isinstance(algo, str):
        if algo != "reinforce_zero":
            raise ValueError(
                f"make_loss_fn({algo!r}): pass the AlgoConfig (recipe.algo) for the baselines so their "
                f"hyperparameters are used; a plain string is only accepted for 'reinforce_zero' "
                f"(available: {', '.join(LOSS_NAMES)})"
            )
        name = algo
    else:
        name = algo.name
    if name not in LOSS_NAMES:
        raise ValueError(f"unknown algo.name {name!r}; available: {', '.join(LOSS_NAMES)}")

    def common(rows):
        return rows["old_logprobs"], rows["advantages"], rows["loss_mask"]

    if name == "reinforce_zero":

        def loss_fn(logp: torch.Tensor, rows: dict[str, torch.Tensor]):
            return reinforce_zero_loss(logp, *common(rows))

    elif name == "dapo":
        eps_low, eps_high = float(algo.dapo_eps_low), float(algo.dapo_eps_high)
        if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
            raise ValueError(
                f"algo.dapo_eps_low={eps_low} / dapo_eps_high={eps_high}: need 0 <= eps_low < 1 and eps_high >= 0"
            )

        def loss_fn(logp: torch.Tensor, rows: dict[str, torch.Tensor]):
            if "token_weight" not in rows:
                raise KeyError(
                    "dapo's token-level aggregation needs a per-row 'token_weight' tensor: pass "
                    "token_weight=batch_filters.token_weights_for_token_mean(batch.loss_mask) to train_step"
                )
            return dapo_loss(logp, *common(rows), eps_low=eps_low, eps_high=eps_high, token_weight=rows["token_weight"])

    elif name == "tis":
        cap = float(algo.tis_cap)
        if cap <= 0:
            raise ValueError(f"algo.tis_cap={cap} must be > 0 (typical: 2.0)")

        def loss_fn(logp: torch.Tensor, rows: dict[str, torch.Tensor]):
            return tis_loss(logp, *common(rows), cap=cap)

    elif name == "icepop":
        low, high = float(algo.icepop_low), float(algo.icepop_high)
        if not 0 <= low <= 1 <= high:
            raise ValueError(f"algo.icepop_low={low} / icepop_high={high}: need 0 <= low <= 1 <= high (typical 0.5, 2.0)")

        def loss_fn(logp: torch.Tensor, rows: dict[str, torch.Tensor]):
            return icepop_loss(logp, *common(rows), low=low, high=high)

    else:  # mis
        threshold = float(algo.mis_threshold)
        if threshold <= 0:
            raise ValueError(f"algo.mis_threshold={threshold} must be > 0 (typical: 2.0)")

        def loss_fn(logp: torch.Tensor, rows: dict[str, torch.Tensor]):
            return mis_loss(logp, *common(rows), threshold=threshold)

    loss_fn.algo_name = name
    return loss_fn
