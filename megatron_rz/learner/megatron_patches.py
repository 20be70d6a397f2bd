"""Workarounds that let megatron-core run on a CPU host without Transformer Engine, installed
once by `apply()` before any model is built.

Every patch applies to megatron-core 0.16.1 (the newest release with a Python 3.11 wheel). Each
one substitutes a module-level name or one function: CUDA device/RNG/stream calls go to the CPU,
names that are undefined without TE get their "absent" value, and one torch.compile wrapper is
removed. None changes the arithmetic of a forward or backward pass. What is handled by choosing
modules in the layer spec instead of patching (HF-style RMSNorm, plain causal core attention,
replicated MLA kv down-projection, expert-weight DDP grouping) lives in model.py.

`apply()` is idempotent. The CUDA redirections are installed only when CUDA is unavailable; the
Transformer-Engine-absence fixes (1, 2) whenever TE is missing, 2b, 2c and 2d (torch's optimizer also
where TE imports) always. Checkpoint helpers used around dist_checkpointing saves and loads
(init_adam_state, unshare_adam_steps) live here too.
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


def _set_main_param_and_optimizer_states_torch_adam(orig):
    """DistributedOptimizer._set_main_param_and_optimizer_states for torch's Adam (no apex/TE):
    copy the tensors given (param, exp_avg, exp_avg_sq); the Adam "step" is loaded separately."""
    import functools

    @functools.wraps(orig)
    def setter(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            dst[key].copy_(value)

    return setter


def _keep_zero_common_step(orig, nested: bool):
    """Wrap FP32Optimizer / Float16OptimizerWithFloat16Params.sharded_state_dict so a common Adam
    step of 0 is saved too (megatron-core 0.16.1 writes it under ``if step:``, dropping 0)."""
    import functools

    @functools.wraps(orig)
    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
        sd = orig(self, model_sharded_state_dict, is_loading, metadata)
        state = sd["optimizer"]["state"] if nested else sd["state"]
        if not is_loading and "common_step" not in state:
            steps = [v["step"] for v in self.optimizer.state.values() if torch.is_tensor(v.get("step"))]
            if steps:
                state["common_step"] = steps[0]
        return sd

    return sharded_state_dict


def init_adam_state(optimizer) -> None:
    """Before ``optimizer.sharded_state_dict(...)`` (save or load) when no update ran yet.

    torch's Adam allocates its state (step, exp_avg, exp_avg_sq) at the first step, so before it a
    Megatron optimizer's sharded_state_dict has no moments: a checkpoint saved then cannot be
    loaded into a learner that has taken a step (dist_checkpointing: "...exp_avg... not in state
    dict"), and megatron-core 0.16.1's DistributedOptimizer.sharded_state_dict on a fresh optimizer
    (torch Adam, no apex/TE) fails in state_dict() (``assert len(steps) == 1``). Allocate what
    torch's Adam would at its first step (step 0, zero moments): the next update is the same one."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def unshare_adam_steps(optimizer) -> None:
    """After ``optimizer.load_state_dict``. DistributedOptimizer.load_state_dict (megatron-core
    0.16.1, torch optimizers, i.e. without apex/TE) gives every parameter's Adam state the SAME
    "step" tensor; torch's Adam then increments it once per parameter per step, so bias
    corrections go wrong after a resume. One tensor per parameter, as a fresh optimizer has."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for per_param in o.optimizer.state.values():
            if torch.is_tensor(per_param.get("step")):
                per_param["step"] = per_param["step"].clone()


def pin_torch_optimizer() -> None:
    """Patch 2d of apply(): megatron-core's optimizer modules as without Transformer Engine / apex."""
    from megatron.core import optimizer as mc_optim
    from megatron.core import utils as mc_utils
    from megatron.core.optimizer import clip_grads as mc_clip
    from megatron.core.optimizer import distrib_optimizer as mc_distopt
    from megatron.core.optimizer import optimizer as mc_opt

    mc_optim.Adam, mc_optim.SGD, mc_optim.USING_PYTORCH_OPTIMIZER = torch.optim.AdamW, torch.optim.SGD, True
    mc_distopt.Adam, mc_distopt.HAVE_APEX_OR_TE = torch.optim.Adam, False
    mc_distopt.USING_TE_OPTIMIZER = mc_distopt.USING_APEX_OPTIMIZER = False
    for mod in (mc_clip, mc_opt):
        mod.multi_tensor_applier = mc_utils.local_multi_tensor_applier
        mod.multi_tensor_scale_impl = mc_utils.local_multi_tensor_scale
    if getattr(mc_clip.l2_norm_impl, "__name__", "") != "_l2_norm_cpu":  # patch 9 on a CPU host
        mc_clip.l2_norm_impl = mc_utils.local_multi_tensor_l2_norm


def apply() -> None:
    """Install the workarounds (idempotent). Call before building any Megatron module.

    Patches 1-2b are for a host without Transformer Engine (also needed on GPUs without TE);
    patches 3-14 redirect CUDA-only calls and are installed only when CUDA is unavailable.
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

    # 2d. The optimizer is torch's Adam in every mode and layer spec. megatron-core picks
    #     Transformer Engine's FusedAdam, its fused grad-norm / scale kernels and the
    #     DistributedOptimizer's FusedAdam bookkeeping whenever `transformer_engine` imports: on a
    #     machine that has TE for the fast learner's layers that would change aligned mode's update
    #     and the Adam state the checkpoint helpers below are written for. Set those module names to
    #     what megatron-core 0.16.1 chooses without TE and apex (what runs on a host without TE
    #     already). Applies to megatron-core 0.16.1.
    pin_torch_optimizer()

    # 2b. Distributed optimizer checkpoint load with torch's Adam (no apex/TE). In the
    #     'fully_reshardable' dist_checkpointing format, load_parameter_state_from_fully_reshardable
    #     hands _set_main_param_and_optimizer_states {param, exp_avg, exp_avg_sq} ("step" is loaded
    #     separately, from the param groups), but that method copies every key of the torch Adam
    #     state, which has "step" too: KeyError 'step'. Copy the keys given. Applies to
    #     megatron-core 0.16.1.
    from megatron.core.optimizer import distrib_optimizer as mc_distopt_te

    if not mc_distopt_te.HAVE_APEX_OR_TE:
        D = mc_distopt_te.DistributedOptimizer
        D._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states_torch_adam(
            D._set_main_param_and_optimizer_states)

    # 2c. Optimizer checkpoints before the first update. FP32Optimizer.sharded_state_dict and
    #     Float16OptimizerWithFloat16Params.sharded_state_dict store the shared Adam step as
    #     'common_step' only `if step:`, so a step of 0 (a checkpoint taken before any update) is
    #     dropped and loading it fails in torch's Adam (KeyError 'step'). Store 0 as well.
    #     Applies to megatron-core 0.16.1.
    from megatron.core.optimizer import optimizer as mc_optimizer

    for cls, nested in ((mc_optimizer.FP32Optimizer, False), (mc_optimizer.Float16OptimizerWithFloat16Params, True)):
        if not getattr(cls.sharded_state_dict, "_rz_zero_step", False):
            cls.sharded_state_dict = _keep_zero_common_step(cls.sharded_state_dict, nested)
            cls.sharded_state_dict._rz_zero_step = True

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

    # 13. dist_checkpointing save (torch_dist format). FileSystemWriterAsync.preload_tensors calls
    #     torch.cuda.synchronize() and save_state_dict_async_finalize / the plan-reuse check
    #     allocate a flag with device=torch.cuda.current_device() (AssertionError "Torch not compiled
    #     with CUDA"). Redirect both modules' torch to the CPU one. Applies to megatron-core 0.16.1.
    from megatron.core.dist_checkpointing.strategies import filesystem_async as mc_fs_async
    from megatron.core.dist_checkpointing.strategies import state_dict_saver as mc_saver

    mc_fs_async.torch = cpu_torch
    mc_saver.torch = cpu_torch

    # 14. dist_checkpointing save results queue. FileSystemWriterAsync collects its writers'
    #     results through a multiprocessing.get_context("spawn").Manager().Queue(): a manager
    #     server process started on the first save (about 7 s on a loaded 2-core host, and spawn
    #     re-imports the __main__ module, so a script without a main guard dies with EOFError).
    #     The learner saves synchronously (dist_checkpointing.save, no async_sharded_save): the
    #     writers report back to this very process, so a thread-safe in-process queue is the same
    #     protocol. Applies to megatron-core 0.16.1.
    import queue

    _results = queue.Queue()
    mc_fs_async._get_write_results_queue = lambda: _results

    _APPLIED = True
