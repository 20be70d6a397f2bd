"""DeepSeek-V4.1 reference functions (kernels/models/dsv41.py) against independent implementations.

* vLLM 0.32's own plain-Python / plain-torch V4.1 pieces, called directly: the compressed token map
  (``build_compressed_token_map``), the hash multipliers (``compute_hash_multipliers``), the bucket
  primes and offsets (``EngramLayout``) and the delayed hyper-connection pre (``mhc_pre_delayed_torch``);
* where vLLM's code is a CUDA/Triton kernel (the n-gram hash ``_hash_ids_kernel``, the engram gate
  ``_fused_engram_post_wkv_kernel``), a straightforward re-statement here (Python integers for the
  hashes, float64 for the gate), written from reading those kernels;
* bitwise invariance of the whole model: token-by-token decode == one prefill, a sequence alone ==
  in a batch.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from kernels.models import dsv4 as V4
from kernels.models import dsv41 as R

engram_mod = pytest.importorskip("vllm.models.deepseek_v41.common.engram")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megatron_rz.learner.tiny_models import make_tiny_dsv41_checkpoint

    d = tmp_path_factory.mktemp("dsv41")
    make_tiny_dsv41_checkpoint(d, seed=0)
    return d


@pytest.fixture(scope="module")
def model(ckpt):
    c = R.v41_config(ckpt)
    return c, V4.load_state_dict(str(ckpt)), R.token_map_of(ckpt, c)


def _word_tokenizer():
    """A tokenizer whose tokens collapse under the normalisation (case, accents, spaces)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "The", "the", " THE", "café", "cafe", "Ｃafe", " ", "  ", "\n", "x", " x", "X\t", "ß", "é"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def test_compressed_token_map_equals_vllm(ckpt):
    from transformers import AutoTokenizer

    for tok in (_word_tokenizer(), AutoTokenizer.from_pretrained(str(ckpt))):
        ours = R.compressed_token_map(tok)
        theirs = engram_mod.build_compressed_token_map(tok)
        assert ours == theirs
    m, n = R.compressed_token_map(_word_tokenizer())
    assert n < len(m)  # some tokens did collapse ("The"/"the"/" THE", "café"/"cafe", ...)


def test_hash_parameters_equal_vllm(model):
    c, _, _ = model
    ns = types.SimpleNamespace(
        engram_layer_ids=list(c.engram_layer_ids), engram_num_embeddings=list(c.engram_num_embeddings),
        engram_max_ngram_size=c.engram_max_ngram_size, engram_n_heads=c.engram_n_heads,
        engram_head_dim=c.engram_head_dim, engram_compressed_vocab_size=c.engram_compressed_vocab_size,
        engram_pad_token_id=c.engram_pad_token_id, engram_vocab_size=c.engram_vocab_size)
    layout = engram_mod.EngramLayout(ns)
    assert layout.primes == c.engram_primes
    mult, primes, offs = R._hash_params(c)
    assert torch.equal(mult, engram_mod.compute_hash_multipliers(c.engram_layer_ids, c.engram_max_ngram_size,
                                                                 c.engram_compressed_vocab_size))
    assert torch.equal(offs, layout.offsets.to(torch.int64))
    # a full-size-like layout too (more layers and heads, larger vocab)
    big = types.SimpleNamespace(**{**vars(ns), "engram_layer_ids": [1, 14, 20], "engram_num_embeddings": [10**7] * 3,
                                   "engram_n_heads": 8, "engram_vocab_size": 100003, "engram_max_ngram_size": 4})
    assert engram_mod.EngramLayout(big).primes == R.engram_primes(3, 4, 8, 100003)


def _python_hashes(c, token_map, ids, p):
    """Re-statement of vLLM's _hash_ids_kernel for one position (Python ints, text tokens)."""
    mult = engram_mod.compute_hash_multipliers(c.engram_layer_ids, c.engram_max_ngram_size,
                                               c.engram_compressed_vocab_size).tolist()
    pad = int(token_map[c.engram_pad_token_id])
    out = []
    for li in range(len(c.engram_layer_ids)):
        rolling, blocked, row = 0, False, []
        flat = [q for per in c.engram_primes[li] for q in per]
        offs = [sum(flat[:j]) for j in range(len(flat))]
        for s in range(c.engram_max_ngram_size):
            blocked = blocked or p - s < 0
            v = pad if blocked else int(token_map[int(ids[p - s])])
            rolling ^= v * mult[li][s]
            if s > 0:
                for h in range(c.engram_n_heads):
                    j = (s - 1) * c.engram_n_heads + h
                    row.append(rolling % flat[j] + offs[j])
        out.append(row)
    return out


def test_ngram_hashes_match_restatement_and_chunking(model):
    c, _, tm = model
    ids = torch.randint(0, c.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    full = R.ngram_hashes(c, tm, ids, torch.arange(37))
    assert full.tolist() == [_python_hashes(c, tm, ids.tolist(), p) for p in range(37)]
    # a chunk (positions 20..36) over the history it has == the same rows of the full pass; decode too
    assert torch.equal(R.ngram_hashes(c, tm, ids, torch.arange(20, 37)), full[20:])
    for p in (0, 1, 2, 30):
        assert torch.equal(R.ngram_hashes(c, tm, ids[: p + 1], torch.tensor([p])), full[p : p + 1])
    # every row inside its layer's table
    assert (full >= 0).all() and all((full[:, li] < n).all() for li, n in enumerate(c.engram_num_embeddings))


def test_delayed_hc_equals_vllm_torch_reference(model):
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_delayed_torch

    c, sd, _ = model
    g = torch.Generator().manual_seed(2)
    streams = torch.randn(9, c.hc_mult, c.hidden_size, generator=g)
    prev = torch.rand(9, c.hc_mult, generator=g) + 0.1
    fn, base, scale = (sd[f"layers.1.hc_attn_{k}"] for k in ("fn", "base", "scale"))
    pre, post, comb = R.hc_coefficients(c, streams, fn, base, scale)
    for pm in (None, prev):
        v_post, v_comb, v_in, v_pre = mhc_pre_delayed_torch(streams, fn, scale, base, c.rms_norm_eps, c.hc_eps, c.hc_eps,
                                                            2.0, c.hc_sinkhorn_iters, pre_mix=pm)
        d = max((pre - v_pre).abs().max().item(), (post - v_post[..., 0]).abs().max().item(),
                (comb - v_comb).abs().max().item(), (R.hc_collapse(streams, pm) - v_in).abs().max().item())
        assert d < 1e-5, d  # measured 4.8e-7 (collapse), pre 6e-8, post 2.4e-7, comb 1.5e-7 (fp32)
    assert torch.equal(R.hc_collapse(streams, None), streams[:, 0])


def test_engram_gate_matches_float64_restatement(model):
    c, sd, _ = model
    g = torch.Generator().manual_seed(3)
    T, n, H = 11, c.hc_mult, c.hidden_size
    streams = torch.randn(T, n, H, generator=g)
    hashes = torch.stack([torch.randint(0, N, (T,), generator=g) for N in [c.engram_num_embeddings[0]] * c.engram_cols], 1)
    w = lambda k: sd["layers.1.engram." + k]
    ours = R.engram_forward(c, w, streams, hashes)
    # float64, as _fused_engram_post_wkv_kernel states it
    rows = w("embed.weight").double()[hashes].reshape(T, -1)
    kv = rows @ w("wkv.weight").double().T
    h = streams.double()
    key, val = kv[:, : n * H].reshape(T, n, H), kv[:, n * H :]
    dot = (h * w("q_weight").double() * w("k_weight").double() * key).sum(-1)
    dot = dot * torch.rsqrt((h * h).mean(-1) + c.rms_norm_eps) * torch.rsqrt((key * key).mean(-1) + c.rms_norm_eps) / H ** 0.5
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    ref = h + gate[..., None] * val[:, None]
    d = (ours.double() - ref).abs().max().item()
    assert d < 1e-5, d  # measured 1.2e-7 at |out| <= 3.5 (gates 0.20-0.81)
    # the gate matters: zero value -> identity
    z = sd["layers.1.engram.wkv.weight"].clone()
    z[n * H :] = 0
    assert torch.equal(R.engram_forward(c, lambda k: z if k == "wkv.weight" else w(k), streams, hashes), streams)


def test_decode_equals_prefill_and_batch_invariance(model):
    import kernels

    c, sd, tm = model
    ids = torch.randint(0, c.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    full = R.reference_logits(sd, c, ids, tm)
    seq = ids[1]
    caches = [torch.empty(0, c.payload_width(i)) for i in range(c.num_layers)]
    rows = []
    for t in range(len(seq)):
        one, pos = seq[t : t + 1], torch.tensor([t])
        hashes = R.ngram_hashes(c, tm, seq[: t + 1], pos)
        st, pre = V4.embed(c, sd["embed.weight"], one), None
        for i in range(c.num_layers):
            w = lambda n, i=i: sd[f"layers.{i}." + n]

            def attend(state, i=i, w=w):
                caches[i] = torch.cat([caches[i], state["payload"]])
                return V4.attend_sequence(c, w, i, state, pos, caches[i])

            st, pre = R.layer_forward(c, w, i, st, pre, one, pos, attend, R.engram_rows(c, hashes, i))
        rows.append(kernels.lm_head_logits(R.final_hidden(c, sd.__getitem__, st, pre), sd["head.weight"],
                                           out_dtype=torch.float32))
    assert torch.equal(torch.cat(rows), full[1])
    assert torch.equal(R.reference_logits(sd, c, ids[1:2], tm)[0], full[1])
    # the engram is live: without it the logits move
    sd0 = {k: (torch.zeros_like(v) if k.endswith("engram.wkv.weight") else v) for k, v in sd.items()}
    assert (R.reference_logits(sd0, c, ids[1:2], tm)[0] - full[1]).abs().max() > 1e-3


def test_config_refuses_what_is_not_reproduced(ckpt):
    import json

    cfg = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="compress_ratios must be 0, 1 or 2"):
        R.v41_config({**cfg, "compress_ratios": [0, 4, 0, 0], "kv_source_layer_ids": [1]})
    with pytest.raises(NotImplementedError, match="candidate-block prefilter"):
        R.v41_config({**cfg, "compress_ratios": [0, 2, 2, 0], "kv_source_layer_ids": [1], "index_source_layer_ids": [1],
                      "candidate_source_layer_id": 1, "candidate_topk_blocks": 2})
    with pytest.raises(NotImplementedError, match="have ratios"):  # layer 2 (ratio 1) on layer 1's ratio-2 cache
        R.v41_config({**cfg, "compress_ratios": [0, 2, 1, 0], "kv_source_layer_ids": [1], "index_source_layer_ids": [1]})
    with pytest.raises(ValueError, match="no kv_source_layer_ids"):
        R.v41_config({**cfg, "compress_ratios": [0, 1, 2, 0], "kv_source_layer_ids": [2], "index_source_layer_ids": [2]})
    with pytest.raises(NotImplementedError, match="layer 0"):
        R.v41_config({**cfg, "engram_layer_ids": [0, 3]})
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        R.v41_config({**cfg, "engram_num_embeddings": [10, 10]})
    c = R.v41_config(cfg)
    names = R.parameter_shapes(c)
    assert "hc_head_fn" not in names and "layers.1.engram.wkv.weight" in names and "layers.0.engram.q_weight" not in names


# --------------------------------------------------------------------------------------------------
# Compressed layers (compress_ratios 1 / 2, kv / index sources)
# --------------------------------------------------------------------------------------------------

# layer 1: ratio-2 kv + index source; 2: index source on layer 1's keys; 3: consumer of 1's cache and
# 2's selection; 4: its own ratio-1 kv + index source.
COMPRESSED = dict(num_hidden_layers=5, compress_ratios=[0, 2, 2, 2, 1], kv_source_layer_ids=[1, 4],
                  index_source_layer_ids=[1, 2, 4])


@pytest.fixture(scope="module")
def cmodel(tmp_path_factory):
    from megatron_rz.learner.tiny_models import make_tiny_dsv41_checkpoint

    d = tmp_path_factory.mktemp("dsv41c")
    make_tiny_dsv41_checkpoint(d, seed=1, **COMPRESSED)
    c = R.v41_config(d)
    return c, V4.load_state_dict(str(d)), R.token_map_of(d, c)


def _f64_attention(c, sd, xs, S):
    """Float64 restatement of layers 1-4's attention from their normed inputs ``xs[i] [S, H]`` (one
    sequence, positions 0..S-1): vLLM 0.32's V4.1 compressed path written out with no kernels op."""
    g = lambda n: sd[n].double()
    D, Hn, r_dim, eps = c.head_dim, c.num_heads, c.rope_dim, c.rms_norm_eps
    Hi, Di = c.index_n_heads, c.index_head_dim
    pos = torch.arange(S, dtype=torch.float64)

    def norm(x, w=None):
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        return y if w is None else y * w

    def rope(x, p):  # interleaved pairs on the last r_dim channels, compress base
        ang = p[:, None] * c.inv_freq_compress.double()[None, :]
        cos, sin = ang.cos(), ang.sin()
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        a, b = x[..., -r_dim::2], x[..., -r_dim + 1::2]
        out = x.clone()
        out[..., -r_dim::2], out[..., -r_dim + 1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    lat, keys, keep, outs = {}, {}, None, {}
    for i in range(1, 5):
        p = f"layers.{i}.attn."
        x, ratio = xs[i].double(), c.compress_ratios[i]
        q_res = norm(x @ g(p + "wq_a.weight").T, g(p + "q_norm.weight"))
        q = rope(norm((q_res @ g(p + "wq_b.weight").T).view(S, Hn, D)), pos)
        kv = rope(norm(x @ g(p + "wkv.weight").T, g(p + "kv_norm.weight")), pos)
        if i in c.kv_source_layer_ids:
            ckv = x @ g(p + "compressor.wkv.weight").T
            n = S // ratio
            if ratio == 1:
                pooled = ckv
            else:
                sc = (x @ g(p + "compressor.wgate.weight").T)[: n * 2].view(n, 2, D)
                pooled = (ckv[: n * 2].view(n, 2, D) * torch.softmax(sc, dim=1)).sum(1)
            lat[i] = norm(pooled, g(p + "compressor.norm.weight"))
            gp = torch.arange(n, dtype=torch.float64) * ratio
            keys[i] = rope(norm(lat[i] @ g(p + "indexer.wk.weight").T, g(p + "indexer.k_norm.weight")), gp)
        src = c.kv_source(i)
        n = S // ratio
        n_ready = torch.div(torch.arange(S) + 1, ratio, rounding_mode="floor")
        if i in c.index_source_layer_ids:
            iq = rope((q_res @ g(p + "indexer.wq_b.weight").T).view(S, Hi, Di), pos)
            iw = (x @ g(p + "indexer.weights_proj.weight").T) * Hi ** -0.5
            sc = (torch.relu(torch.einsum("thd,nd->thn", iq, keys[src])) * Di ** -0.5 * iw[:, :, None]).sum(1)
            keep = torch.zeros(S, n, dtype=torch.bool)
            for t in range(S):
                ready = int(n_ready[t])
                order = sorted(range(ready), key=lambda j: (-float(sc[t, j]), j))
                keep[t, order[: c.index_topk]] = True
        comp = rope(lat[src], torch.arange(n, dtype=torch.float64) * ratio)
        sink = g(p + "attn_sink")
        o = torch.empty(S, Hn, D, dtype=torch.float64)
        for t in range(S):
            win = kv[max(0, t - c.sliding_window + 1): t + 1]
            vals = torch.cat([win, comp[keep[t]]])
            logits = torch.einsum("hd,nd->hn", q[t], vals) * D ** -0.5
            m = torch.maximum(logits.amax(-1), sink)
            e = torch.exp(logits - m[:, None])
            o[t] = (e @ vals) / (e.sum(-1) + torch.exp(sink - m))[:, None]
        outs[i] = (o, keep.clone())
    return outs


def test_compressed_attention_matches_float64_restatement(cmodel):
    c, sd, _ = cmodel
    S = 40
    gen = torch.Generator().manual_seed(7)
    xs = {i: torch.randn(S, c.hidden_size, generator=gen) for i in range(1, 5)}
    ref = _f64_attention(c, sd, xs, S)
    pos = torch.arange(S)
    hist, keep = {}, None
    for i in range(1, 5):
        w = lambda n, i=i: sd[f"layers.{i}." + n]
        st = R.token_state(c, w, i, xs[i], pos)
        assert st["payload"].shape[1] == c.payload_width(i)
        hist[i] = st["payload"]
        o, keep = R.attend_compressed(c, sd.__getitem__, i, st, pos, hist, keep)
        o64, keep64 = ref[i]
        assert torch.equal(keep, keep64), f"layer {i}: selection"
        err = (o.double() - o64).abs().max().item()
        print(f"layer {i}: max |o - o64| {err:.2e}, kept {int(keep.sum())} of {keep.numel()}")
        assert err < 2e-5, (i, err)
        # the selection is sparse for the long rows (top 3 of up to 20 / 40 groups)
        assert int(keep[-1].sum()) == c.index_topk


def test_compressed_decode_chunks_equal_prefill_and_batch_invariance(cmodel):
    import kernels

    c, sd, tm = cmodel
    ids = torch.randint(0, c.vocab_size, (3, 37), generator=torch.Generator().manual_seed(5))
    full = R.reference_logits(sd, c, ids, tm)
    seq = ids[1]
    for chunk in (1, 7):
        caches: dict = {}
        rows = []
        for a in range(0, len(seq), chunk):
            b = min(a + chunk, len(seq))
            part, pos = seq[a:b], torch.arange(a, b)
            hashes = R.ngram_hashes(c, tm, seq[:b], pos)
            st, pre, keep = V4.embed(c, sd["embed.weight"], part), None, [None]
            for i in range(c.num_layers):
                w = lambda n, i=i: sd[f"layers.{i}." + n]

                def attend(state, i=i):
                    caches[i] = torch.cat([caches.get(i, torch.empty(0, c.payload_width(i))), state["payload"]])
                    o, keep[0] = R.attend_compressed(c, sd.__getitem__, i, state, pos, caches, keep[0])
                    return o

                st, pre = R.layer_forward(c, w, i, st, pre, part, pos, attend, R.engram_rows(c, hashes, i))
            rows.append(kernels.lm_head_logits(R.final_hidden(c, sd.__getitem__, st, pre), sd["head.weight"],
                                               out_dtype=torch.float32))
        assert torch.equal(torch.cat(rows), full[1]), chunk
    assert torch.equal(R.reference_logits(sd, c, ids[1:2], tm)[0], full[1])
    assert torch.equal(R.reference_logits(sd, c, ids[[2, 0, 1]], tm)[2], full[1])
    # the compressed entries are live: without layer 1's compressor rows the logits move
    sd0 = {k: (torch.zeros_like(v) if k == "layers.1.attn.compressor.wkv.weight" else v) for k, v in sd.items()}
    assert (R.reference_logits(sd0, c, ids[1:2], tm)[0] - full[1]).abs().max() > 1e-4
