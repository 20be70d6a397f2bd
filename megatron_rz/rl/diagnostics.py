"""Mismatch and off-policy diagnostics between the rollout engine and the learner.

All statistics are over response tokens (loss_mask == 1). With w = pi_learner / pi_rollout:
- D3 = mean(w - 1 - log w), which is also the k3 estimator of KL(rollout || learner);
- kl_k1 = mean(logp_rollout - logp_learner), the plain (unbiased, noisy) estimator;
- ess = (sum w)^2 / (n * sum w^2), the normalised effective sample size (1.0 = on-policy);
- frac_bitwise = fraction of tokens whose two logprobs are equal bit for bit;
- tokens_outside_kept = sampled tokens the learner gives logprob -inf (outside its top-k / top-p
  kept set: possible with policy lag or in fast mode, never at lag 0 in aligned mode); their w is
  exactly 0 (in the w statistics) and they are left out of D3, kl_k1 and the |dlogp| figures, which
  would be infinite;
- entropy_est = -mean(logp_rollout): the sampled tokens' mean surprisal, a Monte-Carlo estimate of
  the rollout policy's per-token entropy (exact entropy needs the full vocabulary distribution,
  which neither engine returns per token).
"""

from __future__ import annotations

import statistics

import torch


def mismatch_stats(learner_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    sel = mask.bool()
    new = learner_logp[sel].to(torch.float64)
    old = rollout_logp[sel].to(torch.float64)
    if new.numel() == 0:
        return {}
    log_w = new - old
    w = log_w.exp()  # exactly 0 for a token outside the learner's kept set (logp -inf)
    fin = torch.isfinite(log_w)
    lw = log_w[fin] if not bool(fin.all()) else log_w
    wf = w[fin] if not bool(fin.all()) else w
    nan = float("nan")
    return {
        "d3": (wf - 1 - lw).mean().item() if lw.numel() else nan,
        "kl_k1": (-lw).mean().item() if lw.numel() else nan,
        "max_abs_dlogp": lw.abs().max().item() if lw.numel() else nan,
        "mean_abs_dlogp": lw.abs().mean().item() if lw.numel() else nan,
        "tokens_outside_kept": int((~fin).sum()),
        "frac_bitwise": (learner_logp[sel] == rollout_logp[sel]).double().mean().item(),
        "is_w_mean": w.mean().item(),
        "is_w_max": w.max().item(),
        "is_w_min": w.min().item(),
        "ess": (w.sum() ** 2 / (w.numel() * (w**2).sum())).item(),
        "tokens": int(new.numel()),
        "entropy_est": (-old).mean().item(),
    }


class RunningRatio:
    """Peak / median of a series (the paper's D3 stability figure)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def add(self, v: float) -> float:
        self.values.append(v)
        med = statistics.median(self.values)
        return max(self.values) / med if med > 0 else float("inf") if max(self.values) > 0 else 1.0
