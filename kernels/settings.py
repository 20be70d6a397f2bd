"""Process-wide kernel settings: the op backend and the GPU GEMM tile table.

Set them with :func:`set_backend` / :func:`set_gemm_small_tiles` (``megatron_rz.launch.runtime`` does, from
the recipe's ``runtime`` section). Processes started for a run (vLLM's workers, torchrun ranks) read
their start values from the environment the launcher sets: ``RZ_KERNELS`` (``auto`` | ``reference``)
and ``RZ_GEMM_SMALL_TILES`` (``1`` | ``0``).
"""

from __future__ import annotations

import os

BACKENDS = ("auto", "reference")

_backend = os.environ.get("RZ_KERNELS", "auto")
_small_tiles = os.environ.get("RZ_GEMM_SMALL_TILES", "1") != "0"


def set_backend(name: str) -> None:
    """``"auto"`` (Triton for CUDA tensors) or ``"reference"`` (the exact reference everywhere)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernels backend {name!r}: must be 'auto' or 'reference'")
    _backend = name


def backend() -> str:
    """The op backend in force (``auto`` | ``reference``)."""
    return _backend


def set_gemm_small_tiles(on: bool) -> None:
    """GPU GEMM: use the short-K tile table (same bits either way; only speed differs)."""
    global _small_tiles
    _small_tiles = bool(on)


def gemm_small_tiles() -> bool:
    """Whether the GPU GEMM picks its short-K tile table."""
    return _small_tiles
