"""RZAlignedQwen2ForCausalLM: dense Qwen2 (e.g. DeepSeek-R1-Distill-Qwen) for vLLM, every op through ``kernels``.

Select with ``hf_overrides={"architectures": ["RZAlignedQwen2ForCausalLM"]}`` on a normal
Qwen2ForCausalLM checkpoint (same weight names, q/k/v biases included). Math:
:mod:`kernels.models.qwen3_dsv3` (``qwen2_qkv``: biased q/k/v projections, the bias added in fp32
before the one rounding, no q/k norm; ``dense_mlp``); attention: grouped-query ``kernels.attention``
over vLLM's paged KV cache with the aligned backend, as the Qwen3-MoE class.

Not sharded over vLLM's tensor-parallel group yet (``TP_SHARDED = False``): at
tensor_parallel_size > 1 every worker holds and computes the whole model (bitwise the TP=1 engine).
On CUDA (the fast path, ``_model``'s docstring) q/k/v are one biased GEMM over the packed weight and
bias, q and k rotated in one RoPE launch, and the dense MLP's gate/up one GEMM. The CUDA attention
backend skips its zero fill of the output for this class (``rz_zero_output=False``): a dense
model's later ops are all row-local, so a padded request's unwritten rows reach no other row.
"""

from __future__ import annotations

from torch import nn

from vllm_bridge.vllm_compat import is_cuda

from ._model import Params, packed_rows
from .qwen3_moe import RZAlignedQwen3MoeForCausalLM


class RZAlignedQwen2ForCausalLM(RZAlignedQwen3MoeForCausalLM):
    ARCH = "qwen2"
    TP_SHARDED = False
    supports_pp = True  # restated: vLLM's modelinfo cache is keyed by this module's hash (qwen3_moe.py)

    def _build_attention(self, i, dtype, prefix):
        c = self.c
        H, D = c.hidden_size, c.head_dim
        m = nn.Module()
        rows = {"q_proj": c.num_heads * D, "k_proj": c.num_kv_heads * D, "v_proj": c.num_kv_heads * D}
        if self.rz_fast:  # q/k/v weights and biases: blocks of one packed weight and one bias (one GEMM)
            pack, leaves, bpack = packed_rows(dtype, H, rows, bias=True)
            m.q_proj, m.k_proj, m.v_proj = leaves["q_proj"], leaves["k_proj"], leaves["v_proj"]
            m.rz_packs = {"qkv": (pack, tuple(rows)), "qkv_bias": (bpack, tuple(rows), "bias")}
        else:
            for name, n in rows.items():
                setattr(m, name, Params(dtype, weight=(n, H), bias=(n,)))
        m.o_proj = Params(dtype, weight=(H, c.num_heads * D))
        # CUDA backend: no zero fill of the attention output (every later op of a dense model is
        # row-local, so rows the kernel leaves unwritten -- a captured graph's padded requests --
        # reach no other row; nothing reads them)
        extra = {"rz_zero_output": False} if is_cuda() else {}
        m.attn = self._make_attn(prefix, c.num_heads, D, c.num_kv_heads, **extra)
        return m
