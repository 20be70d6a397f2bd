"""Full-sequence log-probs == incremental decode (KV cache) log-probs, bitwise, on GPU.

The Qwen3-MoE-shaped model of benchmarks/moe_model.py built from the aligned ops (Triton on CUDA),
in a tiny config and the ~1B-parameter config used by the decode benchmark. For several sequences
of mixed lengths: (a) each sequence alone in one full-sequence pass; (b) all sequences packed in
one prefill; (c) prompts prefilled (one of them in two chunks), then token-by-token decode of all
sequences batched together, with a sequence leaving the batch half way. Every log-prob of (b) and
(c) must be ``torch.equal`` to (a).

    PYTHONPATH=. python -m pytest tests/gpu/test_decode_parity.py -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.getcwd())


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _run(cfg, prompt_lens, gen, seed=0, dev="cuda"):
    from benchmarks.moe_model import KVCache, aligned_forward, init_weights, rope_tables

    W = init_weights(cfg, seed, device=dev)
    tables = rope_tables(cfg, device=dev)
    g = torch.Generator(device=dev)
    g.manual_seed(seed + 1)
    seqs = [torch.randint(0, cfg.vocab, (P + gen,), device=dev, generator=g) for P in prompt_lens]
    B = len(seqs)
    i32 = dict(device=dev, dtype=torch.int32)

    def fwd(cache, parts):
        """parts: list of (b, start, end): tokens seq[b][start:end] at positions start..end-1."""
        toks = torch.cat([seqs[b][s:e] for b, s, e in parts])
        tg = torch.cat([seqs[b][s + 1:e + 1] for b, s, e in parts])
        pos = torch.cat([torch.arange(s, e, device=dev) for _, s, e in parts])
        sidx = torch.cat([torch.full((e - s,), b, device=dev) for b, s, e in parts])
        lens = [e - s for _, s, e in parts]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), **i32)
        # cache row = the sequence id; the attention kernel indexes the cache by the part's order,
        # so pass the cache rows of the parts in order
        rows = [b for b, _, _ in parts]
        sub = KVCache.__new__(KVCache)
        sub.k = [k[rows] for k in cache.k]
        sub.v = [v[rows] for v in cache.v]
        sidx_local = torch.cat([torch.full((e - s,), j, device=dev) for j, (_, s, e) in enumerate(parts)])
        with torch.no_grad():
            lp = aligned_forward(cfg, W, sub, tables, toks, sidx_local, pos, cu, max(lens), tg)
        for li in range(cfg.layers):  # write the touched rows back
            cache.k[li][rows] = sub.k[li]
            cache.v[li][rows] = sub.v[li]
        out, o = [], 0
        for n in lens:
            out.append(lp[o:o + n])
            o += n
        return out

    total = [P + gen - 1 for P in prompt_lens]  # positions with a next token
    # (a) each sequence alone, full length
    full = []
    for b in range(B):
        cache = KVCache(cfg, B, "aligned", device=dev)
        full.append(fwd(cache, [(b, 0, total[b])])[0])
    # (b) all sequences packed in one prefill
    cache = KVCache(cfg, B, "aligned", device=dev)
    packed = fwd(cache, [(b, 0, total[b]) for b in range(B)])
    for b in range(B):
        assert torch.equal(packed[b], full[b]), f"packed prefill, sequence {b}"
    # (c) prefill prompts (the longest in two chunks), then batched decode
    cache = KVCache(cfg, B, "aligned", device=dev)
    longest = max(range(B), key=lambda b: prompt_lens[b])
    cut = prompt_lens[longest] // 3
    parts = [(b, 0, prompt_lens[b]) for b in range(B) if b != longest] + [(longest, 0, cut)]
    pre = fwd(cache, parts)
    for (b, s, e), lp in zip(parts, pre):
        assert torch.equal(lp, full[b][s:e]), f"prefill, sequence {b}"
    lp2 = fwd(cache, [(longest, cut, prompt_lens[longest])])[0]
    assert torch.equal(lp2, full[longest][cut:prompt_lens[longest]]), "second prefill chunk"
    n_checked = 0
    for step in range(gen - 1):
        active = [b for b in range(B) if not (b == 0 and step >= gen // 2)]
        outs = fwd(cache, [(b, prompt_lens[b] + step, prompt_lens[b] + step + 1) for b in active])
        for b, lp in zip(active, outs):
            p = prompt_lens[b] + step
            assert torch.equal(lp, full[b][p:p + 1]), f"decode step {step}, sequence {b}: {lp} vs {full[b][p]}"
            n_checked += 1
    # the log-probs are those of a working model (finite, <= 0)
    allv = torch.cat(full)
    assert torch.isfinite(allv).all() and (allv <= 0).all()
    return n_checked, sum(total)


def test_tiny_full_sequence_equals_incremental_decode():
    _need_cuda()
    from benchmarks.moe_model import TINY

    n, tot = _run(TINY, [3, 17, 64, 100], gen=10)
    print(f"tiny: {n} decode log-probs and {tot} prefill log-probs bitwise equal to full-sequence")


def test_1b_full_sequence_equals_incremental_decode():
    _need_cuda()
    from benchmarks.moe_model import ONE_B, param_count

    print(f"~1B config: {param_count(ONE_B) / 1e9:.3f} B parameters")
    n, tot = _run(ONE_B, [9, 70, 129, 300], gen=12)
    print(f"1B: {n} decode log-probs and {tot} prefill log-probs bitwise equal to full-sequence")
