"""kernels/sampling.py: the processed (sampled-from) logprob of temperature / top-k / top-p.

Row invariance with torch.equal (a row's processed logprob does not depend on the other rows,
their sampling parameters or their number), the tie rule, the kept set against a plain
definition, the temperature-only path equal to logprobs_from_logits, gradients, and the
sampled-token guarantee of masked_logits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels.sampling import _exclusive_cumsum

SETTINGS = settings(max_examples=30, deadline=None)
V = 64


def _logits(g: torch.Generator, n: int, v: int = V, dtype=torch.float32, ties: bool = False) -> torch.Tensor:
    x = torch.randn(n, v, generator=g) * 3
    if ties:  # few distinct values: many exact ties, also at the top-k / top-p boundary
        x = torch.round(x)
    return x.to(dtype)


params_st = st.tuples(
    st.sampled_from([0.6, 0.7, 1.0, 1.3]),
    st.sampled_from([-1, 0, 1, 2, 5, 20, V - 1, V, V + 3]),
    st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.05]),
)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 48), params=params_st, ties=st.booleans(),
       bf16=st.booleans(), data=st.data())
def test_row_does_not_depend_on_the_other_rows(seed, n, params, ties, bf16, data):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    T, k, p = params
    row = _logits(g, 1, dtype=dtype, ties=ties)
    target = torch.randint(0, V, (1,), generator=g)
    alone = kernels.sampled_logprobs(row, target, T, k, p)
    alone_full = kernels.processed_logprobs(row, T, k, p)
    i = data.draw(st.integers(0, n - 1))
    batch = _logits(g, n, dtype=dtype, ties=ties)
    batch[i] = row[0]
    targets = torch.randint(0, V, (n,), generator=g)
    targets[i] = target[0]
    # the same parameters for every row (the learner) ...
    assert torch.equal(kernels.sampled_logprobs(batch, targets, T, k, p)[i:i + 1], alone)
    assert torch.equal(kernels.processed_logprobs(batch, T, k, p)[i:i + 1], alone_full)
    # ... and per-row parameters, the others random (an engine batch of mixed requests)
    Ts = torch.tensor([data.draw(params_st)[0] for _ in range(n)], dtype=torch.float32)
    ks = torch.tensor([data.draw(params_st)[1] for _ in range(n)])
    ps = torch.tensor([data.draw(params_st)[2] for _ in range(n)], dtype=torch.float32)
    Ts[i], ks[i], ps[i] = T, k, p
    assert torch.equal(kernels.sampled_logprobs(batch, targets, Ts, ks, ps)[i:i + 1], alone)
    assert torch.equal(kernels.processed_logprobs(batch, Ts, ks, ps)[i:i + 1], alone_full)
    # the full row and the gathered value agree bitwise
    assert torch.equal(alone_full.gather(1, target[:, None])[:, 0], alone)


def _plain_kept(x: torch.Tensor, k: int, p: float) -> set[int]:
    """The definition, in float64 with Python lists: rank by (value desc, id asc); first k; then the
    smallest prefix whose probability mass (renormalised over the k) reaches p."""
    order = sorted(range(len(x)), key=lambda j: (-float(x[j]), j))
    if 0 < k < len(x):
        order = order[:k]
    if p >= 1:
        return set(order)
    m = float(x[order[0]])
    e = [math.exp(float(x[j]) - m) for j in order]
    z = sum(e)
    kept, mass = [], 0.0
    for j, ej in zip(order, e):
        if mass >= p:
            break
        kept.append(j)
        mass += ej / z
    return set(kept)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), params=params_st, ties=st.booleans())
def test_kept_set_matches_the_definition(seed, params, ties):
    T, k, p = params
    g = torch.Generator().manual_seed(seed)
    row = _logits(g, 1, ties=ties)
    lp = kernels.processed_logprobs(row, T, k, p)[0]
    kept = set(torch.isfinite(lp).nonzero().flatten().tolist())
    x = (row[0] / torch.tensor(T, dtype=torch.float32)).double()
    want = _plain_kept(x, k, p)
    if kept != want:  # only a float32-vs-float64 rounding tie at the p boundary may differ
        assert len(kept ^ want) == 1, (kept ^ want)
    if 0 < k < V:
        assert len(kept) <= k
    assert math.isclose(float(lp[torch.isfinite(lp)].double().exp().sum()), 1.0, rel_tol=1e-5)


def test_top_k_ties_go_to_the_lower_token_id():
    row = torch.zeros(1, 8)
    row[0, [2, 5, 6]] = 1.0  # three tied maxima
    lp = kernels.processed_logprobs(row, 1.0, 2, 1.0)[0]
    assert torch.isfinite(lp).nonzero().flatten().tolist() == [2, 5]
    assert torch.equal(lp[2], lp[5]) and float(lp[2]) == pytest.approx(math.log(0.5))
    # top-k 1 is greedy with the lowest id
    assert torch.isfinite(kernels.processed_logprobs(row, 1.0, 1, 1.0)[0]).nonzero().flatten().tolist() == [2]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    row = probs.log()
    for p, kept in ((0.5, [0]), (0.51, [0, 1]), (0.8, [0, 1]), (0.81, [0, 1, 2]), (0.99, [0, 1, 2, 3])):
        lp = kernels.processed_logprobs(row, 1.0, 0, p)[0]
        assert torch.isfinite(lp).nonzero().flatten().tolist() == kept, p
        assert float(lp[0]) == pytest.approx(math.log(0.5 / float(probs[0, kept].sum())), rel=1e-6)


@pytest.mark.parametrize("T", [0.6, 1.0, 1.3])
def test_untruncated_is_the_temperature_only_path(T):
    g = torch.Generator().manual_seed(3)
    x = _logits(g, 33)
    t = torch.randint(0, V, (33,), generator=g)
    want = kernels.logprobs_from_logits(x, t, T)
    for k, p in ((-1, 1.0), (0, 1.0), (V, 1.0), (V + 5, 1.0)):
        assert torch.equal(kernels.sampled_logprobs(x, t, T, k, p), want)
        assert torch.equal(kernels.sampled_logprobs(x, t, torch.full((33,), T), k, p), want)  # per-row T
        assert torch.equal(kernels.processed_logprobs(x, T, k, p).gather(1, t[:, None])[:, 0], want)


def test_division_by_a_tensor_temperature_equals_the_python_scalar():
    # the engine divides by vLLM's fp32 temperature tensor, the learner passes a float
    g = torch.Generator().manual_seed(4)
    x = _logits(g, 200, 128)
    for T in (0.6, 0.7, 0.9, 1.1, 1.3):
        assert torch.equal(x / T, x / torch.tensor([T], dtype=torch.float32).unsqueeze(1))


def test_exclusive_cumsum_is_a_prefix_sum():
    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 3, 7, 64, 100):
        x = torch.rand(3, n, generator=g, dtype=torch.float64)
        want = torch.cumsum(x, -1) - x
        assert torch.allclose(_exclusive_cumsum(x), want, atol=1e-12)


def test_masked_logits_support_is_the_kept_set_and_draws_stay_inside():
    g = torch.Generator().manual_seed(6)
    x = _logits(g, 64, ties=True)
    T, k, p = 0.7, 5, 0.9
    kept = torch.isfinite(kernels.processed_logprobs(x, T, k, p))
    m = kernels.masked_logits(x, T, k, p)
    assert torch.equal(torch.isfinite(m), kept)
    draws = torch.distributions.Categorical(logits=m).sample((50,))  # [50, 64]
    assert bool(kept.gather(1, draws.T).all())
    lp = kernels.sampled_logprobs(x, draws[0], T, k, p)
    assert bool(torch.isfinite(lp).all())


def test_gradient_matches_the_renormalised_softmax():
    g = torch.Generator().manual_seed(7)
    x = _logits(g, 6).requires_grad_(True)
    t = kernels.processed_logprobs(x.detach(), 0.8, 5, 0.9).argmax(-1)  # a kept token per row
    kernels.sampled_logprobs(x, t, 0.8, 5, 0.9).sum().backward()
    kept = torch.isfinite(kernels.processed_logprobs(x.detach(), 0.8, 5, 0.9))
    y = torch.where(kept, x.detach() / 0.8, torch.full_like(x, float("-inf"))).requires_grad_(True)
    torch.log_softmax(y, -1).gather(1, t[:, None]).sum().backward()
    assert torch.allclose(x.grad, y.grad / 0.8, atol=1e-6)
    assert torch.equal(x.grad[~kept], torch.zeros_like(x.grad[~kept]))


def test_token_outside_the_kept_set_is_minus_inf_and_gets_no_nan_gradient():
    from megatron_rz.rl.losses import reinforce_zero_loss

    x = torch.tensor([[3.0, 2.0, -5.0, -6.0]], requires_grad=True)
    lp = kernels.sampled_logprobs(x, torch.tensor([3]), 1.0, 2, 1.0)
    assert lp.item() == float("-inf")
    loss, _ = reinforce_zero_loss(lp.view(1, 1), torch.tensor([[-1.0]]), torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))


def test_invalid_params():
    with pytest.raises(ValueError):
        kernels.SamplingParams(temperature=0.0)
    with pytest.raises(ValueError):
        kernels.SamplingParams(top_p=0.0)
    assert kernels.SamplingParams(top_k=5).truncates(V) and not kernels.SamplingParams(top_k=V).truncates(V)
