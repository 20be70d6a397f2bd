"""RZAlignedQwen2ForCausalLM: dense Qwen2 (e.g. DeepSeek-R1-Distill-Qwen) for vLLM, every op through ``kernels``.

Select with ``hf_overrides={"architectures": ["RZAlignedQwen2ForCausalLM"]}`` on a normal
Qwen2ForCausalLM checkpoint (same weight names, q/k/v biases included). Math:
:mod:`kernels.models.qwen3_dsv3` (``qwen2_qkv``: biased q/k/v projections, the bias added in fp32
before the one rounding, no q/k norm; ``dense_mlp``); attention: grouped-query ``kernels.attention``
over vLLM's paged KV cache with the aligned backend, as the Qwen3-MoE class.

Not sharded over vLLM's tensor-parallel group yet (``TP_SHARDED = False``): at
tensor_parallel_size > 1 every worker holds and computes the whole model (bitwise the TP=1 engine).
On CUDA the dense MLP's gate/up use the packed fast path; q/k/v stay three biased GEMMs.
"""

from __future__ import annotations

from torch import nn

from ._model import Params
from .qwen3_moe import RZAlignedQwen3MoeForCausalLM


class RZAlignedQwen2ForCausalLM(RZAlignedQwen3MoeForCausalLM):
    ARCH = "qwen2"
    TP_SHARDED = False
    supports_pp = True  # restated: vLLM's modelinfo cache is keyed by this module's hash (qwen3_moe.py)

    def _build_attention(self, i, dtype, prefix):
        c = self.c
        H, D = c.hidden_size, c.head_dim
        m = nn.Module()
        for name, heads in (("q_proj", c.num_heads), ("k_proj", c.num_kv_heads), ("v_proj", c.num_kv_heads)):
            setattr(m, name, Params(dtype, weight=(heads * D, H), bias=(heads * D,)))
        m.o_proj = Params(dtype, weight=(H, c.num_heads * D))
        m.attn = self._make_attn(prefix, c.num_heads, D, c.num_kv_heads)
        return m
