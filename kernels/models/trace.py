"""Activation taps for `rz check`'s localiser: record (name, tensor) in forward order while on."""

from __future__ import annotations

import torch

# The reference functions (kernels.models.*) tap their layer inputs and outputs; both the
# full-sequence reference and the vLLM model classes (in vLLM's worker process) run them, so both
# record the same names; the learner records them with Megatron module hooks (megatron_rz.tools.localise).
_records: list | None = None


def tap(name: str, x: torch.Tensor) -> torch.Tensor:
    """Record a copy of ``x`` under ``name`` while tracing; return ``x`` unchanged."""
    if _records is not None:
        _records.append((name, x.detach().clone()))
    return x


def tracing() -> bool:
    """Whether taps are being recorded in this process."""
    return _records is not None


def start_trace() -> None:
    """Start recording (dropping anything recorded before)."""
    global _records
    _records = []


def stop_trace() -> list:
    """Stop recording; return the records since :func:`start_trace` ([] if none)."""
    global _records
    out, _records = _records or [], None
    return out
