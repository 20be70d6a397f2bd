"""Aligned vLLM model class for DeepSeek-V4 checkpoints (``RZAlignedDeepseekV4ForCausalLM``).

The numerics are :mod:`.dsv4_reference`'s per-layer functions. The module tree mirrors the ORIGINAL
DeepSeek checkpoint names (``layers.3.attn.compressor.wkv.weight`` is a parameter of that name) so
the checkpoint loads, and weight updates reload, with vLLM's default loader.

KV cache: a DeepSeek-V4 query needs, for each earlier token of its sequence, its key (sliding
window) and its compressor/indexer projections (compressed entries are pooled from them). Each layer
therefore caches one *payload* row per token (:func:`dsv4_reference.token_state`), zero-padded to
one width for all layers and stored as the K and V halves of a single-KV-head paged cache through
the aligned attention backend. At attention time the backend gathers a sequence's payload rows
0..L-1 and hands them to this model's :func:`dsv4_reference.attend_sequence`, exactly what the
learner runs over its full sequence. The stock vLLM model instead keeps an fp8 compressed cache and
fused CPU kernels (its ``fast`` counterpart).

Cost: compressed entries are re-pooled from the payloads at every step (cheap elementwise work, no
GEMM); the cache holds all tokens, not only the sliding window.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

import kernels

from . import dsv4_reference as R
from ._model import _LogitsScale, _Params
from .attention_backend import RZAlignedAttentionBackend


def _ffn_weights(dtype, hidden: int, inter: int) -> nn.Module:
    m = nn.Module()
    m.w1 = _Params(dtype, weight=(inter, hidden))
    m.w2 = _Params(dtype, weight=(hidden, inter))
    m.w3 = _Params(dtype, weight=(inter, hidden))
    return m


def _compressor(dtype, hidden: int, width: int, ratio: int, d: int) -> nn.Module:
    m = nn.Module()
    m.wkv = _Params(dtype, weight=(width, hidden))
    m.wgate = _Params(dtype, weight=(width, hidden))
    m.register_parameter("ape", nn.Parameter(torch.empty(ratio, width, dtype=torch.float32), requires_grad=False))
    m.norm = _Params(dtype, weight=(d,))
    return m


class RZAlignedDeepseekV4ForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.c = c = R.v4_config(self.config)
        dtype = vllm_config.model_config.dtype
        self.cache_config = vllm_config.cache_config
        H, D, Hn, n = c.hidden_size, c.head_dim, c.num_heads, c.hc_mult
        # One cache width for every layer (vLLM sizes pages per layer; equal pages keep one group).
        self.payload = c.max_payload_width + (c.max_payload_width % 2)
        half = self.payload // 2
        out_heads = -(-Hn * D // half)  # the attention op's output must hold H * D values
        hc = (2 + n) * n
        self.embed = _Params(dtype, weight=(c.vocab_size, H))
        layers = []
        for i in range(c.num_layers):
            L = nn.Module()
            L.attn_norm = _Params(dtype, weight=(H,))
            L.ffn_norm = _Params(dtype, weight=(H,))
            for which in ("attn", "ffn"):
                L.register_parameter(f"hc_{which}_fn", nn.Parameter(torch.empty(hc, n * H), requires_grad=False))
                L.register_parameter(f"hc_{which}_base", nn.Parameter(torch.empty(hc), requires_grad=False))
                L.register_parameter(f"hc_{which}_scale", nn.Parameter(torch.empty(3), requires_grad=False))
            a = nn.Module()
            a.wq_a = _Params(dtype, weight=(c.q_lora_rank, H))
            a.q_norm = _Params(dtype, weight=(c.q_lora_rank,))
            a.wq_b = _Params(dtype, weight=(Hn * D, c.q_lora_rank))
            a.wkv = _Params(dtype, weight=(D, H))
            a.kv_norm = _Params(dtype, weight=(D,))
            a.wo_a = _Params(dtype, weight=(c.o_groups * c.o_lora_rank, Hn * D // c.o_groups))
            a.wo_b = _Params(dtype, weight=(H, c.o_groups * c.o_lora_rank))
            a.register_parameter("attn_sink", nn.Parameter(torch.empty(Hn, dtype=torch.float32), requires_grad=False))
            kind, ratio = c.layer_kinds[i], c.compress_ratios[i]
            if kind != R.SLIDING:
                a.compressor = _compressor(dtype, H, 2 * D if kind == R.CSA else D, ratio, D)
            if kind == R.CSA:
                ix = nn.Module()
                ix.compressor = _compressor(dtype, H, 2 * c.index_head_dim, ratio, c.index_head_dim)
                ix.wq_b = _Params(dtype, weight=(c.index_n_heads * c.index_head_dim, c.q_lora_rank))
                ix.weights_proj = _Params(dtype, weight=(c.index_n_heads, H))
                a.indexer = ix
            a.cache = Attention(
                num_heads=out_heads, head_size=half, scale=1.0, num_kv_heads=1, cache_config=self.cache_config,
                quant_config=None, prefix=f"layers.{i}.attn.cache", attn_backend=RZAlignedAttentionBackend,
            )
            L.attn = a
            f = nn.Module()
            gate = _Params(dtype, weight=(c.num_experts, H))
            if i < c.num_hash_layers:
                gate.register_parameter("tid2eid", nn.Parameter(
                    torch.zeros(c.vocab_size, c.top_k, dtype=torch.int64), requires_grad=False))
            else:
                gate.register_parameter("bias", nn.Parameter(torch.empty(c.num_experts, dtype=torch.float32),
                                                             requires_grad=False))
            f.gate = gate
            f.experts = nn.ModuleList([_ffn_weights(dtype, H, c.moe_intermediate_size) for _ in range(c.num_experts)])
            if c.n_shared_experts:
                f.shared_experts = _ffn_weights(dtype, H, c.moe_intermediate_size * c.n_shared_experts)
            L.ffn = f
            layers.append(L)
        self.layers = nn.ModuleList(layers)
        self.norm = _Params(dtype, weight=(H,))
        for name, shape in (("hc_head_fn", (n, n * H)), ("hc_head_base", (n,)), ("hc_head_scale", (1,))):
            self.register_parameter(name, nn.Parameter(torch.empty(*shape), requires_grad=False))
        if not c.tie_word_embeddings:
            self.head = _Params(dtype, weight=(c.vocab_size, H))
        self.logits_processor = _LogitsScale(c.vocab_size)

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
            return R.attend_sequence(c, w, i, rows, q_positions, history).reshape(b - a, HD)

        # The backend calls history_fn for each sequence of the batch (see attention_backend).
        cache.impl.rz_history_fn = history_fn
        try:
            dummy_q = payload.new_zeros(T, cache.num_heads * half)
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
        for i, layer in enumerate(self.layers):
            streams = R.layer_forward(c, layer.get_parameter, i, streams, input_ids, positions,
                                      lambda st, i=i, layer=layer: self._attend(i, layer, st, positions))
        return R.final_hidden(c, self.get_parameter, streams)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lm = self.embed.weight if self.c.tie_word_embeddings else self.head.weight
        logits = kernels.lm_head_logits(hidden_states, lm, out_dtype=torch.float32)
        if self.logits_processor.scale != 1.0:
            logits = logits * self.logits_processor.scale
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            p = params.get(name)
            if p is None:  # MTP layers (mtp.*), rotary buffers
                continue
            getattr(p, "weight_loader", default_weight_loader)(p, w)
            loaded.add(name)
        return loaded
