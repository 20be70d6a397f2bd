"""Row-invariant RMSNorm (also usable as per-head q/k norm: it normalises the last dimension).

Dtype rules (same structure as the Hugging Face Qwen3/Llama RMSNorm):
    x32  = x.float()
    ms   = tree_sum(x32 * x32, -1) / D          # fixed adjacent-pair tree, fp32
    inv  = 1 / sqrt(ms + eps)                   # IEEE sqrt and division, NOT torch.rsqrt
    y    = (x32 * inv).to(x.dtype)              # rounded once to the input dtype
    out  = (y.float() * weight.float()).to(x.dtype)

``1 / sqrt`` (two correctly rounded IEEE ops) is used instead of ``torch.rsqrt``: on CPU rsqrt's
vectorised and scalar paths agreed for positive inputs (they differ only in NaN payloads), but GPU
rsqrt is an approximation; the IEEE form is reproducible anywhere with correctly rounded sqrt/div.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import tree_sum

__all__ = ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape); ``weight`` [D] or None.

    Differentiable with plain autograd (every op used is differentiable).
    """
    D = x.shape[-1]
    x32 = x.to(torch.float32)
    ms = tree_sum(x32 * x32, dim=-1, keepdim=True) / D
    inv = 1.0 / torch.sqrt(ms + eps)
    y = (x32 * inv).to(x.dtype)
    if weight is None:
        return y
    return (y.to(torch.float32) * weight.to(torch.float32)).to(x.dtype)
