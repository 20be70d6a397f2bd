"""reinforce-zero aligned kernels: batch-invariant exact CPU reference ops.

Contract: a token's result depends only on its own inputs (and, for attention, its own prefix), never
on batch size, batch composition, its position in the batch, or prefill vs decode vs chunked prefill.
See kernels/README.md. Imports torch only (lazily: ``import kernels`` itself loads nothing).

Not the Hugging Face ``kernels`` package; ``__reinforce_zero__`` marks this one.
"""

from __future__ import annotations

import importlib
from typing import Any

__reinforce_zero__ = True

_EXPORTS = {
    "linear": "gemm",
    "linear_partial": "gemm",
    "sum_partials": "gemm",
    "finish_linear": "gemm",
    "ROW_PARALLEL_K_SEGMENTS": "gemm",
    "rms_norm": "norm",
    "rope_inv_freq": "rope",
    "rope_cos_sin": "rope",
    "apply_rope": "rope",
    "attention": "attn",
    "causal_attention": "attn",
    "varlen_attention": "attn",
    "router_logits": "router",
    "route": "router",
    "stable_topk": "router",
    "silu": "moe",
    "swiglu": "moe",
    "expert_mlp": "moe",
    "expert_mlp_merged": "moe",
    "moe_combine": "moe",
    "moe_experts": "moe",
    "lm_head_logits": "logprobs",
    "logprobs_from_logits": "logprobs",
    "token_logprobs": "logprobs",
    "tree_sum": "_common",
}

__all__ = sorted(_EXPORTS) + ["__reinforce_zero__"]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
