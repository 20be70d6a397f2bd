"""The GPU launch plans of this project's Triton kernels, run on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported, hence a child process): they are only
plans, the bits come from the GPU tests (tests/gpu), but their indexing, masking and ordering are
the same code, so a wrong index shows here without a GPU.

* the split-KV paged decode (any number of programs per sequence) == the one-pass kernel,
  bitwise, with padded requests, and close to a float64 softmax attention; so is its fused merge
  (the last program folds; its check-in counters are back at 0 afterwards);
* the one-kernel MoE work list == the torch sort / scan work list, value for value;
* RMSNorm read through the strides of q / k head slices == RMSNorm of their contiguous copies;
* the batched keyed draw: greedy rows argmax, draws inside a kept set, a keyed row's token the same
  in any batch, frequencies of softmax(l / T) (chi-square);
* the log-softmax of rows with all -inf vocabulary pieces (top-k masked logits) is finite.
* a split-mode GEMM's partials summed inside the residual add + RMSNorm == the reduce kernel then
  add_rms_norm; RoPE of q and k in one launch over their strided block == two launches.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _interpret(child: str, done: str) -> None:
    """Run ``child`` in a fresh interpreter with TRITON_INTERPRET=1 (set before Triton is imported);
    it must exit 0 and print ``done`` (its last line, after every assertion)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", child], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert done in r.stdout

CHILD = r'''
import torch
from kernels.triton import attn as A
from kernels.triton import moe as M

torch.manual_seed(0)
PAGE, Hq, Hkv, D = 16, 8, 2, 64
lens = [700, 1, 256, 257, 40, 513]
nb = sum((L + PAGE - 1) // PAGE for L in lens) + 5
cache = torch.randn(nb, Hkv, PAGE, 2 * D)
kc, vc = cache[..., :D], cache[..., D:]
bt = torch.zeros(len(lens) + 2, max((L + PAGE - 1) // PAGE for L in lens) + 3, dtype=torch.int32)
perm, i = torch.randperm(nb), 0
for b, L in enumerate(lens):
    for j in range((L + PAGE - 1) // PAGE):
        bt[b, j] = perm[i]
        i += 1
nq = [1] * len(lens) + [0, 0]  # two padded requests (no query) at the end
cu = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32)
sl = torch.tensor(lens + [0, 0], dtype=torch.int32)
q = torch.randn(len(lens), Hq, D)
one = torch.full((len(lens), Hq, D), float("nan"))
A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=one, splits=1)
for splits in (2, 3, 4, 7, 64):
    o = torch.full_like(one, float("nan"))
    A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=o, splits=splits)
    assert torch.equal(o, one), splits
# the fused merge (the last program of each (sequence, KV head) folds, no merge kernel): the same
# output, padded requests untouched, and every check-in counter back at 0 for the next launch
for splits in (3, 7):
    o = torch.full_like(one, float("nan"))
    A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=o, splits=splits, fused_merge=True)
    assert torch.equal(o, one), ("fused", splits)
    assert int(A._COUNTERS["cpu"].abs().sum()) == 0, splits
# 16-row decode programs (one warp): the same masks, rows and chunk states; in the interpreter
# the dot is numpy's, so this checks the plan's indexing, not the GPU's MMA bits
for rows in (16,):
    assert A.decode_tile(Hq // Hkv, rows) == (16, 1)
    for splits in (1, 3):
        o = torch.full_like(one, float("nan"))
        A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=o, splits=splits, rows=rows)
        assert torch.allclose(o, one, rtol=1e-5, atol=1e-6), (rows, splits)
assert A.decode_tile(32, 16) == (64, 4) and A.decode_tile(16, 16) == (16, 1) and A.decode_tile(4, 64) == (64, 4)
for b, L in enumerate(lens):
    p = torch.arange(L)
    kk = kc[bt[b, p // PAGE].long(), :, p % PAGE].double().repeat_interleave(Hq // Hkv, 1)
    vv = vc[bt[b, p // PAGE].long(), :, p % PAGE].double().repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("hd,lhd->hl", q[b].double(), kk) * D ** -0.5
    ref = torch.einsum("hl,lhd->hd", s.softmax(-1), vv)
    assert (one[b].double() - ref).abs().max() < 1e-5, b
# the contiguous cache's split decode (attention_batched) folds with the same helper
kcont = torch.zeros(len(lens), max(lens), Hkv, D)
vcont = torch.zeros_like(kcont)
for b, L in enumerate(lens):
    p = torch.arange(L)
    kcont[b, :L] = kc[bt[b, p // PAGE].long(), :, p % PAGE]
    vcont[b, :L] = vc[bt[b, p // PAGE].long(), :, p % PAGE]
cu1 = torch.arange(len(lens) + 1, dtype=torch.int32)
pos = torch.tensor(lens) - 1
for split in (True, False):
    ob = A.attention_batched(q, kcont, vcont, cu1, pos, D ** -0.5, max_q_len=1, split_kv=split)
    assert torch.equal(ob, one), split
assert A.decode_splits(1, 4, 16, 132) == 16 and A.decode_splits(512, 4, 16, 132) == 1 and A.decode_splits(256, 4, 16, 132) == 2
assert A.decode_splits(64, 4, 3, 132) == 3

g = torch.Generator().manual_seed(1)
for T, k, E, bm in [(1, 4, 32, 16), (7, 2, 8, 16), (64, 4, 32, 16), (300, 8, 128, 64), (33, 6, 64, 16),
                    (1000, 4, 32, 128), (5, 6, 256, 16), (3, 1, 3, 16)]:
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[: T // 2] = ids[0].clone()  # skewed: half the tokens on the same experts
    ref = M.make_work_list(ids.reshape(-1).to(torch.int64), E, bm)
    got = M.work_list_fused(ids.reshape(-1), E, bm, k)
    assert torch.equal(got[0], ref[0].to(torch.int32)), (T, k, E)
    assert torch.equal(got[1], (ref[0] // k).to(torch.int32)), (T, k, E)
    for a, b in zip(got[2:], ref[1:]):
        assert torch.equal(a, b), (T, k, E, bm)
from kernels.triton.rmsnorm import rms_norm

y = torch.randn(7, 4 * 32 + 2 * 32)  # a fused q/k/v output: 4 query heads, 1 key head, 1 value head of 32
w = torch.randn(32)
for t in (y[:, :128].reshape(7, 4, 32), y[:, 128:160].reshape(7, 1, 32), torch.randn(2, 3, 32), torch.randn(6, 64)[:, :32]):
    a = rms_norm(t, w, 1e-6)
    b = rms_norm(t.contiguous().reshape(-1, 32).clone(), w, 1e-6).reshape(t.shape)
    assert torch.equal(a, b) and a.is_contiguous(), tuple(t.shape)
from kernels.triton.draw import gumbel_draw

lg = torch.randn(6, 10, generator=g) * 2
lg[2] = float("-inf")
lg[2, 3], lg[2, 7] = 0.0, 1.0  # a kept set of two tokens
temp = torch.tensor([1.0, 0.7, 1.0, 0.0, 2.0, 1.0])  # row 3 greedy
keys = torch.tensor([[11, 5], [12, 0], [13, 9], [14, 1], [15, 2], [2**62 + 3, 2**40 + 7]], dtype=torch.int64)
tok = gumbel_draw(lg, temp, keys)
assert tok[3] == lg[3].argmax() and int(tok[2]) in (3, 7)
for rows in ([1, 2], [5], [4, 0, 3]):  # a keyed row draws the same token in any batch
    assert torch.equal(gumbel_draw(lg[rows], temp[rows], keys[rows]), tok[rows]), rows
unkeyed = gumbel_draw(lg, temp, base_seed=99)
assert unkeyed[3] == lg[3].argmax() and int(unkeyed[2]) in (3, 7)
M = 300  # one row, 300 keys (counters 0..299): frequencies against softmax(l / T), chi-square df 9
rows = lg[4:5].repeat(M, 1)
d = gumbel_draw(rows, torch.full((M,), 2.0), torch.stack([torch.full((M,), 7), torch.arange(M)], 1))
p = torch.softmax(lg[4] / 2.0, -1).double()
chi2 = float((((torch.bincount(d, minlength=10).double() - M * p) ** 2) / (M * p)).sum())
assert chi2 < 27.9, chi2  # the 0.1% tail of chi-square(9); deterministic (fixed keys)
assert len(set(d.tolist())) > 5
print("interpreted kernels OK")
'''


def test_launch_plans_in_the_triton_interpreter():
    _interpret(CHILD, "interpreted kernels OK")


CHILD_PIECES = r'''
import torch
from kernels.triton.draw import BLOCK, gumbel_draw, gumbel_draw_with_logprob

g = torch.Generator().manual_seed(3)
V = 3 * BLOCK + 77  # pieces of whole BLOCKs, the last one short
lg = torch.randn(5, V, generator=g) * 3
lg[0, 100] = lg[0, 9000] = 50.0  # a greedy row's tie across two pieces: the first column wins
lg[1] = float("-inf")
lg[1, V - 1] = 0.0  # a kept set of one column, in the last (short) piece
lg[2] = float("-inf")  # nothing above -inf: column 0, as the one-program race
temp = torch.tensor([0.0, 1.0, 1.0, 0.8, 1.3])
keys = torch.tensor([[1, 0], [2, 3], [3, 4], [2**61 + 5, 2**33], [7, 1]], dtype=torch.int64)
lp = torch.log_softmax(lg / temp.clamp_min(1e-5)[:, None], -1)
for kw in (dict(keys=keys), dict(base_seed=1234)):
    one = gumbel_draw(lg, temp, pieces=1, **kw)
    assert int(one[0]) == 100 and int(one[1]) == V - 1 and int(one[2]) == 0, one
    for P in (2, 3, 4):
        assert torch.equal(gumbel_draw(lg, temp, pieces=P, **kw), one), (P, kw)
        tok, tlp, fin = gumbel_draw_with_logprob(lg, temp, lp, pieces=P, **kw)
        want = lp.gather(1, one[:, None])[:, 0]
        assert torch.equal(tok, one) and torch.allclose(tlp, want, rtol=0, atol=0, equal_nan=True), P
        assert int(fin) == 0  # row 2's token has log-prob -inf (NaN here): flagged
    assert torch.equal(gumbel_draw(lg, temp, **kw), one)  # the default plan (one program: a short vocabulary)
print("interpreted draw pieces OK")
'''


def test_draw_in_vocabulary_pieces_is_the_one_program_draw_in_the_interpreter():
    """A small batch races each row's vocabulary in pieces and folds them in order: the same tokens
    as one program per row (keyed and unkeyed, a greedy tie across pieces, a kept set in the short
    last piece, a row with nothing above -inf), and the same token log-probs and finite flag."""
    _interpret(CHILD_PIECES, "interpreted draw pieces OK")


CHILD_GRADS = r'''
import torch
from kernels import grads, logprobs as LP, moe as MO, norm as NO, rope as RO
from kernels.triton import logprobs as TL, moe as TM, rmsnorm as TN, rope as TR

torch.manual_seed(0)


def both(op, ref, inputs, tol=1e-5):
    """op's forward == the Triton kernel called without autograd; its gradients == autograd of ref."""
    a = [t.clone().requires_grad_(True) for t in inputs]
    b = [t.clone().requires_grad_(True) for t in inputs]
    out, want = op(*a), ref(*b)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=tol, atol=tol)
    return out


x, w = torch.randn(5, 64) * 2, torch.randn(64) + 1
o = both(lambda x_, w_: grads.rms_norm(lambda p, q: TN.rms_norm(p, q, 1e-6), x_, w_, 1e-6),
         lambda x_, w_: NO.rms_norm(x_, w_, 1e-6), [x, w])
assert torch.equal(o, TN.rms_norm(x, w, 1e-6))
q = torch.randn(6, 4, 32)
ang = torch.arange(6.0)[:, None] * torch.linspace(0.1, 1.0, 8)
cos, sin = ang.cos(), ang.sin()
for style in ("neox", "interleaved"):  # rotary dims 16 of 32: the rest passes through
    o = both(lambda q_: grads.apply_rope(lambda p, c, s: TR.apply_rope(p, c, s, style), q_, cos, sin),
             lambda q_: RO.apply_rope(q_, cos, sin, style), [q])
    assert torch.equal(o, TR.apply_rope(q, cos, sin, style))
a, b = torch.randn(7, 48) * 3, torch.randn(7, 48)
o = both(lambda a_, b_: grads.swiglu(TM.swiglu, a_, b_), MO.swiglu, [a, b])
assert torch.equal(o, TM.swiglu(a, b))
y, wt, s = torch.randn(5, 4, 24), torch.softmax(torch.randn(5, 4), -1), torch.randn(5, 24)
o = both(lambda y_, w_, s_: grads.moe_combine(lambda p, r, *t: TM.moe_combine(p, r, list(t)), y_, w_, [s_]),
         lambda y_, w_, s_: MO.moe_combine(y_, w_, [s_]), [y, wt, s])
assert torch.equal(o, TM.moe_combine(y, wt, [s]))
lg, tg = torch.randn(6, 300) * 3, torch.randint(0, 300, (6,))
for t in (1.0, 0.7):
    o = both(lambda l_: grads.logprobs_from_logits(lambda p: TL.logprobs_from_logits(p, tg, t), l_, tg, t),
             lambda l_: LP.logprobs_from_logits(l_, tg, t), [lg])
    assert torch.equal(o, TL.logprobs_from_logits(lg, tg, t))

# the fused backwards (kernels/triton/backward.py) in place of the torch closed forms: against
# autograd of the references, against the torch closed form itself (fp32 rounding apart), and the
# same bits twice. fp32 only: Triton 3.6's interpreter truncates an fp32 -> bf16 cast (the GPU rounds
# to nearest), so bf16 bits are the GPU test's (tests/gpu/test_grads_gpu.py)
from kernels.triton import backward as TB


def twice(fn, inputs):
    a = [t.clone().requires_grad_(True) for t in inputs]
    b = [t.clone().requires_grad_(True) for t in inputs]
    for ins in (a, b):
        out = fn(*ins)
        out.backward(torch.ones_like(out) * torch.linspace(-1, 2, out.shape[-1]))
    assert all(torch.equal(x.grad, y.grad) for x, y in zip(a, b))


a, b = torch.randn(7, 48) * 3, torch.randn(7, 48)
fused = lambda a_, b_: grads.swiglu(TM.swiglu, a_, b_, bwd=TB.swiglu_backward)  # noqa: E731
o = both(fused, MO.swiglu, [a, b])
assert torch.equal(o, TM.swiglu(a, b))
both(fused, lambda a_, b_: grads.swiglu(TM.swiglu, a_, b_), [a, b], tol=1e-6)
twice(fused, [a, b])
bb = b.clone().requires_grad_(True)  # only one input takes a gradient
grads.swiglu(TM.swiglu, a, bb, bwd=TB.swiglu_backward).sum().backward()
torch.testing.assert_close(bb.grad, a / (1 + torch.exp(-a)), rtol=1e-6, atol=1e-6)
h = torch.randn(2, 3, 2 * 40) * 3  # merged [gate | up], 40 columns each (a masked tail of the block)
merged = lambda h_: grads.swiglu_merged(TM.swiglu, h_, bwd=TB.swiglu_backward)  # noqa: E731
o = both(merged, lambda h_: MO.swiglu(h_[..., :40], h_[..., 40:]), [h])
assert torch.equal(o, TM.swiglu(h[..., :40], h[..., 40:]))
both(merged, lambda h_: grads.swiglu_merged(TM.swiglu, h_), [h], tol=1e-6)
twice(merged, [h])
TB._RMS_PROGRAMS = 3  # several rows per program and a short last program, at this size
for shape, with_w in (((7, 64), True), ((2, 5, 40), True), ((7, 64), False)):
    x = torch.randn(*shape) * 2
    w = torch.randn(shape[-1]) + 1
    ws = [w] if with_w else []
    fn = lambda x_, *w_: grads.rms_norm(lambda p, q: TN.rms_norm(p, q, 1e-6), x_, w_[0] if w_ else None, 1e-6,  # noqa: E731
                                        bwd=TB.rms_norm_backward)
    plain = lambda x_, *w_: grads.rms_norm(lambda p, q: TN.rms_norm(p, q, 1e-6), x_, w_[0] if w_ else None, 1e-6)  # noqa: E731
    o = both(fn, lambda x_, *w_: NO.rms_norm(x_, w_[0] if w_ else None, 1e-6), [x] + ws)
    assert torch.equal(o, TN.rms_norm(x, w if with_w else None, 1e-6))
    both(fn, plain, [x] + ws, tol=1e-6)
    twice(fn, [x] + ws)
xx = (torch.randn(7, 64) * 2).requires_grad_(True)  # the weight frozen: dx only
grads.rms_norm(lambda p, q: TN.rms_norm(p, q, 1e-6), xx, w, 1e-6, bwd=TB.rms_norm_backward).sum().backward()
ref = xx.detach().clone().requires_grad_(True)
NO.rms_norm(ref, w, 1e-6).sum().backward()
torch.testing.assert_close(xx.grad, ref.grad, rtol=1e-5, atol=1e-5)
print("interpreted grads OK")
'''


def test_triton_forwards_with_the_closed_form_backwards_in_the_interpreter():
    """The GPU path of kernels.rms_norm / apply_rope / swiglu / moe_combine / logprobs_from_logits:
    each Triton forward (interpreted) wired to its kernels/grads.py backward, against autograd of the
    CPU reference."""
    _interpret(CHILD_GRADS, "interpreted grads OK")


CHILD_LSM = r'''
import torch
from kernels.triton import logprobs as TL

torch.manual_seed(0)
# rows of 3 vocabulary pieces with all -inf pieces (masked logits over a large vocabulary): the
# finite columns' values are finite and torch's to fp32 rounding, -inf stays -inf, log_softmax ==
# logprobs_from_logits, and a row without -inf gives the same bits alone as in the batch
V = 2 * TL.PIECE + 300
big = torch.randn(3, V) * 2
big[0, TL.PIECE:2 * TL.PIECE] = float("-inf")  # the middle piece
big[1, :V - 5] = float("-inf")  # the first two pieces, and all but 5 columns of the last
lsm = TL.log_softmax(big)
ref = torch.log_softmax(big.double(), -1)
fin = torch.isfinite(ref)
assert torch.equal(torch.isfinite(lsm), fin)
assert (lsm[fin].double() - ref[fin]).abs().max() < 1e-5
tgt = torch.tensor([5, V - 1, 7])
assert torch.equal(TL.logprobs_from_logits(big, tgt), lsm[torch.arange(3), tgt])
assert torch.equal(TL.log_softmax(big[2:]), lsm[2:])
print("interpreted log-softmax OK")
'''


def test_log_softmax_with_all_inf_vocabulary_pieces_in_the_interpreter():
    """Top-k masked logits over a vocabulary of several 16,384-column pieces: a piece whose logits
    are all -inf must not turn the row into nan (the GPU log-softmax's piece statistics)."""
    _interpret(CHILD_LSM, "interpreted log-softmax OK")


CHILD_SEG = r'''
import torch
from kernels.triton.gemm import matmul

torch.manual_seed(0)
# row-parallel segments shorter than a 16-wide tile (a tiny model's 128-wide o_proj in 16 segments)
for K, segs in ((128, 16), (200, 8), (48, 2)):
    w = torch.randn(24, K) * K ** -0.5
    x = torch.randn(5, K)
    y = matmul(x, w, k_segments=segs)
    s = K // segs
    acc = torch.zeros(5, 24)
    for r in range(segs):  # the partials added in segment order, each over its own columns only
        acc = acc + matmul(x[:, r * s:(r + 1) * s].contiguous(), w[:, r * s:(r + 1) * s].contiguous(), k_segments=1)
    # numpy's dot runs the interpreter's tiles, so bits are the GPU test's job: here the values
    # (a segment masked at K instead of its own end would count the next segment's columns twice)
    assert (y - acc).abs().max() < 1e-5, (K, segs)
    assert (y.double() - x.double() @ w.double().T).abs().max() < 1e-5, (K, segs)
from kernels.triton.gemm import CONFIGS
# configs that keep their K tile and mask a segment's last one (1120 = 8 x 128 + 96 columns)
for K, segs in ((8960, 8), (1536, 8)):
    w = torch.randn(24, K) * K ** -0.5
    x = torch.randn(3, K)
    exact = x.double() @ w.double().T
    for name, cfg in CONFIGS.items():
        if cfg.mask_tail:
            y = matmul(x, w, k_segments=segs, config=cfg)
            assert (y.double() - exact).abs().max() < 1e-4, (name, K, segs)
# the flattened segment loop runs each segment's dot chain and adds the partials as the nested loop
# does: the interpreter's numpy dots are the same per tile, so the bits are equal here too
import dataclasses
flats = [c for c in CONFIGS.values() if c.flat]
assert flats
for K, segs in ((8960, 8), (1536, 8), (200, 8)):
    w = torch.randn(24, K) * K ** -0.5
    x = torch.randn(5, K)
    for cfg in flats:
        y = matmul(x, w, k_segments=segs, config=cfg)
        assert torch.equal(y, matmul(x, w, k_segments=segs, config=dataclasses.replace(cfg, flat=False))), (cfg.name, K)
from kernels.triton.moe import grouped_linear
# the same for an expert's segments in the grouped GEMM (tiny_dsv3: 64-wide down_proj, 8 segments)
for K, segs in ((64, 8), (200, 8), (48, 2)):
    w = torch.randn(3, 24, K) * K ** -0.5
    x = torch.randn(7, K)
    ids = torch.tensor([0, 2, 1, 0, 2, 2, 1])
    y = grouped_linear(x, w, ids, k_segments=segs)
    exact = torch.stack([x[i].double() @ w[int(ids[i])].double().T for i in range(7)])
    assert (y.double() - exact).abs().max() < 1e-5, ("grouped", K, segs)
print("interpreted short segments OK")
'''


def test_gemm_segments_shorter_than_a_tile_in_the_interpreter():
    """A K segment that does not fill a 16-wide tile is masked at its own end (not at K): each
    segment sums only its columns, and the segments add up to the full product (values; the GPU
    test checks the bits). The same for the grouped expert GEMM."""
    _interpret(CHILD_SEG, "interpreted short segments OK")


CHILD_ADDNORM = r'''
import torch
from kernels.triton.rmsnorm import add_rms_norm, rms_norm

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for R, D in ((1, 64), (5, 100), (3, 1024)):
        x = (torch.randn(R, D) * 3).to(dtype)
        d = torch.randn(R, D).to(dtype)
        w = (torch.rand(D) + 0.5).to(dtype)
        h, y = add_rms_norm(x, d, w, 1e-6)
        s32 = x.float() + d.float()
        if dtype == torch.float32:
            assert torch.equal(h, x + d), (R, D)  # torch's add
        else:  # the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest: GPU test)
            assert torch.equal(h, (s32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)), (R, D)
        assert torch.equal(y, rms_norm(h, w, 1e-6)), (dtype, R, D)  # the norm of the rounded sum
        h0, y0 = add_rms_norm(x, d, None, 1e-6)
        assert torch.equal(h0, h) and torch.equal(y0, rms_norm(h, None, 1e-6)), (dtype, R, D)
print("interpreted add + norm OK")
'''


def test_fused_residual_add_and_norm_equals_the_two_ops_in_the_interpreter():
    """The residual add fused into the next RMSNorm gives the add's bits and the norm of the rounded
    sum (the same row function as the plain norm kernel)."""
    _interpret(CHILD_ADDNORM, "interpreted add + norm OK")


CHILD_FUSED = r'''
import torch
from kernels import rope as RO
from kernels.triton.gemm import CONFIGS, matmul, matmul_partials, reduce_partials
from kernels.triton.rmsnorm import add_partials_rms_norm, add_rms_norm
from kernels.triton.rope import apply_rope

torch.manual_seed(0)
# a row-parallel GEMM's fp32 partials summed inside the residual add + norm == the reduce kernel,
# then add_rms_norm (bf16: both sides interpreted, so both truncate alike; fp32 also against torch)
for dtype in (torch.float32, torch.bfloat16):
    for S, R, D, with_bias in ((8, 1, 64, True), (8, 7, 96, False), (3, 5, 200, True), (1, 4, 48, True),
                               (8, 9, 1536, True), (2, 3, 100, False)):
        parts = torch.randn(S, R, D) * 2
        parts[:, 0, :5] = -0.0  # 0 + (-0) is +0: the fold must start from 0.0 as the reduce kernel does
        x = (torch.randn(R, D) * 3).to(dtype)
        x[0, :3] = -0.0
        b = torch.randn(D).to(dtype) if with_bias else None
        for w in ((torch.rand(D) + 0.5).to(dtype), None):
            h, y = add_partials_rms_norm(x, parts, b, w, 1e-6)
            d = reduce_partials(parts, b, out_dtype=dtype)
            h2, y2 = add_rms_norm(x, d, w, 1e-6)
            assert torch.equal(h, h2) and torch.equal(y, y2), (dtype, S, R, D, with_bias)
            assert h.dtype == y.dtype == dtype and h.shape == y.shape == x.shape
        if dtype == torch.float32:
            tot = torch.zeros(R, D)
            for s in range(S):
                tot = tot + parts[s]
            if b is not None:
                tot = tot + b
            assert torch.equal(d, tot) and torch.equal(h, x + tot), (S, R, D)
            if S > 2:  # the check can tell the segment order: folding backwards gives other bits
                rev = torch.zeros(R, D)
                for s in reversed(range(S)):
                    rev = rev + parts[s]
                if b is not None:
                    rev = rev + b
                assert not torch.equal(x + rev, h), (S, R, D)
# matmul_partials: split configs hand back [S, M, N] partials (no bias) whose reduction is matmul's
# output; other configs (or one segment) hand back the finished output
x, w, b = torch.randn(5, 64), torch.randn(24, 64) * 0.125, torch.randn(24)
for name in ("d16_n64_split", "m64_n128_split_mt", "d64_n64", "d16_n32"):
    cfg = CONFIGS[name]
    for segs in (1, 4):
        got, is_parts = matmul_partials(x, w, b, k_segments=segs, config=cfg)
        want = matmul(x, w, b, k_segments=segs, config=cfg)
        assert is_parts == (cfg.split and segs > 1), (name, segs)
        if is_parts:
            assert got.shape == (segs, 5, 24) and got.dtype == torch.float32 and got.is_contiguous()
            got = reduce_partials(got, b, out_dtype=torch.float32)
        assert torch.equal(got, want), (name, segs)
# RoPE of q and k in one launch: the adjacent q / k column blocks of a packed q/k/v output, read as
# one strided [T, Hq + Hkv, D] view == the two calls (and, fp32, the CPU reference)
for dtype in (torch.float32, torch.bfloat16):
    for T, Hq, Hkv, D in ((5, 12, 2, 128), (1, 4, 1, 32), (3, 6, 3, 64)):
        y = torch.randn(T, (Hq + 2 * Hkv) * D).to(dtype)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * torch.linspace(0.01, 1.0, D // 2, dtype=torch.float64)
        cos, sin = ang.cos().float(), ang.sin().float()
        qk = y[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D)
        assert not qk.is_contiguous() or T == 1
        one = apply_rope(qk, cos, sin, "neox")
        q = apply_rope(y[:, :Hq * D].view(T, Hq, D), cos, sin, "neox")
        k = apply_rope(y[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), cos, sin, "neox")
        assert torch.equal(one[:, :Hq], q) and torch.equal(one[:, Hq:], k), (dtype, T, Hq, Hkv, D)
        if dtype == torch.float32:
            assert torch.equal(one, RO.apply_rope(qk.contiguous(), cos, sin, "neox"))
print("interpreted fused launches OK")
'''


def test_fused_launches_equal_the_unfused_ones_in_the_interpreter():
    """The engine's launch cuts: a split-mode GEMM's partials reduced inside the residual add + norm
    (== the reduce kernel then add_rms_norm, with and without bias, N not a power of two, -0 rows),
    matmul_partials' hand-back, and RoPE of q and k in one launch over their strided block."""
    _interpret(CHILD_FUSED, "interpreted fused launches OK")


CHILD_ROUTER = r'''
import torch
from kernels import router as RT
from kernels.triton.router import route

g = torch.Generator().manual_seed(5)
E, k = 64, 6
logits = torch.randn(40, E, generator=g) * 3
logits[0, :4] = torch.tensor([25.0, 30.0, -30.0, 1e-3])  # the x > 20 branch, a deep negative, near 0
bias = torch.randn(E, generator=g) * 0.05
for score in ("sqrtsoftplus", "sigmoid", "softmax"):
    kw = dict(score=score, expert_bias=bias, norm_topk_prob=True, scaling_factor=1.5)
    ids, w = route(logits, k, **kw)
    ids_c, w_c = RT.route(logits, k, **kw)
    assert torch.equal(ids, ids_c), score
    assert (w - w_c).abs().max().item() < 2e-6 * 1.5, (score, (w - w_c).abs().max().item())
    for i in (0, 7, 39):  # one row alone: the same bits as in the batch
        a, b = route(logits[i:i + 1], k, **kw)
        assert torch.equal(a, ids[i:i + 1]) and torch.equal(b, w[i:i + 1]), (score, i)
# the learner's path: kernels.route with the Triton forward (dispatch) and the reference formula's
# gradient at the Triton ids, against autograd of the CPU reference
import kernels.dispatch as D

up = torch.randn(40, k, generator=g)
for score in ("sqrtsoftplus", "sigmoid", "softmax"):
    kw = dict(score=score, expert_bias=bias, norm_topk_prob=True, scaling_factor=1.5)
    x_ref = logits.clone().requires_grad_(True)
    i_r, w_r = RT.route(x_ref, k, **kw)
    (w_r * up).sum().backward()
    use = D.use_triton
    D.use_triton = lambda *ts: D.backend() == "auto" and any(t is not None for t in ts)
    try:
        x_tri = logits.clone().requires_grad_(True)
        i_t, w_t = D.route(x_tri, k, **kw)
        (w_t * up).sum().backward()
    finally:
        D.use_triton = use
    assert torch.equal(i_t, i_r), score
    err = (x_tri.grad - x_ref.grad).abs().max().item()
    assert err < 1e-5 * max(1.0, x_ref.grad.abs().max().item()), (score, err)
print("interpreted router OK")
'''


def test_router_scores_in_the_triton_interpreter():
    """The Triton router's three score functions (DeepSeek-V4's sqrtsoftplus included): the CPU
    reference's experts, weights within rounding, each row's bits independent of the batch."""
    _interpret(CHILD_ROUTER, "interpreted router OK")


CHILD_MODEL = r'''
import sys
import tempfile

import torch

import benchmarks.rollout_gpu as rg
import kernels.dispatch as D
from helpers import DSV4_TINY

name = sys.argv[1]
tiny = {
    "moe1b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, vocab_size=96),
    "dsv3_4l": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4,
                    moe_intermediate_size=32, n_group=4, topk_group=2, vocab_size=96),
    "qwen2_1p5b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=96),
    "dsv4_4l": DSV4_TINY,
}.get(name)
g = torch.Generator().manual_seed(0)
ids = torch.randint(2, 60, (2, 12), generator=g)
extra = {}
if name == "kimi_k3":
    from kernels.models import kimi_k3 as R
    from test_kimi_k3 import K3_DICT, k3_weights

    c = R.kimi_config(K3_DICT)
    sd = k3_weights(c)
elif name == "dsv41":
    from kernels.models import dsv4 as V4
    from kernels.models import dsv41 as R
    from megatron_rz.learner.tiny_models import make_tiny_dsv41_checkpoint

    d = tempfile.mkdtemp()
    make_tiny_dsv41_checkpoint(d, seed=0)
    c = R.v41_config(d)
    sd = {k: v.float() if v.is_floating_point() else v for k, v in V4.load_state_dict(d).items()}
    extra = {"token_map": R.token_map_of(d, c)}
elif name == "dsv4_4l":
    from kernels.models import dsv4 as R

    d = tempfile.mkdtemp()
    rg.make_ckpt(name, d, seed=3, overrides=tiny, device="cpu", form="bf16")
    c = R.v4_config(d)
    sd = {k: v.float() if v.is_floating_point() else v for k, v in R.load_state_dict(d).items()}
else:
    from kernels.models import qwen3_dsv3 as R

    c = {**rg.COMMON, **rg.CONFIGS[name], **tiny}
    if c["model_type"] == "qwen2":
        c.pop("attention_bias", None)
    sd = {n: torch.ones(s) if n.endswith("norm.weight") or "layernorm" in n else
          torch.zeros(s) if n.endswith("e_score_correction_bias") else torch.randn(s, generator=g) * 0.1
          for n, s in rg.param_shapes(c).items()}


def grads():
    """Every weight's gradient of the summed log-probs (the V4 learners train through these
    functions: megatron_rz/learner/deepseek_v4.py)."""
    import inspect

    import kernels

    w = {k: v.clone().requires_grad_(True) if v.is_floating_point() else v for k, v in sd.items()}
    with torch.enable_grad():
        lg = inspect.unwrap(R.reference_logits)(w, c, ids, **extra)
        B, S = ids.shape
        lp = kernels.logprobs_from_logits(lg[:, :-1].reshape(B * (S - 1), -1), ids[:, 1:].reshape(-1), 1.0)
        lp.sum().backward()
    return {k: v.grad for k, v in w.items() if isinstance(v, torch.Tensor) and v.grad is not None}


learner = name in ("dsv4_4l", "dsv41")
ref = R.reference_logprobs(sd, c, ids, **extra)
g_ref = grads() if learner else None
# the CUDA dispatch on CPU tensors: every kernels.<op> takes its Triton path (interpreted here)
D.use_triton = lambda *ts: D.backend() == "auto" and any(t is not None for t in ts)
tri = R.reference_logprobs(sd, c, ids, **extra)
err = (tri - ref).abs().max().item()
assert torch.isfinite(tri).all() and err < 1e-3, (name, err)
print(name, "max |dlogp|", err)
if learner:
    # the GPU path's gradients (Triton forwards, kernels/grads.py and dispatch backwards) against the
    # CPU reference's autograd; measured: 1e-5 (V4) and 2.7e-4 (V4.1's engram query, where the fp32
    # reference is itself 2e-4 from float64 and the GPU path 6.5e-5)
    g_tri = grads()
    assert set(g_tri) == set(g_ref) and len(g_ref) > 100, (len(g_ref), set(g_tri) ^ set(g_ref))
    worst = max(((g_tri[k] - g_ref[k]).abs().max().item() / max(1e-6, g_ref[k].abs().max().item()), k) for k in g_ref)
    assert worst[0] < (1e-4 if name == "dsv4_4l" else 1e-3), (name, worst)
    print(name, "worst relative gradient difference", worst)
print("interpreted model OK")
'''


@pytest.mark.parametrize("config", ["dsv4_4l", "dsv41", "kimi_k3", "dsv3_4l", "moe1b", "qwen2_1p5b"])
def test_models_through_the_cuda_dispatch_in_the_interpreter(config):
    """Each engine family's forward (DeepSeek-V4 / V4.1 / V3, Kimi K3, Qwen3-MoE, Qwen2) with every
    kernels.<op> on its Triton path (interpreted on CPU):
    it runs (no op refuses an argument the family passes: the GPU once met DeepSeek-V4's router score
    this way, at engine start) and its log-probs agree with the CPU reference to rounding; for the
    DeepSeek-V4 / V4.1 learners, every weight's gradient agrees too (the router's backward once used
    sigmoid scores for V4's sqrtsoftplus)."""
    pytest.importorskip("triton")
    if config == "dsv41":
        pytest.importorskip("vllm.models.deepseek_v41.common.engram")  # the V4.1 reference's n-gram hashes
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", ROOT / "tests" / "unit"))}
    r = subprocess.run([sys.executable, "-c", CHILD_MODEL, config], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "interpreted model OK" in r.stdout


def test_triton_on_cpu_diagnosis_switch_routes_cpu_tensors_to_the_gpu_path():
    """RZ_TRITON_ON_CPU=1 with TRITON_INTERPRET=1 (kernels.dispatch): every op takes its Triton path on
    CPU tensors, so a CPU `rz check` runs the GPU's kernels on both sides; without it, CPU tensors
    take the exact CPU ops."""
    pytest.importorskip("triton")
    code = ("import torch, kernels, kernels.dispatch as D; x = torch.randn(3, 64); w = torch.ones(64); "
            "print(D.use_triton(x), torch.equal(kernels.rms_norm(x, w), kernels.rms_norm(x, w)))")
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    on = subprocess.run([sys.executable, "-c", code], env={**base, "TRITON_INTERPRET": "1", "RZ_TRITON_ON_CPU": "1"},
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    off = subprocess.run([sys.executable, "-c", code], env={**base, "TRITON_INTERPRET": "1", "RZ_TRITON_ON_CPU": "0"},
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert on.stdout.split() == ["True", "True"], on.stdout + on.stderr[-2000:]
    assert off.stdout.split() == ["False", "True"], off.stdout + off.stderr[-2000:]


def test_gemm_row_recompute_reads_a_localiser_record_in_the_interpreter(tmp_path):
    """benchmarks/gemm_row_recompute.py on a record like rz check's (fp32: the interpreter truncates
    bf16): the exact value and every config at every row count give the learner's value here, and a
    vLLM value one ulp off is matched by none of them."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 32, generator=g) * 0.2, torch.randn(32, generator=g)
    (tmp_path / "model").mkdir()
    save_file({"layers.2.attn.wq_b.weight": w}, str(tmp_path / "model" / "model.safetensors"))
    y = (x[None] @ w.T)[0]
    side = y.clone()
    side.view(torch.int32)[3] += 1
    rec = {"first_diverging_tap": "layer2.attn_q_b", "first_position": 0, "dtype": "float32",
           "differing_elements": [[3, float(y[3]), float(side[3])]], "input_tap": "layer2.attn_q_res",
           "input_row": x.double().tolist()}
    (tmp_path / "check.json").write_text(json.dumps({"localisation": {"vllm": rec}}))
    out = tmp_path / "out.json"
    _interpret(f'''
import sys
sys.argv = ["x", "--check", {str(tmp_path / "check.json")!r}, "--model", {str(tmp_path / "model")!r},
            "--rows", "1,17", "--device", "cpu", "--out", {str(out)!r}]
sys.path.insert(0, "benchmarks")
import gemm_row_recompute
assert gemm_row_recompute.main(sys.argv[1:]) == 0
print("recompute done")
''', "recompute done")
    res = json.loads(out.read_text())
    assert res["tap"] == "layer2.attn_q_b" and res["columns"] == [3]
    assert res["float64_rounded"] == res["learner"] != res["vllm"]
    runs = [v for by in res["configs"].values() for v in by.values()]
    assert len(runs) >= 3 * 5 and all(v == res["learner"] for v in runs)


CHILD_NARROW = r'''
import torch
from kernels import settings
from kernels.triton import moe as M

torch.manual_seed(5)
H, I, E, k = 64, 48, 16, 2  # N = 48 (gate/up) and 64 (down): a 32- or 16-wide tile masks the last one
wgu = torch.randn(E, 2 * I, H) * H ** -0.5
wd = torch.randn(E, H, I) * I ** -0.5
plans = [(False, False), (True, False), (False, True), (True, True)]  # (narrow tiles, direct rows)
for T in (1, 3, 4, 5, 8):
    x = torch.randn(T, H)
    w, ids = torch.randn(T, E).softmax(-1).topk(k, -1)
    if T == 3:
        ids[1] = ids[0]  # two tokens with the same experts: a direct-rows expert with two rows
    outs = {}
    for narrow, direct in plans:
        settings.set_moe_narrow_tiles(narrow)
        settings.set_moe_direct_rows(direct)
        outs[narrow, direct] = (M.moe_experts_merged(x, wgu, wd, ids, w, k_segments_down=4),
                                M.grouped_linear(x, wgu[:, :I], ids[:, 0]))
    assert M.direct_rows(T * k, E, on=True) == (T <= 4)
    for plan in plans[1:]:
        for a, b in zip(outs[plans[0]], outs[plan]):
            assert torch.equal(a, b), (T, plan)
    outs = {False: outs[plans[0]], True: outs[plans[3]]}
    ref = torch.stack([torch.nn.functional.silu(x[t] @ wgu[e, :I].T) * (x[t] @ wgu[e, I:].T) for t in range(T)
                       for e in ids[t].tolist()]).view(T, k, I)
    full = torch.stack([sum(w[t, j] * (ref[t, j] @ wd[ids[t, j]].T) for j in range(k)) for t in range(T)])
    assert torch.allclose(outs[True][0], full, atol=1e-4, rtol=1e-4), (outs[True][0] - full).abs().max()
# the plans themselves: batch 1 of a 32-expert top-4 layer goes narrow, a 32-row decode stays at 64
assert M.grouped_tile_n(4, 32, 768, 16, True, 132, narrow=True) == (16, 1)
assert M.grouped_tile_n(4, 32, 768, 16, True, 132, narrow=False) == (64, 4)
assert M.grouped_tile_n(128, 32, 768, 16, True, 132, narrow=True) == (64, 4)
assert M.grouped_tile_n(4, 32, 1024, 16, False, 132, narrow=True) == (16, 1)
assert M.grouped_tile_n(2048, 32, 768, 128, True, 132, narrow=True) == (64, 8)  # prefill tiles unchanged
print("interpreted narrow MoE tiles OK")
'''


def test_moe_narrow_tiles_equal_the_default_plan_in_the_interpreter():
    """Grouped MoE GEMMs with narrow output tiles (settings.set_moe_narrow_tiles) and without a work
    list for a few rows (set_moe_direct_rows), each and both == the default plan, masks of a last
    partial tile and an expert holding two rows included, and close to a float reference; and the
    host picks."""
    _interpret(CHILD_NARROW, "interpreted narrow MoE tiles OK")


CHILD_QK = r'''
import torch
import kernels
from kernels import dispatch as D
from kernels.triton import rmsnorm as TN, rope as TR

D.use_triton = lambda *ts: D.backend() == "auto" and any(t is not None for t in ts)  # CPU tensors: Triton path
torch.manual_seed(2)
T, Hq, Hkv, Dh = 5, 6, 2, 64
y = torch.randn(T, (Hq + 2 * Hkv) * Dh).to(torch.bfloat16)  # a packed q/k/v GEMM output
qk = y[:, :(Hq + Hkv) * Dh].view(T, Hq + Hkv, Dh)  # strided: rows of y
wq, wk = torch.randn(Dh).to(torch.bfloat16), torch.randn(Dh).to(torch.bfloat16)
one = TN.qk_rms_norm(qk, wq, wk, Hq, 1e-6)
two = torch.cat([TN.rms_norm(y[:, :Hq * Dh].reshape(T, Hq, Dh), wq, 1e-6),
                 TN.rms_norm(y[:, Hq * Dh:(Hq + Hkv) * Dh].reshape(T, Hkv, Dh), wk, 1e-6)], 1)
assert one.is_contiguous() and torch.equal(one, two)
assert torch.equal(kernels.qk_rms_norm(qk, wq, wk, Hq, 1e-6), two)  # the dispatch's Triton path
# and the aligned engine's composition: one RoPE launch over both == RoPE of q and of k
pos = torch.arange(T, dtype=torch.float64)[:, None]
inv = 1.0 / (10000 ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
cos, sin = torch.cos(pos * inv).float(), torch.sin(pos * inv).float()
r1 = TR.apply_rope(one, cos, sin, "neox")
assert torch.equal(r1[:, :Hq], TR.apply_rope(two[:, :Hq], cos, sin, "neox"))
assert torch.equal(r1[:, Hq:], TR.apply_rope(two[:, Hq:], cos, sin, "neox"))
# with gradients the dispatch falls back to the two differentiable norms
wq2 = wq.float().requires_grad_(True)
g = kernels.qk_rms_norm(qk.float(), wq2, wk.float(), Hq, 1e-6)
g.sum().backward()
assert wq2.grad is not None and torch.isfinite(wq2.grad).all()
for bad in (dict(num_q_heads=0), dict(num_q_heads=Hq + Hkv), dict(q_weight=torch.ones(Dh + 1, dtype=torch.bfloat16))):
    kw = {**dict(qk=qk, q_weight=wq, k_weight=wk, num_q_heads=Hq), **bad}
    try:
        TN.qk_rms_norm(**kw)
    except ValueError as e:
        assert "qk_rms_norm" in str(e)
    else:
        raise AssertionError(bad)
print("interpreted qk norm OK")
'''


def test_qk_norms_in_one_launch_equal_two_in_the_interpreter():
    """kernels.qk_rms_norm (Qwen3's q and k norms over the packed q/k/v output, one launch) ==
    the two rms_norm launches, and one RoPE launch over its output == RoPE of q and of k."""
    _interpret(CHILD_QK, "interpreted qk norm OK")


CHILD_COMBINE_ROUND = r'''
import torch
from kernels.triton import moe as TM

torch.manual_seed(0)
# one slot per token (k = 1, expert output 1.0): the combine's output is the weight as the kernel used it
v = torch.cat([torch.randn(3000) * 10.0 ** torch.randint(-30, 30, (3000,)).float(),
               1.0 + torch.arange(0, 2048).float() * 2.0 ** -9,   # every other one a tie, odd and even
               torch.tensor([0.0, -0.0, 1e-40, -1e-41, 3.0e38, 3.39e38, -3.39e38, float("inf"), 2.0 ** -133])])
ones = torch.ones(v.numel(), 1, 8)
for wd in (torch.bfloat16, torch.float16):
    got = TM.moe_combine(ones, v[:, None], out_dtype=torch.float32, weights_dtype=wd)[:, 0]
    want = v.to(wd).float()
    assert torch.equal(got, want), (wd, (got != want).nonzero()[:5].flatten().tolist())
    # weights already in that dtype: read directly, no rounding (normal numbers: the interpreter reads a
    # subnormal bf16 as 0, which the rounding path above does not depend on)
    got = TM.moe_combine(ones, v[:, None].to(wd), out_dtype=torch.float32, weights_dtype=wd)[:, 0]
    normal = (want == 0) | (want.abs() >= torch.finfo(wd).tiny)
    assert torch.equal(got[normal], want[normal])
# top-4 softmax weights over bf16 expert outputs, with a shared expert: the bits of rounding them first
y, s = torch.randn(9, 4, 40).to(torch.bfloat16), torch.randn(9, 40).to(torch.bfloat16)
w = torch.softmax(torch.randn(9, 4), -1)
for shared in (None, s):
    a = TM.moe_combine(y, w, shared, out_dtype=torch.bfloat16, weights_dtype=torch.bfloat16)
    b = TM.moe_combine(y, w.to(torch.bfloat16), shared, out_dtype=torch.bfloat16)
    assert torch.equal(a, b)
    # bf16 weights are read as they are: the bits of widening them first
    assert torch.equal(b, TM.moe_combine(y, w.to(torch.bfloat16).float(), shared, out_dtype=torch.bfloat16))
try:
    TM.moe_combine(y, w, weights_dtype=torch.int8)
    raise AssertionError("int8 accepted")
except ValueError as e:
    assert "weights_dtype" in str(e)
print("COMBINE ROUND OK")
'''


def test_combine_rounds_the_routing_weights_as_torch_does_in_the_interpreter():
    """moe_combine(..., weights_dtype=bf16 / fp16): the routing weights rounded to that dtype in the
    kernel are exactly ``topk_weights.to(dtype)`` (ties, subnormals, overflow to inf included), so the
    aligned engine drops a conversion launch per MoE layer and keeps the learner's bits."""
    _interpret(CHILD_COMBINE_ROUND, "COMBINE ROUND OK")
