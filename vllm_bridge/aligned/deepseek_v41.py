"""Aligned vLLM model class for DeepSeek-V4.1 checkpoints (``RZAlignedDeepseekV41ForCausalLM``).

The numerics are :mod:`kernels.models.dsv41`'s (delayed hyper-connection pre-mix, no hc head, engram
on ``engram_layer_ids``) over :mod:`kernels.models.dsv4`'s attention and MoE, through the V4 class's
paged payload cache (:mod:`vllm_bridge.aligned.deepseek_v4`).

Engram n-grams need the token ids before a chunk (decode: the 2 previous tokens). vLLM's V4.1 keeps
them in a slot-keyed side cache or gets them from its V2 runner; here they ride in the cache the model
already has: layer 0's payload row of each token carries its token id (3 base-256 digits, exact in
bf16 and fp32) in columns past every layer's attention payload, which attention never reads. When the
attention backend hands layer 0 a sequence's payload history (rows 0..L-1), the n-gram hashes of that
sequence's query rows are computed from the ids in it (:func:`kernels.models.dsv41.ngram_hashes`,
exact integers), before any engram layer (never layer 0) needs them. So a chunk, a decode step and the
learner's full sequence hash the same n-grams.

vLLM's SWA bounded replay (running the layers past the last KV-source layer on each request's last
``sliding_window`` rows) is not used: every row is computed, as the learner does. Not supported: the
V4.1 compressed layers (see :mod:`kernels.models.dsv41`), an FP8 engram table, image tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm.config import VllmConfig

from kernels.models import dsv4 as V4
from kernels.models import dsv41 as R
from .deepseek_v4 import RZAlignedDeepseekV4ForCausalLM

_ID_DIGITS = 3  # token id as base-256 digits (bf16 holds integers <= 256 exactly)


class RZAlignedDeepseekV41ForCausalLM(RZAlignedDeepseekV4ForCausalLM):
    PAYLOAD_EXTRA = _ID_DIGITS
    COMPACT_CACHE = False  # compressed layers read their source layers' whole payload histories

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        c = self.c
        self.rz_token_map = (R.token_map_of(vllm_config.model_config.tokenizer, c) if c.engram_layer_ids
                             else torch.zeros(c.vocab_size, dtype=torch.int64))
        self._hashes: Optional[torch.Tensor] = None
        self._ids: Optional[torch.Tensor] = None
        self._seq_hist: dict = {}
        self._seq_keep: dict = {}

    def _read_config(self, hf_config):
        return R.v41_config(hf_config)

    def _build_parameter_tree(self, c, make, include=None) -> None:
        R.build_parameter_tree(self, c, make, include=include)

    # ---- token ids through layer 0's payload ---------------------------------------------------
    def _attend(self, i: int, layer: nn.Module, state: dict, positions: torch.Tensor) -> torch.Tensor:
        if i == 0 and self.c.engram_layer_ids:
            p = state["payload"]
            T = p.shape[0]
            ids = self._ids.long()
            digits = torch.stack([ids % 256, (ids // 256) % 256, ids // 65536], dim=1).to(p.dtype)
            pad = p.new_zeros(T, self.payload - p.shape[1] - _ID_DIGITS)
            state = dict(state, payload=torch.cat([p, pad, digits], dim=1))
        return super()._attend(i, layer, state, positions)

    def _on_history(self, i: int, a: int, b: int, q_positions: torch.Tensor, history: torch.Tensor) -> None:
        if i != 0 or not self.c.engram_layer_ids:
            return
        d = history[:, self.payload - _ID_DIGITS : self.payload].to(torch.int64)
        ids = d[:, 0] + 256 * d[:, 1] + 65536 * d[:, 2]
        self._hashes[a:b] = R.ngram_hashes(self.c, self.rz_token_map, ids, q_positions)

    # ---- compressed layers: a sequence's source-layer histories within one forward ---------------
    def _attend_rows(self, c, w, i, rows, a, b, q_positions, history):
        if not any(c.compress_ratios):
            return super()._attend_rows(c, w, i, rows, a, b, q_positions, history)
        # Layers run in order, so a compressed layer finds its kv / index sources' histories of the
        # same sequence (the same batch rows a:b) and its index source's selection, from this step.
        hist = self._seq_hist.setdefault((a, b), {})
        hist[i] = history
        o, self._seq_keep[(a, b)] = R.attend_compressed(c, self.get_parameter, i, rows, q_positions, hist,
                                                        self._seq_keep.get((a, b)))
        return o

    # ---- vLLM model interface --------------------------------------------------------------------
    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("aligned DeepSeek-V4.1 needs input_ids (hash routing and engram read the token ids)")
        c = self.rz_c  # the rank's config when tensor parallel (deepseek_v4's docstring)
        T = input_ids.shape[0]
        self._ids = input_ids
        # filled per sequence by layer 0's attention (zeros, a valid row, on vLLM's profiling run)
        self._hashes = torch.zeros(T, len(c.engram_layer_ids), c.engram_cols, dtype=torch.int64)
        self._seq_hist, self._seq_keep = {}, {}
        try:
            streams = V4.embed(c, self.embed.weight, input_ids)
            pre = None
            for i in range(c.num_layers):
                layer = self.get_submodule(f"layers.{i}")
                streams, pre = R.layer_forward(
                    c, V4.fp8_getter(c, layer.get_parameter, self.rz_fp8, f"layers.{i}."), i, streams, pre,
                    input_ids, positions,
                    lambda st, i=i, layer=layer: self._attend(i, layer, st, positions),
                    R.engram_rows(c, self._hashes, i))
            return R.final_hidden(c, self.get_parameter, streams, pre)
        finally:
            self._ids = self._hashes = None
            self._seq_hist, self._seq_keep = {}, {}
