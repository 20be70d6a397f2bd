"""Aligned vLLM model class for DeepSeek-V4 checkpoints (``RZAlignedDeepseekV4ForCausalLM``).

The numerics are :mod:`kernels.models.dsv4`'s per-layer functions. The module tree mirrors the ORIGINAL
DeepSeek checkpoint names (``layers.3.attn.compressor.wkv.weight`` is a parameter of that name) so
the checkpoint loads, and weight updates reload, with vLLM's default loader.

KV cache: a DeepSeek-V4 query needs, for each earlier token of its sequence, its key (sliding
window) and its compressor/indexer projections (compressed entries are pooled from them). Each layer
therefore caches one *payload* row per token (:func:`kernels.models.dsv4.token_state`), zero-padded to
one width for all layers and stored as the K and V halves of a paged cache (128-wide KV heads) through
the aligned attention backend. At attention time the backend gathers a sequence's payload rows
0..L-1 and hands them to this model's :func:`kernels.models.dsv4.attend_sequence`, exactly what the
learner runs over its full sequence. The stock vLLM model instead keeps an fp8 compressed cache and
fused CPU kernels (its ``fast`` counterpart).

Cost: compressed entries are re-pooled from the payloads at every step (cheap elementwise work, no
GEMM); the cache holds all tokens, not only the sliding window.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

import kernels

from kernels.models import dsv4 as R
from ._model import LogitsScale, RZAlignedForCausalLM
from .attention_backend import RZAlignedAttentionBackend


class RZAlignedDeepseekV4ForCausalLM(nn.Module):
    CACHE_HEAD = 128
    # Hooks for subclasses (DeepSeek-V4.1, deepseek_v41.py); the V4 defaults change nothing.
    PAYLOAD_EXTRA = 0  # payload columns past the widest layer's (cached per token, ignored by attention)

    def _read_config(self, hf_config):
        return R.v4_config(hf_config)

    def _build_parameter_tree(self, c, make) -> None:
        R.build_parameter_tree(self, c, make)

    def _on_history(self, i: int, a: int, b: int, q_positions: torch.Tensor, history: torch.Tensor) -> None:
        """Called with each sequence's payload history in layer ``i`` (rows ``a:b`` of the batch)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.c = c = self._read_config(self.config)
        dtype = vllm_config.model_config.dtype
        self.cache_config = vllm_config.cache_config
        # State of the shared RZAlignedForCausalLM.load_weights: this class keeps every weight whole
        # (no tensor-parallel shards), has no FP8 weight cache and no packed GPU weights.
        self.rz_shards, self.rz_tp, self.rz_fp8, self.rz_fast = {}, 1, None, False
        Hn, D = c.num_heads, c.head_dim
        # One cache width for every layer (vLLM sizes pages per layer; equal pages keep one group),
        # split into KV heads of 128 (vLLM's CPU attention metadata refuses other head sizes, e.g.
        # 1536): the K half then the V half of a row hold the payload.
        hs = self.CACHE_HEAD
        half = -(-(c.max_payload_width + self.PAYLOAD_EXTRA) // (2 * hs)) * hs
        self.payload, kv_heads = 2 * half, half // hs
        out_heads = kv_heads * -(-Hn * D // half)  # output must hold H * D values; a multiple of kv heads
        kinds = {"model": dtype, "fp32": torch.float32, "int64": torch.int64}
        self._build_parameter_tree(c, lambda name, shape, kind: nn.Parameter(
            torch.zeros(shape, dtype=kinds[kind]), requires_grad=False))
        for i in range(c.num_layers):
            self.get_submodule(f"layers.{i}.attn").cache = Attention(
                num_heads=out_heads, head_size=hs, scale=1.0, num_kv_heads=kv_heads, cache_config=self.cache_config,
                quant_config=None, prefix=f"layers.{i}.attn.cache", attn_backend=RZAlignedAttentionBackend,
            )
        self.logits_processor = LogitsScale(c.vocab_size)

    # ---- attention through the paged payload cache ---------------------------------------------
    def _attend(self, i: int, layer: nn.Module, state: dict, positions: torch.Tensor) -> torch.Tensor:
        c = self.c
        T = state["q"].shape[0]
        payload = state["payload"]
        if payload.shape[1] < self.payload:
            payload = torch.cat([payload, payload.new_zeros(T, self.payload - payload.shape[1])], dim=1)
        half = self.payload // 2
        cache = layer.attn.cache
        w = layer.get_parameter
        HD = c.num_heads * c.head_dim

        def history_fn(a: int, b: int, q_positions: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
            rows = {k: v[a:b] for k, v in state.items() if k != "payload"}
            self._on_history(i, a, b, q_positions, history)
            return R.attend_sequence(c, w, i, rows, q_positions, history).reshape(b - a, HD)

        # The backend calls history_fn for each sequence of the batch (see attention_backend).
        cache.impl.rz_history_fn = history_fn
        try:
            dummy_q = payload.new_zeros(T, cache.num_heads * self.CACHE_HEAD)
            out = cache(dummy_q, payload[:, :half].contiguous(), payload[:, half:].contiguous())
        finally:
            cache.impl.rz_history_fn = None
        return out.view(T, -1)[:, :HD].reshape(T, c.num_heads, c.head_dim)

    # ---- vLLM model interface --------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed.weight[input_ids.long()]

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("aligned DeepSeek-V4 needs input_ids (hash routing reads the token ids)")
        c = self.c
        streams = R.embed(c, self.embed.weight, input_ids)
        for i in range(c.num_layers):
            layer = self.get_submodule(f"layers.{i}")
            streams = R.layer_forward(c, layer.get_parameter, i, streams, input_ids, positions,
                                      lambda st, i=i, layer=layer: self._attend(i, layer, st, positions))
        return R.final_hidden(c, self.get_parameter, streams)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lm = self.embed.weight if self.c.tie_word_embeddings else self.head.weight
        logits = kernels.lm_head_logits(hidden_states, lm, out_dtype=torch.float32)
        if self.logits_processor.scale != 1.0:
            logits = logits * self.logits_processor.scale
        return logits

    # Name-for-name load through each parameter's weight_loader, as the other aligned classes.
    load_weights = RZAlignedForCausalLM.load_weights
