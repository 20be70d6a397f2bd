"""The aligned CUDA sampler's fused launch plans, checked on the CPU against the unfused ones.

The kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported,
hence a child process, as in test_triton_interpret.py): the bits of the GPU come from
tests/gpu/test_sampling_gpu.py, but indexing, masking and the flag logic are the same code.

* ``log_softmax`` in two launches (each output program merges its row's piece stats) equals the
  three-launch plan (a kernel writing each row's (M, log S)), for one and several vocabulary
  pieces, ``-inf`` columns and per-row temperatures, and stays bitwise ``logprobs_from_logits``;
* ``gumbel_draw_with_logprob`` draws the tokens of ``gumbel_draw`` (keyed, unkeyed, greedy rows),
  its ``token_lp`` is ``lp.gather`` and its flag is 0 exactly when some ``token_lp`` is not finite;
* ``DrawKeys.step`` gives the keys of the previous implementation (a Python list per step and
  ``torch.tensor``, kept below as the oracle) and advances the generators the same way: mixed
  seeded / unseeded rows, a generator shared by two rows, batches beyond the pinned buffer's size,
  and a generator without a Philox offset (nothing advanced, the sampler falls back).
"""

import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import torch
from kernels import settings
from kernels.triton.draw import gumbel_draw, gumbel_draw_with_logprob
from kernels.triton.logprobs import PIECE, log_softmax, logprobs_from_logits

g = torch.Generator().manual_seed(3)
for V in (1000, 32000, 40000):  # one vocabulary piece, two, three
    R = 3 if V < 2048 else 2  # (the interpreter is slow: few rows of the large vocabularies)
    x = torch.randn(R, V, generator=g) * 4
    x[0, ::5] = float("-inf")  # -inf columns (a masked vocabulary)
    x[1, V // 2] = 30.0  # a dominant column
    T = torch.tensor([1.0, 0.7, 1.3][:R])
    for temp in ((T, 1.0, 0.6) if V < 2048 else (T,)):
        two = log_softmax(x, temp, fold=True)
        three = log_softmax(x, temp, fold=False)
        assert torch.equal(two, three), (V, temp)
        t = torch.randint(0, V, (R,), generator=g)
        t[0] = 5  # a -inf column's logprob
        assert torch.equal(logprobs_from_logits(x, t, temp), two.gather(1, t[:, None]).squeeze(1)), (V, temp)
    per_row = log_softmax(x, T, fold=True)
    assert torch.equal(per_row[R - 1], log_softmax(x[R - 1:], float(T[R - 1]), fold=True)[0]), V  # == the float T
    assert bool(torch.isneginf(per_row[0, ::5]).all()) and bool(torch.isfinite(per_row[1]).all())
settings.set_fused_sampler(False)  # the default plan follows the switch
assert torch.equal(log_softmax(x[:1], T[:1]), log_softmax(x[:1], T[:1], fold=False))
settings.set_fused_sampler(True)
assert torch.equal(log_softmax(x[:1], T[:1]), per_row[:1])
assert 1000 < PIECE < 32000 <= 2 * PIECE < 40000  # the sizes above: one, two and three pieces

keys = torch.tensor([[11, 5], [12, 0], [13, 9], [14, 1], [15, 2], [2**62 + 3, 2**40 + 7], [16, 3]])
for V in (1000, 5000):  # the race over one column block, and two (BLOCK = 4096)
    N = 7
    x = torch.randn(N, V, generator=g) * 3
    x[2] = float("-inf")
    x[2, 3], x[2, 7] = 0.0, 1.0  # a kept set of two tokens: every other column's lp is -inf
    T = torch.tensor([1.0, 0.0, 1.0, 0.7, 1e-6, 1.3, 1.0])  # rows 1 and 4 greedy (T < eps)
    T_lp = torch.where(T < 1e-5, torch.ones_like(T), T)  # the sampler's logprob temperature
    lp = log_softmax(x, T_lp)
    for k in (keys, None):
        tok = gumbel_draw(x, T, k, base_seed=99)
        tok2, tlp, fin = gumbel_draw_with_logprob(x, T, lp, k, base_seed=99)
        assert torch.equal(tok2, tok), (V, k is None)
        assert torch.equal(tlp, lp.gather(1, tok[:, None]).squeeze(1)), V
        assert fin.dtype == torch.int32 and fin.shape == (1,) and int(fin) == 1, V
        assert torch.equal(tok[[1, 4]], x[[1, 4]].argmax(1)) and int(tok[2]) in (3, 7)
# lp read through its row stride (a slice of a wider tensor)
wide = torch.full((N, V + 9), float("nan"))
wide[:, :V] = lp
tok3, tlp3, fin3 = gumbel_draw_with_logprob(x, T, wide[:, :V], keys, base_seed=99)
assert torch.equal(tok3, gumbel_draw(x, T, keys)) and torch.equal(tlp3, lp.gather(1, tok3[:, None]).squeeze(1))
assert int(fin3) == 1
# the flag is cleared exactly when a drawn token's value is not finite
x, T, lp = x[:, :1000].contiguous(), T, log_softmax(x[:, :1000], T_lp)
tok = gumbel_draw(x, T, None, base_seed=99)
for bad in (float("-inf"), float("inf"), float("nan")):
    for row in (0, N - 1):
        lpb = lp.clone()
        lpb[row, tok[row]] = bad
        tokb, tlpb, finb = gumbel_draw_with_logprob(x, T, lpb, None, base_seed=99)
        assert int(finb) == 0 and torch.equal(tokb, tok), (bad, row)
        assert torch.equal(torch.isfinite(tlpb), torch.arange(N) != row)
lpb = lp.clone()
lpb[0, (tok[0] + 1) % 1000] = float("nan")  # a non-finite value off the drawn token: the flag stays
assert int(gumbel_draw_with_logprob(x, T, lpb, None, base_seed=99)[2]) == 1
# a NaN logits row: its log-probs are NaN, whichever token the race returns
x[3] = float("nan")
lpn = log_softmax(x, T_lp)
tokn, tlpn, finn = gumbel_draw_with_logprob(x, T, lpn, keys, base_seed=99)
assert torch.equal(tokn, gumbel_draw(x, T, keys)) and 0 <= int(tokn[3]) < 1000
assert int(finn) == 0 and bool(torch.isnan(tlpn[3])) and bool(torch.isfinite(tlpn[[0, 1, 2, 4, 5, 6]]).all())
e = torch.empty(0, 10)
t0, l0, f0 = gumbel_draw_with_logprob(e, torch.empty(0), e, None)
assert t0.shape == (0,) and l0.shape == (0,) and int(f0) == 1
print("fused sampler kernels OK")
'''


def test_fused_plans_in_the_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "fused sampler kernels OK" in r.stdout


class FakeGen:
    """The part of a CUDA ``torch.Generator`` the keys use: a seed and a Philox offset."""

    def __init__(self, seed: int, offset: int = 0):
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def previous_keys(n: int, generators: dict, base: int) -> torch.Tensor:
    """The previous DrawKeys.step's key building (the oracle): a Python list, then torch.tensor."""
    flat = []
    for r in range(n):
        g = generators.get(r)
        if g is None:
            flat += (base, r)
        else:
            off = g.get_offset()
            g.set_offset(off + 4)
            flat += (g.initial_seed() & ((1 << 63) - 1), off // 4)
    return torch.tensor(flat, dtype=torch.int64).view(n, 2)


def _twins(rng: random.Random, rows: list):
    """Two identical dicts of fake generators (one for the new code, one for the oracle)."""
    specs = {}
    for r in rows:
        seed = rng.choice([rng.getrandbits(64), rng.getrandbits(63), 0, 2**64 - 1, 2**63])
        specs[r] = (seed, 4 * rng.choice([0, 1, rng.getrandbits(20), rng.getrandbits(40)]))
    a = {r: FakeGen(*s) for r, s in specs.items()}
    b = {r: FakeGen(*s) for r, s in specs.items()}
    return a, b


def test_draw_keys_equal_the_previous_loop():
    from vllm_bridge.sampler_patch import DrawKeys

    rng = random.Random(7)
    dk = DrawKeys()
    held = []
    for step, n in enumerate([1, 5, 32, 256, 257, 1000, 3, 64, 300, 2, 700, 9, 1, 40, 256, 33, 5000, 7, 8, 12]):
        rows = rng.sample(range(n), rng.randint(1, n)) if step % 3 else list(range(n))  # some steps all seeded
        a, b = _twins(rng, rows)
        if n > 3 and step % 4 == 1:  # a generator shared by two rows, and one under a key beyond the batch
            a[rows[0]] = a[n - 1] = FakeGen(123, 8)
            b[rows[0]] = b[n - 1] = FakeGen(123, 8)
            a[n + 5], b[n + 5] = FakeGen(9, 44), FakeGen(9, 44)
        keys, base = dk.step(n, a, "cpu")
        want = previous_keys(n, b, base)
        assert keys.dtype == torch.int64 and keys.shape == (n, 2)
        assert torch.equal(keys, want), (step, n)
        assert {r: (g.seed, g.offset) for r, g in a.items()} == {r: (g.seed, g.offset) for r, g in b.items()}
        held.append((keys, want))
    for keys, want in held:  # keys handed out earlier stay as they were (ring slots reused, regrown)
        assert torch.equal(keys, want)
    # the same generators again: their next draw (counter + 1), the unseeded rows a fresh base
    a, b = _twins(rng, [0, 2, 3])
    k1, b1 = dk.step(4, a, torch.device("cpu"))
    k2, b2 = dk.step(4, a, torch.device("cpu"))
    assert torch.equal(k2[[0, 2, 3], 1], k1[[0, 2, 3], 1] + 1) and torch.equal(k2[[0, 2, 3], 0], k1[[0, 2, 3], 0])
    assert int(k1[1, 0]) == b1 and int(k2[1, 0]) == b2 and int(k1[1, 1]) == int(k2[1, 1]) == 1
    assert all(a[r].offset == b[r].offset + 8 for r in a)
    assert dk.step(4, {}, "cpu")[0] is None  # no seeded row: the unkeyed draw


def test_fill_keys_without_philox_offset_advances_nothing():
    import numpy as np

    from kernels import settings
    from vllm_bridge import sampler_patch as sp

    gens = {0: FakeGen(1, 16), 1: FakeGen(2, 0), 3: torch.Generator().manual_seed(5), 4: FakeGen(3, 4)}
    out = np.full(20, -1, dtype=np.int64)
    with pytest.raises(sp.NoPhiloxOffset):
        sp.fill_keys(out, 5, gens, 77)
    assert (gens[0].offset, gens[1].offset, gens[4].offset) == (16, 0, 4)
    gens[3] = SimpleNamespace()  # no get_offset at all
    with pytest.raises(sp.NoPhiloxOffset):
        sp.fill_keys(out, 5, gens, 77)
    assert (gens[0].offset, gens[1].offset, gens[4].offset) == (16, 0, 4)
    # the sampler then takes vLLM's own draw for the step (None), as it does with RZ_BATCHED_DRAW=0
    sampler, md = SimpleNamespace(), SimpleNamespace(generators=gens)
    assert sp._draw_keys(sampler, 5, md, "cpu") is None
    md.generators = {1: FakeGen(2, 0)}
    keys, base = sp._draw_keys(sampler, 5, md, "cpu")
    assert torch.equal(keys, torch.tensor([[base, 0], [2, 0], [base, 2], [base, 3], [base, 4]]))
    settings.set_batched_draw(False)
    try:
        assert sp._draw_keys(sampler, 5, md, "cpu") is None and md.generators[1].offset == 4
    finally:
        settings.set_batched_draw(True)
