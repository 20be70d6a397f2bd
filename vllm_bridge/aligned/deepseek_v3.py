"""RZAlignedDeepseekV3ForCausalLM: DeepSeek-V3 for vLLM with every op through ``kernels``.

Select with ``hf_overrides={"architectures": ["RZAlignedDeepseekV3ForCausalLM"]}`` on a normal
DeepseekV3ForCausalLM checkpoint (same weight names; q_lora_rank None -> q_proj, or q_a_proj /
q_a_layernorm / q_b_proj). Math: :mod:`kernels.models.qwen3_dsv3` (``dsv3_qkv``, ``moe_dsv3``,
``dense_mlp`` for the first_k_dense_replace layers): sigmoid noaux_tc routing with
e_score_correction_bias, n_group/topk_group, routed_scaling_factor, shared experts.

MLA is computed in its *expanded* form (the simplest exact route): per query head
k = [k_nope (from kv_b_proj of the normed latent) | k_pe (shared rope key)], v from kv_b_proj, and
the full per-head K and V are cached in a standard paged KV cache of the aligned backend with
``num_kv_heads = num_attention_heads`` and ``head_size = qk_nope + qk_rope`` (96 for the tiny
model). V (v_head_dim, 32) is zero-padded to that head size in the cache, and the backend attends
over its first v_head_dim channels only (``rz_v_head_dim``). This costs more cache memory than
vLLM's latent cache (H * 2 * 96 vs 576 values per token) but needs no absorbed-weight algebra,
which would change the reduction order relative to the learner's expanded MLA.

RoPE layout: Hugging Face's (de-interleaved after rotating adjacent pairs), see kernels/models/qwen3_dsv3.py.
vLLM's MLA detection (model_type deepseek_v3 -> model_config.use_mla) does not matter here: the
model builds ordinary ``Attention`` layers with an explicit backend, whose KV cache spec (per-head,
head_size 96) is what vLLM allocates. Checked bitwise both with and without ``VLLM_MLA_DISABLE=1``;
no environment variable is needed.

Tensor parallelism (``TP_SHARDED``, vLLM tensor_parallel_size > 1, model.fp8=none): rank r holds query
heads r*Hq/tp .. (r+1)*Hq/tp - 1. The latent (down) projections q_a_proj / q_a_layernorm and
kv_a_proj_with_mqa / kv_a_layernorm are replicated (every rank needs the whole latent and the
shared rope key, as in vLLM's DeepSeek-V3); q_b_proj (or q_proj when q_lora_rank is None) and
kv_b_proj are column-parallel by heads (their rows are head-major, so a rank's heads are one
contiguous row block, computed with the TP=1 bits: ``kernels.linear`` is invariant in N); the
``Attention`` layer is registered with the local head count, so the expanded per-head K/V cache is
sharded too (1/tp of the cache per worker); o_proj is row-parallel through ``_row_parallel``
(K = heads * v_head_dim: each rank's heads are a contiguous K block of exactly
ROW_PARALLEL_K_SEGMENTS / tp segments; ``_tp_config`` refuses a size where that fails). Routed
experts are split over the ranks (``ExpertShard``); the grouped sigmoid router with its
e_score_correction_bias, the shared experts, embeddings, norms and lm_head are replicated; the
first_k_dense_replace layers' MLP is column/row-parallel as Qwen3-MoE's dense path. Blockwise FP8
models stay replicated at TP > 1 (every worker computes the whole model; see ``_model``).
"""

from __future__ import annotations

import torch
from torch import nn

from ._model import Params, RZAlignedForCausalLM


class RZAlignedDeepseekV3ForCausalLM(RZAlignedForCausalLM):
    ARCH = "deepseek_v3"
    # Sharded over vLLM's tensor-parallel group (see _model's docstring and the module docstring
    # above): query heads split in contiguous blocks, o_proj row-parallel, experts split; bitwise
    # the TP=1 engine.
    TP_SHARDED = True
    # vLLM pipeline parallelism (the base class's stages). Restated here, not only inherited: vLLM
    # caches a lazily registered class's interfaces (supports_pp, ...) keyed by the hash of *this*
    # module's file (~/.cache/vllm/modelinfos), so a change in _model.py alone is not seen.
    supports_pp = True

    def _build_attention(self, i, dtype, prefix):
        c, lc = self.c, self.rz_c  # lc: this rank's head count (= c at TP=1)
        H = c.hidden_size
        nh = lc.num_heads
        m = nn.Module()
        if c.q_lora_rank is None:
            m.q_proj = Params(dtype, weight=(nh * c.qk_head_dim, H))
        else:
            m.q_a_proj = Params(dtype, weight=(c.q_lora_rank, H))
            m.q_a_layernorm = Params(dtype, weight=(c.q_lora_rank,))
            m.q_b_proj = Params(dtype, weight=(nh * c.qk_head_dim, c.q_lora_rank))
        m.kv_a_proj_with_mqa = Params(dtype, weight=(c.kv_lora_rank + c.qk_rope_head_dim, H))
        m.kv_a_layernorm = Params(dtype, weight=(c.kv_lora_rank,))
        m.kv_b_proj = Params(dtype, weight=(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
        m.o_proj = Params(dtype, weight=(H, nh * c.v_head_dim))
        if c.v_head_dim > c.qk_head_dim:
            raise NotImplementedError("aligned DeepSeek-V3: v_head_dim > qk head dim")
        # the local heads only: the expanded per-head K/V cache is sharded like the heads
        m.attn = self._make_attn(prefix, nh, c.qk_head_dim, nh, rz_v_head_dim=c.v_head_dim)
        if self.rz_sharded:  # column-parallel by heads (rows head-major), o_proj row-parallel
            q = "q_proj" if c.q_lora_rank is None else "q_b_proj"
            self._shard(f"{prefix}.{q}.weight", 0, c.num_heads * c.qk_head_dim)
            self._shard(f"{prefix}.kv_b_proj.weight", 0, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim))
            self._shard(f"{prefix}.o_proj.weight", 1, c.num_heads * c.v_head_dim)
        return m

    def _attend(self, layer, q, k, v):
        c = self.c
        T, nh, D = q.shape  # nh: this rank's heads
        if c.v_head_dim < D:
            v = torch.cat([v, v.new_zeros(T, nh, D - c.v_head_dim)], dim=-1)
        o = layer.self_attn.attn(q.reshape(T, -1).contiguous(), k.reshape(T, -1).contiguous(),
                                 v.reshape(T, -1).contiguous())
        return o.view(T, nh, D)[:, :, : c.v_head_dim]
