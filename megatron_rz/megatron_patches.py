"""Workarounds that let megatron-core run on a CPU host without Transformer Engine, installed
once by `apply()` before any model is built.

Every patch applies to megatron-core 0.16.1 (the newest release with a Python 3.11 wheel). Each
one substitutes a module-level name or one function: CUDA device/RNG/stream calls go to the CPU,
names that are undefined without TE get their "absent" value, and one torch.compile wrapper is
removed. None changes the arithmetic of a forward or backward pass. What is handled by choosing
modules in the layer spec instead of patching (HF-style RMSNorm, plain causal core attention,
replicated MLA kv down-projection, expert-weight DDP grouping) lives in model.py.

`apply()` is idempotent. The CUDA redirections are installed only when CUDA is unavailable; the
two Transformer-Engine-absence fixes whenever TE is missing.
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

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int)  # a CUDA ordinal


def _on_cpu(factory):
    """Wrap a tensor factory (torch.zeros, torch.tensor, ...) so device='cuda' becomes the CPU."""

    def wrapped(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapped


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")


class _TorchWithCpuCuda(types.ModuleType):
    """A `torch` look-alike for selected megatron modules: `.cuda` is `_CudaOnCpu` and tensor
    factories called with device='cuda' allocate on the CPU; every other attribute is torch's."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


@torch.no_grad()
def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


def _l2_norm_cpu(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    norms = [torch.norm(t) for tensors in tensor_lists for t in tensors]
    total = torch.norm(torch.stack(norms)) if norms else torch.zeros(())
    return total.reshape(1).float(), None


def _global_buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    numel = 1
    for d in tensor_shape:
        numel *= d
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < numel:
        buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device="cpu")
    return buf[0:numel].view(*tensor_shape)


def _cuda_type_names(fn):
    """Run ``fn`` while a CPU float tensor's ``type()`` answers with the CUDA type name (the
    distributed optimizer sorts parameters by ``param.type() == 'torch.cuda.FloatTensor'``)."""
    import functools

    real = torch.Tensor.type

    def as_cuda(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw and self.device.type == "cpu":
            name = real(self)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") else name
        return real(self, dtype, non_blocking, **kw)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        torch.Tensor.type = as_cuda
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = real

    return wrapped


def distributed_optimizer_state(optimizer) -> list | None:
    """The parameter state (fp32 main-param shards, Adam moments) of every DistributedOptimizer in
    ``optimizer`` (a ChainedOptimizer holds one per parameter group family), or None if there is
    none. DistributedOptimizer.state_dict() leaves this state out by design; this is what a
    per-rank checkpoint must add.

    Megatron-core 0.16.1's load_parameter_state_from_dp_reshardable skips entries whose
    'padding' flag is set but get_parameter_state_dp_reshardable writes no such flag (KeyError on
    load); the entries are marked here. Load with load_distributed_optimizer_state (after
    optimizer.load_state_dict), which also works around the shared-step bug described there."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]
    if not opts:
        return None
    out = []
    for o in opts:
        st = o.get_parameter_state_dp_reshardable()
        for key, per_dtype in st.items():
            if isinstance(key, int):
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for elem in bucket:
                            elem.setdefault("padding", False)
                            for k, v in list(elem.items()):
                                if torch.is_tensor(v):
                                    elem[k] = v.detach().clone()
        out.append(st)
    return out


def load_distributed_optimizer_state(optimizer, states: list) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]
    if len(opts) != len(states):
        raise ValueError(f"checkpoint has state for {len(states)} distributed optimizer(s), this learner has {len(opts)}")
    with torch.no_grad():  # fp32 main params are views of parameters that require grad
        for o, st in zip(opts, states):
            # DistributedOptimizer.load_state_dict (megatron-core 0.16.1, torch optimizers, i.e.
            # without apex/TE) gives every parameter's Adam state the SAME "step" tensor; torch's
            # Adam then increments it once per parameter per step, so bias corrections go wrong
            # after a resume. One tensor per parameter, as a fresh optimizer has.
            for per_param in o.optimizer.state.values():
                if torch.is_tensor(per_param.get("step")):
                    per_param["step"] = per_param["step"].clone()
            o.load_parameter_state_from_dp_reshardable(st)


def apply() -> None:
    """Install the workarounds (idempotent). Call before building any Megatron module.

    Patches 1-2 are for a host without Transformer Engine (also needed on GPUs without TE);
    patches 3-11 redirect CUDA-only calls and are installed only when CUDA is unavailable.
    """
    global _APPLIED
    if _APPLIED:
        return

    # 1. MoE router GEMM. moe_utils imports te_general_gemm and the fused_* kernels only inside a
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

    # 2. Multi-latent attention. Its `from megatron.core.extensions.transformer_engine import
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

    if torch.cuda.is_available():
        _APPLIED = True
        return
    cpu_torch = _TorchWithCpuCuda()

    # 3. RNG tracker. tensor_parallel/random.py keeps per-parallel-region CUDA RNG states
    #    (model_parallel_cuda_manual_seed, CudaRNGStatesTracker.add/fork) through torch.cuda and
    #    torch._C._cuda_setRNGState, which fail without CUDA. Redirect them to the CPU generator.
    #    Applies to megatron-core 0.16.1.
    from megatron.core.tensor_parallel import random as mc_random

    mc_random.torch = cpu_torch
    mc_random._get_cuda_rng_state = _cpu_get_rng_state
    mc_random._set_cuda_rng_state = _cpu_set_rng_state

    # 4. Rotary embeddings. RotaryEmbedding.forward moves inv_freq to torch.cuda.current_device()
    #    on the first call (and the MLA/YaRN path builds on that device). Make "current device" the
    #    CPU. Applies to megatron-core 0.16.1.
    from megatron.core.models.common.embeddings import rotary_pos_embedding as mc_rope

    mc_rope.torch = cpu_torch

    # 5. MoE router. TopKRouter.gating moves its weight to torch.cuda.current_device() when it
    #    finds it on the CPU, and the expert-bias buffers are allocated there. Same redirection.
    #    Applies to megatron-core 0.16.1.
    from megatron.core.transformer.moe import router as mc_router

    mc_router.torch = cpu_torch

    # 6. Expert-bias bookkeeping. TopKRouter._apply_expert_bias (counts tokens per expert for the
    #    aux-loss-free bias update) is wrapped in megatron's jit_fuser = torch.compile, which on CPU
    #    runs Inductor and a C++ compiler: ~4 s per process and again for new shapes, for a few
    #    integer adds. Use the undecorated function (same result). Applies to megatron-core 0.16.1.
    from megatron.core.transformer.moe.router import TopKRouter

    orig = getattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable", None)
    if orig is not None:
        TopKRouter._apply_expert_bias = orig

    # 7. Megatron DDP grad buffers and the Megatron optimizer. _ParamAndGradBuffer allocates the
    #    contiguous param/grad buffers on torch.cuda.current_device(); MegatronOptimizer and
    #    clip_grads create their scalars (grad-norm accumulators, found_inf, loss scale) with
    #    device='cuda'. Redirect those allocations to the CPU. Applies to megatron-core 0.16.1.
    from megatron.core.distributed import distributed_data_parallel as mc_ddp
    from megatron.core.distributed import param_and_grad_buffer as mc_buf
    from megatron.core.optimizer import clip_grads as mc_clip
    from megatron.core.optimizer import optimizer as mc_opt

    for mod in (mc_ddp, mc_buf, mc_clip, mc_opt):
        mod.torch = cpu_torch

    # 8. Gradient clipping. clip_grads.clip_grad_by_total_norm_fp32 asserts
    #    `param.grad.type() == 'torch.cuda.FloatTensor'`, false for CPU tensors. Use the same
    #    operation (multiply every fp32 grad by max_norm / (total_norm + 1e-6) when that is < 1)
    #    without the CUDA type check. Applies to megatron-core 0.16.1.
    mc_opt.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    mc_clip.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    # 9. Grad-norm kernel fallback. Without apex/TE, clip_grads uses
    #    megatron.core.utils.local_multi_tensor_l2_norm, which returns its result with
    #    device="cuda". Use the same computation (norm of per-tensor norms) returning a CPU tensor.
    #    Applies to megatron-core 0.16.1.
    if getattr(mc_clip, "l2_norm_impl", None) is not None and mc_clip.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm":
        mc_clip.l2_norm_impl = _l2_norm_cpu

    # 10. Tensor-parallel communication. tensor_parallel/mappings.py allocates the outputs of its
    #     all-gather / reduce-scatter (sequence parallelism, vocab-parallel embedding) on
    #     torch.cuda.current_device(), and tensor_parallel/layers.py does the same for the
    #     sequence-parallel input gather of Column/RowParallelLinear (forward and backward).
    #     Gloo runs these collectives on CPU tensors, so allocate on the CPU.
    #     Applies to megatron-core 0.16.1.
    from megatron.core.tensor_parallel import layers as mc_layers
    from megatron.core.tensor_parallel import mappings as mc_mappings

    mc_mappings.torch = cpu_torch
    mc_layers.torch = cpu_torch

    # 11. Global memory buffer. utils.GlobalMemoryBuffer.get_tensor (the reusable all-gather
    #     buffer of sequence-parallel linears) allocates on torch.cuda.current_device(). Same
    #     method, allocating on the CPU. Applies to megatron-core 0.16.1.
    from megatron.core import utils as mc_utils

    mc_utils.GlobalMemoryBuffer.get_tensor = _global_buffer_get_tensor

    # 12. Distributed optimizer (ZeRO-1: fp32 master weights and Adam moments sharded over the
    #     data-parallel ranks). DistributedOptimizer accepts only parameters whose type() is
    #     'torch.cuda.{Float,Half,BFloat16}Tensor' (TypeError for CPU tensors) and allocates its
    #     scratch tensors on torch.cuda.current_device(). Build it with CPU tensors answering to the
    #     CUDA type names, and allocate on the CPU; the gloo collectives it uses
    #     (reduce_scatter_tensor, all_gather_into_tensor) work on CPU tensors in torch 2.13.
    #     Applies to megatron-core 0.16.1.
    from megatron.core.optimizer import distrib_optimizer as mc_distopt

    mc_distopt.torch = cpu_torch
    mc_distopt.DistributedOptimizer.__init__ = _cuda_type_names(mc_distopt.DistributedOptimizer.__init__)

    _APPLIED = True
