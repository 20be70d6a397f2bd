"""RZAlignedQwen3MoeForCausalLM: Qwen3-MoE for vLLM with every op through ``kernels``.

Select with ``hf_overrides={"architectures": ["RZAlignedQwen3MoeForCausalLM"]}`` on a normal
Qwen3MoeForCausalLM checkpoint (same weight names). Math: :mod:`kernels.models.qwen3_dsv3`
(``qwen3_qkv``, ``moe_qwen3``); attention: grouped-query ``kernels.attention`` over vLLM's paged
KV cache with the aligned backend (K/V heads = num_key_value_heads, head_dim from the config).
"""

from __future__ import annotations

import torch
from torch import nn

from ._model import Params, RZAlignedForCausalLM, packed_rows


class RZAlignedQwen3MoeForCausalLM(RZAlignedForCausalLM):
    ARCH = "qwen3_moe"
    # Sharded over vLLM's tensor-parallel group (see _model's docstring): q/k/v heads split in
    # contiguous blocks (rank r: query heads r*Hq/tp .., KV heads r*Hkv/tp .., so each query head's
    # KV head is local), o_proj row-parallel, experts split; bitwise the TP=1 engine.
    TP_SHARDED = True
    # vLLM pipeline parallelism (the base class's stages). Restated here, not only inherited: vLLM
    # caches a lazily registered class's interfaces (supports_pp, ...) keyed by the hash of *this*
    # module's file (~/.cache/vllm/modelinfos), so a change in _model.py alone is not seen.
    supports_pp = True

    def _build_attention(self, i, dtype, prefix):
        c, lc = self.c, self.rz_c  # lc: this rank's head counts (= c at TP=1)
        H, D = c.hidden_size, c.head_dim
        m = nn.Module()
        rows = {"q_proj": lc.num_heads * D, "k_proj": lc.num_kv_heads * D, "v_proj": lc.num_kv_heads * D}
        if self.rz_fast:  # q/k/v: row blocks of one packed weight (one GEMM on the GPU)
            pack, leaves = packed_rows(dtype, H, rows)
            m.q_proj, m.k_proj, m.v_proj = leaves["q_proj"], leaves["k_proj"], leaves["v_proj"]
            m.rz_packs = {"qkv": (pack, ("q_proj", "k_proj", "v_proj"))}
        else:
            for name, n in rows.items():
                setattr(m, name, Params(dtype, weight=(n, H)))
        m.o_proj = Params(dtype, weight=(H, lc.num_heads * D))
        m.q_norm = Params(dtype, weight=(D,))
        m.k_norm = Params(dtype, weight=(D,))
        m.attn = self._make_attn(prefix, lc.num_heads, D, lc.num_kv_heads)
        if self.rz_sharded:
            self._shard(f"{prefix}.q_proj.weight", 0, c.num_heads * D)
            self._shard(f"{prefix}.k_proj.weight", 0, c.num_kv_heads * D)
            self._shard(f"{prefix}.v_proj.weight", 0, c.num_kv_heads * D)
            self._shard(f"{prefix}.o_proj.weight", 1, c.num_heads * D)
        return m

    def _attend(self, layer, q, k, v):
        T = q.shape[0]
        q, k, v = q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)
        if not self.rz_fast:  # the CPU backend's ops take contiguous rows
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # CUDA (fast path): q / k / v may be row-strided views of the packed q/k/v GEMM or RoPE
        # output; the backend's cache write and attention read them through their strides
        o = layer.self_attn.attn(q, k, v)
        return o.view(T, self.rz_c.num_heads, self.c.head_dim)
