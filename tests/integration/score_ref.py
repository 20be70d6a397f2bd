"""The reference for RolloutEngine.score at temperature T (shared by the tensor-parallel engine tests).

The engine's prompt logprobs at T != 1 come from the model's LogitsProcessor scaled by 1/T
(``logits * (1/T)``, vllm_bridge.worker_ext.rz_set_logit_scale), which differs from the sampler's
``logits / T`` by one rounding; the reference applies the same scaling, then the same
log-softmax as the sampler's processed logprobs at T = 1."""

from __future__ import annotations

import torch


def scored_reference(hf_dir_or_state_dict, config, seq: list[int], temperature: float) -> torch.Tensor:
    """[len(seq) - 1] fp32: log p(seq[t] | seq[:t]) for t >= 1, as RolloutEngine.score computes it."""
    import kernels
    from kernels.models.qwen3_dsv3 import reference_logits

    ids = torch.tensor(seq)[None]
    logits = reference_logits(hf_dir_or_state_dict, config, ids)[0, :-1]
    if temperature != 1.0:
        logits = logits * (1.0 / float(temperature))
    return kernels.logprobs_from_logits(logits, ids[0, 1:], 1.0)
