"""One-launch random draw for a whole sampling batch (Triton): a Gumbel-max race keyed per row.

``gumbel_draw(logits[N, V], temperature[N], keys=None | int64 [N, 2], base_seed)`` -> int64 ``[N]``:

* row r's key is ``(seed, counter)``: ``keys[r]`` when given (a seeded request: its seed and how
  many draws it has made), else ``(base_seed, r)`` (unseeded rows: one fresh seed per step, the
  row index as counter);
* the noise of column v is Philox-4x32 on the counter block ``(v, counter_lo, counter_hi, 0)``
  under the key ``seed``: a function of (seed, counter, v) only, so a row's token never depends on
  the batch it is in, its row index (keyed rows), the other rows or the vocabulary's tiling;
* ``u = (bits >> 8 + 0.5) / 2**24`` is strictly inside (0, 1), ``g = -log(-log u)`` is finite, and
  the token is ``argmax_v(logits[v] / T + g_v)`` (first index on ties): an exact sample of
  ``softmax(logits / T)``; a ``-inf`` logit never wins, so a draw stays inside a kept set;
* a row with ``T < eps`` is greedy: ``argmax_v logits[v]``, no noise (vLLM's convention).

The race is the draw only: the reported log-probabilities come from ``kernels.sampling`` /
``kernels.triton.logprobs`` (the learner's functions), whichever token the race picks. vLLM's own
``random_sample`` launches one exponential-noise kernel per seeded request per step (a host call
each); this is one launch for the batch and no per-row host work beyond the keys.

``gumbel_draw_with_logprob(logits, temperature, lp, keys, base_seed)`` is the same launch with an
epilogue for a caller that has the processed log-probs ``lp[N, V]`` already (computed earlier on the
same stream): each row's program also writes ``token_lp[r] = lp[r, token]`` (a load of that
element: bitwise ``lp.gather``) and stores 0 into a one-element int32 flag, preset to 1, when that
value is not finite; the tokens are those of :func:`gumbel_draw` (both kernels inline the same
race, ``_race``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["gumbel_draw", "gumbel_draw_with_logprob", "BLOCK"]

BLOCK = 4096  # vocabulary columns per loop iteration (free: the race's result does not depend on it)


@triton.jit
def _race(logits_ptr, temp_ptr, keys_ptr, V, stride, base_seed, eps, row, KEYED: tl.constexpr,
          BLOCK: tl.constexpr):
    """Row ``row``'s token: the keyed Gumbel race (greedy argmax where ``T < eps``)."""
    t = tl.load(temp_ptr + row)
    greedy = t < eps
    t_safe = tl.where(greedy, 1.0, t)
    if KEYED:
        seed = tl.load(keys_ptr + 2 * row)
        counter = tl.load(keys_ptr + 2 * row + 1)
    else:
        seed = base_seed.to(tl.int64)
        counter = row.to(tl.int64)
    c1 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c2 = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
    base = logits_ptr + row.to(tl.int64) * stride
    best = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)  # scalars of the loop's types
    best_i = tl.sum(tl.zeros((BLOCK,), tl.int64), axis=0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        zero = (cols * 0).to(tl.uint32)
        r0, _, _, _ = tl.philox(seed, cols.to(tl.uint32), zero + c1, zero + c2, zero)
        u = ((r0 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = -tl.log(-tl.log(u))
        s = tl.where(greedy, x, x / t_safe + g)
        s = tl.where(ok, s, float("-inf"))
        m = tl.max(s, axis=0)
        i = tl.argmax(s, axis=0, tie_break_left=True).to(tl.int64) + start
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    return best_i


@triton.jit(do_not_specialize=["V", "stride", "base_seed"])
def _draw_kernel(logits_ptr, temp_ptr, keys_ptr, out_ptr, V, stride, base_seed, eps,
                 KEYED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, _race(logits_ptr, temp_ptr, keys_ptr, V, stride, base_seed, eps, row, KEYED, BLOCK))


@triton.jit(do_not_specialize=["V", "stride", "base_seed", "stride_lp"])
def _draw_lp_kernel(logits_ptr, temp_ptr, keys_ptr, out_ptr, V, stride, base_seed, eps, lp_ptr, stride_lp,
                    token_lp_ptr, finite_ptr, KEYED: tl.constexpr, BLOCK: tl.constexpr):
    """_draw_kernel, then the drawn token's entry of ``lp`` and the finite flag (any row may clear it)."""
    row = tl.program_id(0)
    tok = _race(logits_ptr, temp_ptr, keys_ptr, V, stride, base_seed, eps, row, KEYED, BLOCK)
    tl.store(out_ptr + row, tok)
    v = tl.load(lp_ptr + row.to(tl.int64) * stride_lp + tok)
    tl.store(token_lp_ptr + row, v)
    tl.store(finite_ptr, 0, mask=~(tl.abs(v) < float("inf")))  # NaN or +-inf


def _check(logits: torch.Tensor, temperature: torch.Tensor, keys: Optional[torch.Tensor], name: str):
    """(temperatures fp32 [N] on the logits' device, keys or None) after the shape checks."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"{name}: logits must be [N, V] with a contiguous last dim")
    N = logits.shape[0]
    temp = temperature.to(device=logits.device, dtype=torch.float32).contiguous()
    if temp.numel() != N:
        raise ValueError(f"{name}: one temperature per row")
    if keys is not None:
        if keys.shape != (N, 2) or keys.dtype != torch.int64:
            raise ValueError(f"{name}: keys must be int64 [N, 2] (seed, counter)")
        keys = keys.contiguous()
    return temp, keys


def gumbel_draw(logits: torch.Tensor, temperature: torch.Tensor, keys: Optional[torch.Tensor] = None,
                base_seed: int = 0, eps: float = 1e-5) -> torch.Tensor:
    """Token ids ``[N]`` (int64) drawn from ``softmax(logits / T)`` row by row (greedy where
    ``T < eps``); ``keys``: int64 ``[N, 2]`` (seed, counter) per row, or None for ``(base_seed, row)``."""
    temp, keys = _check(logits, temperature, keys, "gumbel_draw")
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    N, V = logits.shape
    if N:
        _draw_kernel[(N,)](logits, temp, out if keys is None else keys, out, V, logits.stride(0),  # keys unread if None
                           int(base_seed) & ((1 << 62) - 1), float(eps), KEYED=keys is not None,
                           BLOCK=min(BLOCK, triton.next_power_of_2(V)), num_warps=8 if V >= 8192 else 4)
    return out


def gumbel_draw_with_logprob(logits: torch.Tensor, temperature: torch.Tensor, lp: torch.Tensor,
                             keys: Optional[torch.Tensor] = None, base_seed: int = 0,
                             eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gumbel_draw` and, in the same launch, the drawn tokens' entries of ``lp``:
    ``(tokens [N] int64, token_lp [N] = lp[r, tokens[r]] (lp's dtype), finite [1] int32)``, where
    ``finite`` is 1 iff every ``token_lp`` is finite. ``lp``: ``[N, V]`` with a contiguous last dim,
    on the logits' device (typically the processed log-probs of the same rows)."""
    temp, keys = _check(logits, temperature, keys, "gumbel_draw_with_logprob")
    N, V = logits.shape
    if lp.shape != logits.shape or lp.stride(-1) != 1 or lp.device != logits.device:
        raise ValueError("gumbel_draw_with_logprob: lp must be [N, V] like the logits, with a contiguous last dim")
    out = torch.empty(N, dtype=torch.int64, device=logits.device)
    token_lp = torch.empty(N, dtype=lp.dtype, device=logits.device)
    finite = torch.ones(1, dtype=torch.int32, device=logits.device)
    if N:
        _draw_lp_kernel[(N,)](logits, temp, out if keys is None else keys, out, V, logits.stride(0),
                              int(base_seed) & ((1 << 62) - 1), float(eps), lp, lp.stride(0), token_lp, finite,
                              KEYED=keys is not None, BLOCK=min(BLOCK, triton.next_power_of_2(V)),
                              num_warps=8 if V >= 8192 else 4)
    return out, token_lp, finite
