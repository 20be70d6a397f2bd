"""Triton GPU versions of the aligned ops (batch-invariant on their own device).

``import kernels.triton`` loads nothing: ``triton`` is imported only when an op is first used, so the
package stays importable on CPU-only machines. :func:`available` says whether the ops can run.

The GPU kernels do not reproduce the CPU reference's bits (different reduction trees); each is
invariant on its own: a token's result never depends on the batch size, the other rows, its position
or prefill vs decode. The learner and the rollout engine must both call these (same segmentation,
same configs table). See kernels/README.md and the module docstrings.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "linear": "gemm",
    "matmul": "gemm",
    "default_k_segments": "gemm",
    "pick_config": "gemm",
    "GemmConfig": "gemm",
    "CONFIGS": "gemm",
    "rms_norm": "rmsnorm",
    "logprobs_from_logits": "logprobs",
    "log_softmax": "logprobs",
    "token_logprobs": "logprobs",
    "attention": "attn",
    "attention_batched": "attn",
    "paged_attention": "attn",
    "paged_kv_write": "attn",
    "apply_rope": "rope",
    "route": "router",
    "swiglu": "moe",
    "moe_combine": "moe",
    "moe_experts": "moe",
    "moe_experts_merged": "moe",
    "grouped_linear": "moe",
    "quantize_act_groupwise": "fp8",
    "fp8_gemm": "fp8",
    "fp8_linear": "fp8",
}

__all__ = sorted(_EXPORTS) + ["available"]


def available() -> bool:
    """True when CUDA and an importable Triton are present."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'kernels.triton' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
