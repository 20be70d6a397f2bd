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
    # device dispatch (kernels/dispatch.py): Triton for CUDA tensors, the exact reference otherwise
    "linear": "dispatch",
    "linear_partial": "dispatch",
    "linear_unreduced": "dispatch",
    "finish_unreduced": "dispatch",
    "Unreduced": "dispatch",
    "row_partials": "dispatch",
    "rms_norm": "dispatch",
    "qk_rms_norm": "dispatch",
    "add_rms_norm": "dispatch",
    "apply_rope": "dispatch",
    "attention": "dispatch",
    "causal_attention": "dispatch",
    "varlen_attention": "dispatch",
    "router_logits": "dispatch",
    "route": "dispatch",
    "swiglu": "dispatch",
    "swiglu_merged": "dispatch",
    "expert_mlp": "dispatch",
    "expert_mlp_merged": "dispatch",
    "moe_combine": "dispatch",
    "moe_experts": "dispatch",
    "moe_expert_rows": "dispatch",
    "lm_head_logits": "dispatch",
    "logprobs_from_logits": "dispatch",
    "log_softmax": "dispatch",
    "token_logprobs": "dispatch",
    # sampling post-processing (kernels/sampling.py): row-local torch ops on every device; rows
    # without top-k / top-p go through dispatch.logprobs_from_logits (Triton on CUDA)
    "sampled_logprobs": "sampling",
    "processed_logprobs": "sampling",
    "masked_logits": "sampling",
    "SamplingParams": "sampling",
    "truncation_active": "sampling",
    "untruncated": "sampling",
    "untruncated_logprobs": "sampling",
    "row_temperature_supported": "dispatch",
    "quantize_act_groupwise": "dispatch",
    "fp8_gemm": "dispatch",
    "fp8_linear": "dispatch",
    "fake_quant_linear": "dispatch",
    "set_backend": "settings",
    "backend": "settings",
    "set_gemm_small_tiles": "settings",
    "set_gemm_table": "settings",
    # device-agnostic (plain torch, exact per element on any device)
    "sum_partials": "gemm",
    "finish_linear": "gemm",
    "ROW_PARALLEL_K_SEGMENTS": "gemm",
    "rope_inv_freq": "rope",
    "rope_cos_sin": "rope",
    "stable_topk": "router",
    "silu": "moe",
    "tree_sum": "_common",
    # DeepSeek-V4 (kernels/dsv4.py): hyper-connections, compressed KV, indexer, sink attention
    "hc_mix": "dsv4",
    "hc_expand": "dsv4",
    "hc_head": "dsv4",
    "compress_windows": "dsv4",
    "indexer_scores": "dsv4",
    "select_entries": "dsv4",
    "sink_attention": "dsv4",
    "sqrtsoftplus": "dsv4",
    "swiglu_clamped": "dsv4",
    "quantize_weight_blockwise": "fp8",
    "dequantize_weight_blockwise": "fp8",
    "dequantize_act_groupwise": "fp8",
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
