"""CPU workarounds for megatron-core, applied once by `apply()` before any model is built.

Every patch below applies to megatron-core 0.16.1 (the newest release with a Python 3.11 wheel)
running without CUDA and without Transformer Engine. Each one is a small, local substitution of a
CUDA-only call; none changes the math of a forward or backward pass. Things that are not patched
but replaced by our own modules in the layer spec (RMSNorm, core attention) live in model.py.

`apply()` is idempotent and does nothing to modules that do not need it on a CUDA machine with TE
(it is still safe to call there: the substitutions only redirect CUDA RNG/device queries).
"""

from __future__ import annotations

import types

import torch

_APPLIED = False


class _CudaOnCpu:
    """Stands in for `torch.cuda` inside selected megatron modules: device and RNG queries go to
    the CPU; anything else falls through to the real `torch.cuda`."""

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchWithCpuCuda(types.ModuleType):
    """A `torch` look-alike whose `.cuda` is `_CudaOnCpu`; every other attribute is torch's."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def apply() -> None:
    """Install the CPU workarounds (idempotent). Call before building any Megatron module."""
    global _APPLIED
    if _APPLIED:
        return
    cpu_torch = _TorchWithCpuCuda()

    # 1. RNG tracker. tensor_parallel/random.py keeps per-parallel-region CUDA RNG states
    #    (model_parallel_cuda_manual_seed, CudaRNGStatesTracker.add/fork) through torch.cuda and
    #    torch._C._cuda_setRNGState, which fail without CUDA. Redirect them to the CPU generator.
    #    Applies to megatron-core 0.16.1.
    from megatron.core.tensor_parallel import random as mc_random

    mc_random.torch = cpu_torch
    mc_random._get_cuda_rng_state = _cpu_get_rng_state
    mc_random._set_cuda_rng_state = _cpu_set_rng_state

    # 2. Rotary embeddings. RotaryEmbedding.forward moves inv_freq to torch.cuda.current_device()
    #    on the first call (and the MLA/YaRN path builds on that device). Make "current device" the
    #    CPU. Applies to megatron-core 0.16.1.
    from megatron.core.models.common.embeddings import rotary_pos_embedding as mc_rope

    mc_rope.torch = cpu_torch

    # 3. MoE router. TopKRouter.gating moves its weight to torch.cuda.current_device() when it
    #    finds it on the CPU, and the expert-bias buffers are allocated there. Same redirection.
    #    Applies to megatron-core 0.16.1.
    from megatron.core.transformer.moe import router as mc_router

    mc_router.torch = cpu_torch

    # 4. MoE router GEMM. moe_utils imports te_general_gemm and the fused_* kernels only inside a
    #    `try: import transformer_engine`, so without TE those names are undefined and
    #    RouterGatingLinearFunction raises NameError (`if te_general_gemm is not None`). Define them
    #    as None so the plain torch.mm path and the unfused permute/topk paths are taken.
    #    Applies to megatron-core 0.16.1.
    from megatron.core.transformer.moe import moe_utils

    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)

    # 5. Multi-latent attention. Its `from megatron.core.extensions.transformer_engine import
    #    TEColumnParallelLinear, TELinear, ...` succeeds without TE (that module defines
    #    placeholders), so multi_latent_attention.HAVE_TE is wrongly True and MLASelfAttention's
    #    `isinstance(self.linear_proj, TELinear)` raises TypeError. Reset the flag to the truth.
    #    Applies to megatron-core 0.16.1.
    from megatron.core.transformer import multi_latent_attention as mc_mla

    try:
        import transformer_engine  # noqa: F401

        have_te = True
    except ImportError:
        have_te = False
    if not have_te:
        mc_mla.HAVE_TE = False

    # 6. Expert-bias bookkeeping. TopKRouter._apply_expert_bias (counts tokens per expert for the
    #    aux-loss-free bias update) is wrapped in megatron's jit_fuser = torch.compile, which on CPU
    #    runs Inductor and a C++ compiler: ~4 s per process and again for new shapes, for a few
    #    integer adds. Use the undecorated function (same result). Applies to megatron-core 0.16.1.
    from megatron.core.transformer.moe.router import TopKRouter

    orig = getattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable", None)
    if orig is not None:
        TopKRouter._apply_expert_bias = orig

    _APPLIED = True
