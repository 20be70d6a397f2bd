"""Aligned ("trainer-inference invariant") vLLM model classes for reinforce-zero.

``register_aligned()`` (idempotent; called by the vLLM plugin in every vLLM process) registers:

* ``RZAlignedQwen3MoeForCausalLM``, ``RZAlignedQwen2ForCausalLM``, ``RZAlignedDeepseekV3ForCausalLM``,
  ``RZAlignedDeepseekV4ForCausalLM`` and ``RZAlignedDeepseekV41ForCausalLM`` (DeepSeek-V4.1: engram,
  delayed hyper-connection pre-mix; sliding-window layers only) and ``RZAlignedKimiK3ForCausalLM``
  (Kimi-Linear / Kimi-K3: KDA state in vLLM's mamba state cache, fp32) in vLLM's ModelRegistry,
  selectable with ``LLM(model=hf_dir, hf_overrides={"architectures": [name]}, ...)`` on the normal
  Hugging Face checkpoints;
* the aligned attention backend as ``AttentionBackendEnum.CUSTOM`` (CPU or CUDA: ``vllm_bridge.vllm_compat``).

Every op of those models goes through ``kernels`` (see kernels/README.md), so the logprob vLLM reports
for a sampled token is ``torch.equal`` to :func:`kernels.models.qwen3_dsv3.reference_logprobs`
on prompt + response, however vLLM batches. Engine settings: ``logprobs_mode="processed_logprobs"``
(log_softmax(logits / T)), the recipe's dtype, and the platform's settings from
``vllm_compat.aligned_engine_kwargs``: eager on CPU; on CUDA full CUDA graphs for decode and
chunked prefill (eager when the caller asks ``enforce_eager=True``).
"""

from __future__ import annotations

from kernels.families import FAMILIES

# vLLM architecture name -> "module:Class", one per model family (kernels.families)
ARCHITECTURES = {f.aligned_class: f.aligned_path for f in FAMILIES}

_REGISTERED = False


def register_aligned() -> None:
    """Register the aligned model classes and attention backend with vLLM (idempotent, cheap:
    the model modules are imported lazily by vLLM)."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from vllm import ModelRegistry
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        supported = set(ModelRegistry.get_supported_archs())
        for name, path in ARCHITECTURES.items():
            if name not in supported:
                ModelRegistry.register_model(name, path)
        from vllm_bridge.vllm_compat import aligned_backend_path

        register_backend(AttentionBackendEnum.CUSTOM, aligned_backend_path())  # CPU or CUDA backend
    except Exception as e:  # never break stock models (the plugin runs in every vLLM process)
        import logging

        logging.getLogger("vllm_bridge.aligned").warning("aligned models not registered: %r", e)
        return
    _REGISTERED = True
