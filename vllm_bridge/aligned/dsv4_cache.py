"""The aligned DeepSeek-V4 class's compact cache: a sliding window of payload rows plus the compressed
entries, in two vLLM caches (layout and bytes: :func:`kernels.models.dsv4_cache.aligned_layout`, the
same function the layout planner uses).

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
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from kernels.models import dsv4 as R
from kernels.models.dsv4_cache import HEAD, CacheLayout, aligned_layout

WINDOW = "rz_cache.0.window"  # vLLM wants one integer in a cache layer name (its index)
ENTRIES = "rz_cache.1.entries"


def layout_of(c: R.V4Config, dtype: torch.dtype) -> CacheLayout:
    """The compact layout of config ``c`` in ``dtype`` (what the planner computes from the recipe)."""
    return aligned_layout(head_dim=c.head_dim, index_head_dim=c.index_head_dim, compress_ratios=c.compress_ratios,
                          sliding_window=c.sliding_window, dtype_bytes=torch.empty(0, dtype=dtype).element_size(),
                          rope_dim=c.rope_dim, entries=c.kv_entries)


class _Rows:
    """Token rows of one cache tensor (``[num_blocks, kv_heads, block_size, 2 * HEAD]``, vLLM-CPU's
    layout; a token's row is its ``kv_heads * 2 * HEAD`` values in head order)."""

    def __init__(self, kv_cache: torch.Tensor, row: int):
        nb = kv_cache.shape[0]
        self.t = kv_cache.view(nb, row // (2 * HEAD), -1, 2 * HEAD)
        self.bs = self.t.shape[2]

    def slots_of(self, block_table_row: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blk = block_table_row[torch.div(pos, self.bs, rounding_mode="floor")].to(torch.long)
        return blk, pos % self.bs

    def read(self, blk: torch.Tensor, off: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return self.t[blk, :, off].reshape(blk.shape[0], -1)[:, a:b]

    def write(self, blk: torch.Tensor, off: torch.Tensor, a: int, values: torch.Tensor) -> None:
        if blk.numel() == 0:
            return
        full = self.t[blk, :, off].reshape(blk.shape[0], -1)
        full[:, a : a + values.shape[1]] = values.to(full.dtype)
        self.t[blk, :, off] = full.view(blk.shape[0], self.t.shape[1], -1)

    # Entries are bytes (fp8 values, scales, bf16 RoPE values) kept in a cache of the model dtype: read
    # and write them through a uint8 view of the cache, so no float copy ever handles them.
    def read_bytes(self, blk: torch.Tensor, off: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Bytes ``a:b`` of the tokens' rows (``uint8 [n, b - a]``)."""
        return self.t.view(torch.uint8)[blk, :, off].reshape(blk.shape[0], -1)[:, a:b]

    def write_bytes(self, blk: torch.Tensor, off: torch.Tensor, a: int, data: torch.Tensor) -> None:
        """Store ``data`` (``uint8 [n, k]``) at bytes ``a:a+k`` of the tokens' rows, other bytes kept."""
        if blk.numel() == 0:
            return
        u = self.t.view(torch.uint8)
        full = u[blk, :, off].reshape(blk.shape[0], -1)
        full[:, a : a + data.shape[1]] = data
        u[blk, :, off] = full.view(blk.shape[0], u.shape[1], -1)


class CompactCache(nn.Module):
    """The two cache layers of one aligned V4 model (module docstring)."""

    def __init__(self, c: R.V4Config, dtype: torch.dtype, cache_config, backend) -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        self.c = c
        self.cache_config = cache_config
        self.layout = layout_of(c, dtype)
        L = self.layout

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
        win = _Rows(kv_w, L.window_row)
        ws, width = L.window_cols[i]
        payload = state["payload"]
        n_tok = int(meta_w.num_actual_tokens)
        slots = slots_w[:n_tok].to(torch.long)
        ok = (slots >= 0).nonzero().squeeze(1)
        win.write(torch.div(slots[ok], win.bs, rounding_mode="floor"), slots[ok] % win.bs, ws, payload[ok])
        r = c.compress_ratios[i]
        ent = None
        if r:
            meta_e, kv_e, _ = vllm_compat.attention_context(ENTRIES)
            ent = _Rows(kv_e, L.entries_row)
            es, stripe = L.entry_cols[i]
            if ent.bs % r and getattr(self.cache_config, "enable_prefix_caching", False):
                # an entry straddling two blocks could be rewritten by another request sharing the first
                raise ValueError(f"aligned DeepSeek-V4: entries cache block_size={ent.bs} is not a multiple of compress "
                                 f"ratio {r} with prefix caching on: set block_size to a multiple of {r}, or "
                                 "enable_prefix_caching=False")
        qsl = meta_w.query_start_loc.tolist()
        seq_lens = meta_w.seq_lens.tolist()
        D = c.head_dim
        dtype = state["q"].dtype
        for s in range(len(qsl) - 1):
            a, b = qsl[s], qsl[s + 1]
            if b <= a:
                continue
            Ls = int(seq_lens[s])
            done = Ls - (b - a)  # tokens computed before this step
            lo = max(0, done - (L.window_tokens - 1))
            pos = torch.arange(lo, Ls)
            blk, off = win.slots_of(meta_w.block_table[s], pos)
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

    def _entries(self, i, w, c, ent: "_Rows", btab, es: int, stripe: int, rows, lo: int, done: int, Ls: int, dtype):
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
            blk, off = ent.slots_of(btab, torch.arange(old * r))
            stored = ent.read_bytes(blk, off, es, es + stripe).reshape(old, r * stripe)[:, :nb]
        else:
            stored = rows.new_zeros(0, nb, dtype=torch.uint8)
        if end > old:
            start = r * (old - 1) if csa and old else r * old
            new = R.stored_entries(c, w, i, rows[start - lo : end * r - lo], dtype, first=old)
            padded = new.new_zeros(end - old, r * stripe)
            padded[:, :nb] = new
            blk, off = ent.slots_of(btab, torch.arange(old * r, end * r))
            ent.write_bytes(blk, off, es, padded.reshape((end - old) * r, stripe))
            stored = torch.cat([stored, new], dim=0)
        return R.unpack_entries(c, i, stored, dtype)
