"""vLLM attention backend for CUDA whose attention is ``kernels.triton.paged_attention``.

The GPU twin of :mod:`.attention_backend` (the CPU backend, built on vLLM's CPU backend and its
metadata builder, which calls a CPU-only op). Selected for the aligned model classes on CUDA by
:func:`vllm_bridge.vllm_compat.aligned_attention_backend`; registered as
``AttentionBackendEnum.CUSTOM`` on CUDA.

* KV cache: vLLM's standard logical shape ``[num_blocks, kv_heads, block_size, 2 * head]`` (K in
  the first ``head`` channels, V in the second), physical layout = logical; any block size that is
  a multiple of 16.
* ``do_kv_cache_update``: one Triton launch (``kernels.triton.paged_kv_write``), an exact copy,
  slots < 0 (padding) skipped on the device.
* ``forward``: ONE batched launch for the whole batch (prefill, chunked prefill, decode, mixed),
  keys found through the block table; the kernel's tiles, fixed 256-key chunks and merge order are
  those of the learner's ``kernels.causal_attention`` on the GPU, so every query's output is bitwise
  what the learner computes for it over the whole sequence.
* No host synchronisation: the metadata builder only forwards vLLM's device tensors and its host
  sizes (``num_reqs``, ``max_query_len``); the grid is a function of those alone.
* A per-token payload cache: ``rz_history_fn`` (the CPU backend's hook), one sequence at a time,
  eager (the engine turns CUDA graphs off for the V4 family). No class routes through it at
  present: the DeepSeek-V4 class runs its compact cache on CUDA (``vllm_bridge.aligned.dsv4_cache``:
  two cache layers of its own through a subclass of this backend with host batch sizes in the
  metadata and blocks a multiple of the compress ratios; the model reads and writes them, no
  attention), and the V4.1 class's payload layers name the CPU backend class.
* CUDA graphs: ``UNIFORM_SINGLE_TOKEN_DECODE``. Decode batches are captured as FULL graphs (the
  engine runs ``cudagraph_mode=FULL_DECODE_ONLY``); padded requests of a captured batch have no
  queries and do nothing. Prefill / mixed batches run eagerly: the grid depends on the batch's
  longest query, which a graph captured for another batch would not know. The aligned model
  classes are not decorated for vLLM's torch.compile (their ops are Triton kernels with a fixed
  numerics contract; Inductor must not fuse or reorder them), so PIECEWISE graphs do not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

__all__ = ["RZAlignedCudaAttentionBackend", "RZAlignedCudaAttentionImpl", "RZAlignedCudaMetadata"]


@dataclass
class RZAlignedCudaMetadata:
    num_actual_tokens: int  # host
    num_reqs: int  # host (padded in a captured graph)
    max_query_len: int  # host
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device


class RZAlignedCudaMetadataBuilder(AttentionMetadataBuilder[RZAlignedCudaMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RZAlignedCudaMetadata:
        m = common_attn_metadata
        return RZAlignedCudaMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> RZAlignedCudaMetadata:
        md = self.build(0, common_attn_metadata)
        md.seq_lens.fill_(1)  # capture with short sequences (the kernel reads seq_lens on the device)
        return md


class RZAlignedCudaAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, *,
                 rz_v_head_dim: int | None = None, rz_zero_output: bool = True, **unused) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError("aligned CUDA attention: no ALiBi, sliding window or soft cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"aligned CUDA attention: decoder attention only, got {attn_type}")
        if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise NotImplementedError(f"aligned CUDA attention: kv_cache_dtype {kv_cache_dtype!r} (model dtype only)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # DeepSeek MLA in expanded form: V is stored zero-padded to the qk head size; attend over
        # the first rz_v_head_dim channels (see attention_backend's docstring).
        self.rz_v_head_dim = rz_v_head_dim
        # Whether forward() zeroes the whole output before the kernel writes its rows (a model's
        # choice, passed through vLLM's Attention(..., rz_zero_output=...)): needed where a later op
        # reads rows the kernel leaves unwritten (a captured graph's padded requests, the V channels
        # past rz_v_head_dim): MoE routers and the grouped MoE work list run on every row, and MLA
        # slices the padded V. A model whose later ops are all row-local (dense Qwen2) passes False
        # and saves the fill launch: its unwritten rows stay garbage that only they themselves see.
        self.rz_zero_output = bool(rz_zero_output)
        # Set by a model for one call (aligned DeepSeek-V4, as on the CPU backend): instead of
        # attention, each sequence's cached rows (K then V channels) go to fn(a, b, positions,
        # history), which returns the output rows a:b. Eager only (host sizes read per sequence):
        # the engine runs such models without CUDA graphs (engine.RolloutEngine).
        self.rz_history_fn = None

    def _caches(self, kv_cache: torch.Tensor):
        D = kv_cache.shape[-1] // 2
        return kv_cache[..., :D], kv_cache[..., D:]

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if kv_cache is None or kv_cache.numel() == 0:
            return
        from kernels.triton.attn import paged_kv_write

        kc, vc = self._caches(kv_cache)
        paged_kv_write(key, value, kc, vc, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output.zero_()
        if self.rz_history_fn is not None:
            return self._forward_history(query, kv_cache, attn_metadata, output)
        from kernels.triton.attn import paged_attention

        md: RZAlignedCudaMetadata = attn_metadata
        kc, vc = self._caches(kv_cache)
        dv = self.rz_v_head_dim or kc.shape[-1]
        out = output.view(output.shape[0], self.num_heads, -1)
        # rows the kernel does not write (tokens of a captured graph's padded requests, and the V
        # channels past rz_v_head_dim) must be finite zeros, not the buffer's old contents, where
        # later row-wise ops (router, grouped MoE work list) run on every row (rz_zero_output)
        if self.rz_zero_output:
            out.zero_()
        paged_attention(query.view(query.shape[0], self.num_heads, -1), kc, vc[..., :dv], md.block_table,
                        md.query_start_loc, md.seq_lens, self.scale, max_q_len=md.max_query_len,
                        out=out[..., :dv], num_seqs=md.num_reqs)
        return output


    def _forward_history(self, query, kv_cache, md: "RZAlignedCudaMetadata", output) -> torch.Tensor:
        """The per-token payload path (module docstring: the V4 class runs its compact cache,
        dsv4_cache.py, on CUDA and no longer comes here): for each sequence, its cached rows 0..L-1
        gathered from its blocks ([L, kv_heads * D] of K, then of V: the CPU backend's history
        layout) and handed to ``rz_history_fn`` with the queries' positions ``L - n .. L - 1``.
        Eager: the sequences' sizes are read from the device on each call."""
        fn = self.rz_history_fn
        kc, vc = self._caches(kv_cache)
        _, kvh, bs, D = kc.shape
        qsl = md.query_start_loc[: md.num_reqs + 1].tolist()
        seq_lens = md.seq_lens[: md.num_reqs].tolist()
        out = output.view(output.shape[0], -1)
        out.zero_()
        for i in range(md.num_reqs):
            a, b = qsl[i], qsl[i + 1]
            if b <= a:
                continue
            L = int(seq_lens[i])
            nblk = (L + bs - 1) // bs
            blocks = md.block_table[i, :nblk].to(torch.long)
            k = kc[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, kvh * D)[:L]
            v = vc[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, kvh * D)[:L]
            pos = torch.arange(L - (b - a), L, device=query.device)
            o = fn(a, b, pos, torch.cat([k, v], dim=-1))
            out[a:b, : o.shape[1]] = o.to(out.dtype)
        return output


class RZAlignedCudaAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return [MultipleOf(16)]

    @staticmethod
    def get_impl_cls():
        return RZAlignedCudaAttentionImpl

    @staticmethod
    def get_builder_cls():
        return RZAlignedCudaMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size (the kernel pads D to a power of two)
