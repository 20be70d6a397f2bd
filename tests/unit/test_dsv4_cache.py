"""The DeepSeek-V4 cache layouts (kernels/models/dsv4_cache.py): the planner's bytes are the layout's,
the stock figures are stock vLLM 0.26's page sizes, and entries pooled from a window of rows are the
whole sequence's entries bitwise (what lets the aligned engine store entries once and keep only a
window of payload rows)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kernels.models import dsv4 as R
from kernels.models import dsv4_cache as K

ROOT = Path(__file__).resolve().parents[2]


def _model(name: str):
    from megatron_rz.recipe import load_recipe

    return load_recipe(str(ROOT / "recipes" / f"{name}.yaml")).model


def test_stock_v4_flash_pages():
    """Stock 0.26 at V4-Flash's layer mix, page by page (sparse_mla / sparse_swa / compressor specs)."""
    m = _model("deepseek_v4_flash")
    ratios = m.compress_ratios[: m.num_layers]
    n4, n128 = ratios.count(4), ratios.count(128)
    assert (n4, n128, ratios.count(0)) == (20, 23, 0)
    s = K.stock_layout(head_dim=512, index_head_dim=128, compress_ratios=ratios, sliding_window=128)
    # x4: 64 entries x 584 B (37376 -> 37440 at 576 B) + 64 indexer keys x 132 B (8448 -> 8640) per 256 tokens;
    # x128: 2 x 584 B (1168 -> 1728) per 256 tokens
    assert s.per_token == n4 * (37440 + 8640) / 256 + n128 * 1728 / 256 == 3755.25
    # windows: 128 keys in 2 blocks of 64 (37440 B each) per layer; fp32 compressor states:
    # x4 8 rows of 2048 + 8 of 512 values (blocks of 4), x128 128 rows of 1024 values (blocks of 8)
    swa = 2 * 37440
    x4 = 2 * K._round_up(4 * 2048 * 4, 576) + 2 * K._round_up(4 * 512 * 4, 576)
    x128 = 16 * K._round_up(8 * 1024 * 4, 576)
    assert s.per_sequence == 43 * swa + n4 * x4 + n128 * x128


@pytest.mark.parametrize("name,tp", [("deepseek_v4_flash", 8), ("tiny_dsv4", 1)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_planner_bytes_are_the_engine_layout(name, tp, dtype):
    """The planner's per-token / per-sequence bytes == the layout the aligned engine allocates from
    (vllm_bridge.aligned.dsv4_cache.layout_of over the engine's V4Config), and the stock ones."""
    from megatron_rz.launch import planner
    from vllm_bridge.aligned.dsv4_cache import layout_of

    m = _model(name).model_copy(update={"dtype": dtype})
    c = R.v4_config({
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "head_dim": m.head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "q_lora_rank": m.q_lora_rank, "o_groups": m.o_groups, "o_lora_rank": m.o_lora_rank,
        "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.moe_ffn_hidden_size,
        "hc_mult": m.hc_mult, "sliding_window": m.sliding_window, "compress_ratios": list(m.compress_ratios),
        "index_n_heads": m.index_n_heads, "index_head_dim": m.index_head_dim, "index_topk": 8})
    lay = layout_of(c, getattr(torch, dtype))
    assert planner._kv_per_token_and_seq(m, tp, aligned=True) == (lay.per_token, lay.per_sequence)
    stock = K.stock_layout(head_dim=m.head_dim, index_head_dim=m.index_head_dim,
                           compress_ratios=m.compress_ratios[: m.num_layers], sliding_window=m.sliding_window)
    assert planner._kv_per_token_and_seq(m, tp, aligned=False) == (stock.per_token, stock.per_sequence)
    # the aligned per-token bytes are the entries' stripes (fp8 by default: 584 B per main entry, 132 B
    # per indexer key, over the ratio tokens), rows padded to whole 128-wide K + V heads
    assert c.kv_entries == lay.entries == "fp8"
    b = lay.dtype_bytes
    stripes = sum(-(-((584 + 132) if r == 4 else 584) // r) for r in c.compress_ratios if r)
    assert stripes == sum(s for _, s in lay.entry_cols)
    assert stripes <= lay.per_token == lay.entries_row * b < stripes + 64 * K.ROW_UNIT * b
    assert lay.per_sequence == lay.window_row * b * lay.window_tokens
    assert lay.window_row >= sum(c.payload_width(i) for i in range(c.num_layers))
    assert lay.window_row % lay.entries_row == 0  # an entries page divides a window page (same block size)


def test_v4_flash_aligned_fp8_against_stock():
    """V4-Flash, bf16: per token 20 x4 layers x ceil(716 / 4) + 23 x128 layers x ceil(584 / 128) =
    3695 B of stripes, 1848 bf16 values, padded to 2048 (8 K + V head pairs) = 4096 B; per sequence
    the 128-token window of 96,768-value payload rows, padded to 98,304 (48 entries rows); the issue's
    targets: <= 1.25x stock's bytes per token, >= 80% of stock's sequences in the plan."""
    m = _model("deepseek_v4_flash")
    kw = dict(head_dim=512, index_head_dim=128, compress_ratios=m.compress_ratios[: m.num_layers], sliding_window=128)
    fp8 = K.aligned_layout(dtype_bytes=2, **kw)
    assert sum(s for _, s in fp8.entry_cols) == 20 * 179 + 23 * 5 == 3695
    assert (fp8.entries_row, fp8.per_token, fp8.window_row) == (2048, 4096.0, 98304)
    assert fp8.per_sequence == 98304 * 2 * 128
    model = K.aligned_layout(dtype_bytes=2, entries="model", **kw)
    assert sum(s for _, s in model.entry_cols) == (20 * 160 + 23 * 4) * 2 and model.per_token == 6656.0
    stock = K.stock_layout(**kw)
    assert fp8.per_token <= 1.25 * stock.per_token
    seqs = [int(40 * 2**30 // lay.sequence_bytes(16384)) for lay in (fp8, model, stock)]
    assert seqs == [465, 319, 547] and seqs[0] >= 0.8 * seqs[2]


@pytest.mark.parametrize("entries", ["fp8", "model"])
@pytest.mark.parametrize("window,entries_row", [(96768, 1848), (106496, 3292), (576, 25)])
def test_vllm_gives_the_two_caches_one_page_without_padding(entries, window, entries_row):
    """vLLM's own page unification (vllm.v1.core.kv_cache_utils) on the two specs the engine builds:
    the entries cache's block size is scaled, nothing is padded."""
    vllm = pytest.importorskip("vllm")  # noqa: F841
    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    w, e = K._rows(window, entries_row, 128, 128)
    heads = lambda row: row // (2 * K.HEAD)  # noqa: E731
    specs = {"w": SlidingWindowSpec(block_size=128, num_kv_heads=heads(w), head_size=K.HEAD, dtype=torch.bfloat16,
                                    sliding_window=128),
             "e": FullAttentionSpec(block_size=128, num_kv_heads=heads(e), head_size=K.HEAD, dtype=torch.bfloat16)}
    out = unify_kv_cache_spec_page_size(specs)
    assert out["e"].page_size_padded is None and out["e"].block_size == 128 * w // e
    assert out["e"].page_size_bytes == out["w"].page_size_bytes == specs["w"].page_size_bytes


@pytest.mark.parametrize("entries", ["fp8", "model"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entries_from_a_window_equal_the_whole_sequence(dtype, entries):
    """layer_entries over the rows from token r*first (x4 sparse: r*(first-1)) == entries first.. of
    the whole sequence, torch.equal, for every first: an engine that pools each entry when its
    window completes stores the learner's bits; and the bytes it stores (stored_entries) read back
    (unpack_entries) as exactly those entries."""
    D, Di, rope = 32, 16, 16
    cfg = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": D,
           "qk_rope_head_dim": rope, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "hc_mult": 4, "sliding_window": 16,
           "compress_ratios": [4, 8], "compress_rates": {"compressed_sparse_attention": 4,
                                                          "heavily_compressed_attention": 8},
           "index_n_heads": 4, "index_head_dim": Di, "index_topk": 3}
    c = R.v4_config({**cfg, R.KV_ENTRIES_KEY: entries})
    assert c.kv_entries == entries
    g = torch.Generator().manual_seed(3)
    shapes = R.parameter_shapes(c)
    sd = {n: (torch.randn(s, generator=g) * 0.3).to(dtype if k == "model" else torch.float32)
          for n, (s, k) in shapes.items() if ".attn." in n}
    S = 61
    for layer in (0, 1):
        w = lambda n, layer=layer: sd[f"layers.{layer}." + n]
        rows = (torch.randn(S, c.payload_width(layer), generator=g)).to(dtype)
        main, idx = R.layer_entries(c, w, layer, rows, dtype)
        r = c.compress_ratios[layer]
        assert main.shape[0] == S // r and (idx is None) == (layer == 1)
        stored = R.stored_entries(c, w, layer, rows, dtype)
        assert stored.dtype == torch.uint8 and stored.shape == (S // r, R.entry_bytes(c, layer, dtype))
        m_back, i_back = R.unpack_entries(c, layer, stored, dtype)
        assert torch.equal(m_back, main) and (idx is None or torch.equal(i_back, idx))
        plain = R.layer_entries(dataclasses.replace(c, kv_entries="model"), w, layer, rows, dtype)
        assert torch.equal(plain[0], main) == (entries == "model")  # fp8 entries are quantised
        for first in range(S // r + 1):
            start = r * (first - 1) if layer == 0 and first else r * first
            for end in range(first, S // r + 1):  # rows up to window `end`'s last token only
                m2, i2 = R.layer_entries(c, w, layer, rows[start : r * end], dtype, first=first)
                assert torch.equal(m2, main[first:end]), (layer, first, end)
                if idx is not None:
                    assert torch.equal(i2, idx[first:end]), (layer, first, end)


def test_bad_entries_format_is_one_line_naming_the_key():
    cfg = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 32,
           "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "hc_mult": 4, "compress_ratios": [4],
           "index_n_heads": 4, "index_head_dim": 16, "index_topk": 3, R.KV_ENTRIES_KEY: "fp16"}
    with pytest.raises(ValueError, match=r"^rz_kv_entries='fp16': expected one of fp8, model$"):
        R.v4_config(cfg)
    with pytest.raises(ValueError, match="entries='int8'"):
        K.aligned_layout(head_dim=32, index_head_dim=16, compress_ratios=[4], sliding_window=16, dtype_bytes=4,
                         entries="int8")
