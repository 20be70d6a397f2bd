"""Applies a recipe's process settings to this process and, through the environment, to the ones it starts.

The recipe fields (megatron_rz.recipe) and where they go:

| recipe field | this process | processes it starts (environment) |
|---|---|---|
| `runtime.kernels` | `kernels.set_backend` | `RZ_KERNELS`, read by kernels/settings.py at import (vLLM's workers) |
| `runtime.gemm_small_tiles` | `kernels.set_gemm_small_tiles` | `RZ_GEMM_SMALL_TILES` (same) |
| `runtime.gemm_table` | `kernels.set_gemm_table` | `RZ_GEMM_TABLE` (same) |
| `runtime.native_cpu_kernels` | `RZ_KERNELS_NATIVE`, read by kernels/_native.py at the first kernel call | (same) |
| `runtime.vllm_patches` | - | `RZ_VLLM_PATCHES`, read by vllm_bridge/vllm_patches.py in every vLLM process |
| `runtime.te` | read by the Learner (megatron_rz.learner.te_spec.resolve_spec: the fast learner's layers); `on` where TE cannot run is refused by `rz train / check / bench` first | (every rank applies its recipe) |
| `checkpoint.verify` | `megatron_rz.manifest.set_verify` | (every rank applies its recipe) |
| `logging.verbose` | false: Megatron's import notices filtered | false: `VLLM_LOGGING_LEVEL=WARNING` unless set |
| `parallel.collective_timeout_s` | read by `megatron_rz.learner.model.init_parallel` | (every rank applies its recipe) |

`rz train / check / bench` call :func:`apply_runtime` right after the recipe loads, so
torchrun ranks (which run the same command) and vLLM's workers (started by rank 0 afterwards, with
its environment) all run with the recipe's settings. Code that drives a run itself calls it too.
"""

from __future__ import annotations

import os
import warnings

from megatron_rz.recipe import Recipe

# Import-time notices that are expected on a CPU host (Megatron's Transformer Engine / Apex fallbacks).
_QUIET = (r".*(Transformer Engine|Apex).*not installed.*", r".*full scope is deprecated.*")


def child_env(recipe: Recipe) -> dict[str, str]:
    """The environment variables that carry the recipe's settings into processes a run starts
    (also what a `vllm serve` on a rollout node needs)."""
    rt = recipe.runtime
    return {
        "RZ_KERNELS": rt.kernels,
        "RZ_GEMM_SMALL_TILES": "1" if rt.gemm_small_tiles else "0",
        "RZ_GEMM_TABLE": rt.gemm_table,
        "RZ_KERNELS_NATIVE": "1" if rt.native_cpu_kernels else "0",
        "RZ_VLLM_PATCHES": "1" if rt.vllm_patches else "0",
    }


def apply_runtime(recipe: Recipe) -> None:
    """Apply the recipe's process settings here and export them for the processes started later."""
    import kernels

    from megatron_rz.manifest import set_verify

    kernels.set_backend(recipe.runtime.kernels)
    kernels.set_gemm_small_tiles(recipe.runtime.gemm_small_tiles)
    kernels.set_gemm_table(recipe.runtime.gemm_table)
    set_verify(recipe.checkpoint.verify)
    os.environ.update(child_env(recipe))
    if not recipe.logging.verbose:  # keep the terminal for progress bars and results
        for pattern in _QUIET:
            warnings.filterwarnings("ignore", message=pattern)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
