"""Token log-probabilities from the final hidden states.

    logits = linear(hidden, lm_head_weight)            # row-invariant, rounded to hidden.dtype
    lp     = (logits.float() / temperature).log_softmax(dim=-1, dtype=torch.float32)
    out    = lp.gather(-1, targets)

This is the same call sequence as vLLM's sampler with ``logprobs_mode="processed_logprobs"``
(``raw_logprobs`` = temperature 1). ``torch.log_softmax`` over the last dimension is row-invariant
on CPU (each row is reduced by the same vectorised code whatever the number of rows; checked by the
tests), so it is used as is. Temperature must be > 0; division (not multiplication by 1/T) is used.
"""

from __future__ import annotations

from typing import Optional

import torch

from .gemm import linear

__all__ = ["lm_head_logits", "logprobs_from_logits", "token_logprobs"]


def lm_head_logits(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, *, out_dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """``hidden[..., H] @ lm_head_weight[V, H].T`` (row-invariant), in ``out_dtype or hidden.dtype``."""
    return linear(hidden, lm_head_weight, out_dtype=out_dtype)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-probability of ``targets[...]`` under ``softmax(logits.float() / temperature)``."""
    if not temperature > 0:
        raise ValueError("temperature must be > 0")
    lp = (logits.to(torch.float32) / temperature).log_softmax(dim=-1, dtype=torch.float32)
    return lp.gather(-1, targets.to(torch.long).unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    logits_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """fp32 ``[...]`` log-probs of ``targets[...]`` given ``hidden[..., H]``. Differentiable."""
    logits = lm_head_logits(hidden, lm_head_weight, out_dtype=logits_dtype)
    return logprobs_from_logits(logits, targets, temperature)
