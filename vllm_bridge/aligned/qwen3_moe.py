"""RZAlignedQwen3MoeForCausalLM: Qwen3-MoE for vLLM with every op through ``kernels``.

Select with ``hf_overrides={"architectures": ["RZAlignedQwen3MoeForCausalLM"]}`` on a normal
Qwen3MoeForCausalLM checkpoint (same weight names). Math: :mod:`vllm_bridge.aligned.reference`
(``qwen3_qkv``, ``moe_qwen3``); attention: grouped-query ``kernels.attention`` over vLLM's paged
KV cache with the aligned backend (K/V heads = num_key_value_heads, head_dim from the config).
"""

from __future__ import annotations

import torch
from torch import nn

from ._model import RZAlignedForCausalLM, _Params


class RZAlignedQwen3MoeForCausalLM(RZAlignedForCausalLM):
    ARCH = "qwen3_moe"

    def _build_attention(self, i, dtype, prefix):
        c = self.c
        H, D = c.hidden_size, c.head_dim
        m = nn.Module()
        m.q_proj = _Params(dtype, weight=(c.num_heads * D, H))
        m.k_proj = _Params(dtype, weight=(c.num_kv_heads * D, H))
        m.v_proj = _Params(dtype, weight=(c.num_kv_heads * D, H))
        m.o_proj = _Params(dtype, weight=(H, c.num_heads * D))
        m.q_norm = _Params(dtype, weight=(D,))
        m.k_norm = _Params(dtype, weight=(D,))
        m.attn = self._make_attn(prefix, c.num_heads, D, c.num_kv_heads)
        return m

    def _attend(self, layer, q, k, v):
        T = q.shape[0]
        o = layer.self_attn.attn(q.reshape(T, -1).contiguous(), k.reshape(T, -1).contiguous(),
                                 v.reshape(T, -1).contiguous())
        return o.view(T, self.c.num_heads, self.c.head_dim)
