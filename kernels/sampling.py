"""Sampling post-processing: temperature, top-k, top-p -> the processed (sampled-from) log-probs.

The one implementation both sides call: the learner (megatron_rz.learner.learner, both modes) and the
aligned vLLM engine's sampler (vllm_bridge.sampler_patch, through the plugin). The rollout
logprob of a token is its log-probability under the distribution it was actually drawn from, so
the learner must compute exactly that quantity (kernels/README.md, "Sampling").

Contract, per row of fp32 logits ``l[V]`` with the row's own ``(T, k, p)``:

1. ``x = l.float() / T`` (IEEE division by an fp32 tensor; never ``* (1/T)``).
2. Rank order: a **stable** descending sort of ``x``: larger first, equal values by lower token id
   first. Stability makes the permutation unique, so it is the same on any device and for any
   batch (a non-stable sort may order ties differently with the batch).
3. top-k (``0 < k < V``; ``k <= 0`` or ``k >= V`` is off): keep ranks ``0 .. k-1``: exactly k tokens,
   a tie at the boundary goes to the lower token id (stock vLLM keeps every tied token).
4. top-p (``0 < p < 1``; ``p >= 1`` is off), over the top-k survivors:
   ``e_r = exp(s_r - s_0)`` (0 for ranks dropped by top-k), ``Z = tree_sum(e)``, ``P_r = e_r / Z``,
   ``C_r = sum_{j<r} P_j`` (exclusive prefix sum, Hillis-Steele scan: log2(V) elementwise adds in an
   order fixed by V alone); keep rank r iff ``C_r < p``: the smallest prefix whose mass reaches p.
   Rank 0 is always kept (``C_0 = 0 < p``).
5. A kept token's processed logprob is ``(s_r - s_0) - log(tree_sum(e over kept ranks))``; every
   other token's is ``-inf``.

Rows with neither top-k nor top-p active are exactly ``kernels.logprobs_from_logits(l, t, T)``
(``log_softmax(l / T)``, the existing temperature-only path on each device), so turning the sampling
parameters off changes no bit anywhere.

Only row-local ops (sort / gather / scatter of one row, elementwise arithmetic, ``exp``/``log``,
``tree_sum``): a row's result does not depend on the other rows of the batch, their parameters or
their number. On CPU that is tested (tests/unit/test_sampling.py); on CUDA the same torch ops run and
are row-invariant by construction (no reduction whose order depends on the grid), but GPU bitwise
parity of this stage against CUDA vLLM is untested.

A token outside the kept set has logprob ``-inf``. The engine can never sample one: it draws from
:func:`masked_logits` (the same kept set, other tokens ``-inf``), and the sampler patch checks
that every sampled token's processed logprob is finite. The learner can see one only when its
weights differ from the rollout's (policy lag) or its logits do (fast mode): then ``-inf`` is the
right value (the learner's policy cannot produce that token), its importance weight is exactly 0
and it carries no gradient (megatron_rz.rl.losses / diagnostics count it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ._common import tree_sum

__all__ = [
    "SamplingParams",
    "masked_logits",
    "processed_logprobs",
    "sampled_logprobs",
    "truncation_active",
]

Num = Union[float, int, torch.Tensor]


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings that are part of the logprob contract (recipe ``rollout``)."""

    temperature: float = 1.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0  # >= 1: off

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")

    def truncates(self, vocab_size: int) -> bool:
        return 0 < self.top_k < vocab_size or self.top_p < 1

    def kwargs(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def _rows(v: Num, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.as_tensor(v, dtype=dtype, device=device)
    if t.dim() == 0:
        t = t.expand(n)
    if t.shape != (n,):
        raise ValueError(f"per-row sampling parameter of shape {tuple(t.shape)} for {n} rows")
    return t


def _params(logits: torch.Tensor, temperature: Num, top_k: Num, top_p: Num):
    n, V = logits.shape
    T = _rows(temperature, n, torch.float32, logits.device)
    k = _rows(top_k, n, torch.int64, logits.device)
    p = _rows(top_p, n, torch.float32, logits.device)
    k = torch.where((k <= 0) | (k >= V), torch.full_like(k, V), k)
    active = (k < V) | (p < 1)
    return T, k, p, active


def truncation_active(vocab_size: int, top_k: Num = 0, top_p: Num = 1.0) -> torch.Tensor:
    """Per-row (or scalar) bool: does top-k or top-p remove any token for these parameters?"""
    k = torch.as_tensor(top_k, dtype=torch.int64)
    p = torch.as_tensor(top_p, dtype=torch.float32)
    return ((k > 0) & (k < vocab_size)) | (p < 1)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum over the last dim, Hillis-Steele: step j adds the element 2**j to the
    left. The additions are elementwise and their association depends only on the length."""
    n = x.shape[-1]
    y = x
    shift = 1
    while shift < n:
        y = torch.cat([y[..., :shift], y[..., shift:] + y[..., :-shift]], dim=-1)
        shift *= 2
    return torch.cat([torch.zeros_like(y[..., :1]), y[..., :-1]], dim=-1)


def _truncated(logits: torch.Tensor, T: torch.Tensor, k: torch.Tensor, p: torch.Tensor):
    """Rows with top-k / top-p active: (sorted processed logprobs [n, V], sort index [n, V], x [n, V])."""
    x = logits.to(torch.float32) / T.unsqueeze(1)
    s, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    V = s.shape[-1]
    rank = torch.arange(V, device=s.device)
    keep = rank.unsqueeze(0) < k.unsqueeze(1)
    d = s - s[:, :1]
    zero = torch.zeros((), dtype=torch.float32, device=s.device)
    e = torch.where(keep, torch.exp(d), zero)
    with torch.no_grad():  # the kept set is a selection: no gradient flows through it
        P = e.detach() / tree_sum(e.detach(), -1, keepdim=True)
        keep = keep & ((_exclusive_cumsum(P) < p.unsqueeze(1)) | (p.unsqueeze(1) >= 1))
    z = tree_sum(torch.where(keep, e, zero), -1, keepdim=True)
    neg_inf = torch.full((), float("-inf"), dtype=torch.float32, device=s.device)
    lp_sorted = torch.where(keep, d - torch.log(z), neg_inf)
    return lp_sorted, idx, x


def _unsort(sorted_vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(sorted_vals).scatter(-1, idx, sorted_vals)


def _temperature_groups(T: torch.Tensor, rows: torch.Tensor):
    """Rows of equal temperature together (the untruncated path takes a Python-scalar T)."""
    if rows.numel() == 0:
        return
    vals = T[rows]
    for t in torch.unique(vals).tolist():
        yield float(t), rows[vals == t]


def sampled_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: Num = 1.0, top_k: Num = 0,
                     top_p: Num = 1.0) -> torch.Tensor:
    """fp32 ``[N]``: processed logprob of ``targets[N]`` under each row's (T, k, p). Differentiable.

    ``logits`` [N, V] (any float dtype; computed in fp32). Parameters are scalars or per-row tensors.
    """
    from . import dispatch

    if logits.dim() != 2:
        raise ValueError("sampled_logprobs: logits must be [N, V]")
    targets = targets.to(torch.long).reshape(-1)
    T, k, p, active = _params(logits, temperature, top_k, top_p)
    if not bool(active.any()):
        if isinstance(temperature, (int, float)):
            return dispatch.logprobs_from_logits(logits, targets, float(temperature))
    out = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    plain = (~active).nonzero().squeeze(1)
    for t, rows in _temperature_groups(T, plain):
        out = out.index_copy(0, rows, dispatch.logprobs_from_logits(logits[rows], targets[rows], t))
    trunc = active.nonzero().squeeze(1)
    if trunc.numel():
        lp_sorted, idx, _ = _truncated(logits[trunc], T[trunc], k[trunc], p[trunc])
        lp = _unsort(lp_sorted, idx).gather(-1, targets[trunc].unsqueeze(1)).squeeze(1)
        out = out.index_copy(0, trunc, lp)
    return out


@torch.no_grad()
def processed_logprobs(logits: torch.Tensor, temperature: Num = 1.0, top_k: Num = 0,
                       top_p: Num = 1.0) -> torch.Tensor:
    """fp32 ``[N, V]`` processed logprobs of every token (``-inf`` outside the kept set).

    Truncated rows: bitwise the values :func:`sampled_logprobs` gathers (same elementwise ops).
    Untruncated rows: ``kernels.log_softmax(l, T)``, every column bitwise
    ``logprobs_from_logits`` of that token on each device (CPU: torch's log_softmax; CUDA: the
    Triton kernel the learner's logprobs use)."""
    from . import dispatch

    T, k, p, active = _params(logits, temperature, top_k, top_p)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for t, rows in _temperature_groups(T, (~active).nonzero().squeeze(1)):
        out[rows] = dispatch.log_softmax(logits[rows], t)
    trunc = active.nonzero().squeeze(1)
    if trunc.numel():
        lp_sorted, idx, _ = _truncated(logits[trunc], T[trunc], k[trunc], p[trunc])
        out[trunc] = _unsort(lp_sorted, idx)
    return out


@torch.no_grad()
def untruncated(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows without top-k / top-p, one temperature per row (fp32 ``[N]``), without a host sync:
    (logits to draw from, ``[N, V]``; processed logprobs, ``[N, V]``). Bitwise
    :func:`masked_logits` and :func:`processed_logprobs` of these rows (so also
    :func:`sampled_logprobs` of any column); only where ``dispatch.row_temperature_supported``."""
    T = temperature.to(torch.float32)
    return logits.to(torch.float32) / T.unsqueeze(1), untruncated_logprobs(logits, T)


@torch.no_grad()
def untruncated_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The processed logprobs half of :func:`untruncated` alone (for a caller that draws from the
    raw logits itself): ``[N, V]`` fp32, bitwise :func:`processed_logprobs` of these rows."""
    from . import dispatch

    if not dispatch.row_temperature_supported(logits):
        raise ValueError("untruncated: per-row temperatures need the Triton path (see dispatch.row_temperature_supported)")
    return dispatch.log_softmax(logits, temperature.to(torch.float32))


@torch.no_grad()
def masked_logits(logits: torch.Tensor, temperature: Num = 1.0, top_k: Num = 0, top_p: Num = 1.0) -> torch.Tensor:
    """fp32 ``[N, V]`` logits to draw from: ``l / T`` on the kept set, ``-inf`` elsewhere.
    ``softmax`` of a row is the distribution whose log is :func:`processed_logprobs` (the same
    kept set; values equal up to rounding), so a draw can only land on a kept token."""
    T, k, p, active = _params(logits, temperature, top_k, top_p)
    out = logits.to(torch.float32) / T.unsqueeze(1)
    trunc = active.nonzero().squeeze(1)
    if trunc.numel():
        lp_sorted, idx, x = _truncated(logits[trunc], T[trunc], k[trunc], p[trunc])
        kept = _unsort(lp_sorted, idx) > float("-inf")
        out[trunc] = torch.where(kept, x, torch.full_like(x, float("-inf")))
    return out

