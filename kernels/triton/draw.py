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

Launch plan (:func:`draw_pieces`, host sizes only): from ``ROWS_ALONE`` rows or under
``PIECED_VOCAB`` columns, one program per row; a smaller batch of a large vocabulary cuts each row
into ``PIECE``-column pieces raced by parallel programs, whose (best score, first column) pairs a
second launch folds in column order with the race's own rule (a later piece wins only with a
strictly larger score). A maximum and the first column reaching it do not
depend on how the columns are grouped, so every plan draws the same token.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["gumbel_draw", "gumbel_draw_with_logprob", "draw_pieces", "BLOCK", "PIECE", "ROWS_ALONE", "PIECED_VOCAB"]

BLOCK = 4096  # vocabulary columns per loop iteration (free: the race's result does not depend on it)
# Small batches race each row in pieces of PIECE columns in parallel (Qwen's 151,936-column
# vocabulary at 32 rows was one program per row looping 38 blocks: 156 us a decode step on an H100,
# vLLM's own draw 35 us); from ROWS_ALONE rows one program per row already fills the GPU.
PIECE = 8192
ROWS_ALONE = 128
# ... and only vocabularies of at least PIECED_VOCAB columns: a 32,000-column row takes ~30 us in one
# program, less than the second launch costs the host (decode at small batch is host-bound)
PIECED_VOCAB = 65536


@triton.jit
def _race(logits_ptr, temp_ptr, keys_ptr, V, stride, base_seed, eps, row, lo, hi, KEYED: tl.constexpr,
          BLOCK: tl.constexpr):
    """Row ``row``'s race over columns ``[lo, hi)``: ``(best score, its column)``, the first column
    on ties (greedy argmax where ``T < eps``); ``(-inf, 0)`` if no column scores above -inf."""
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
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = (cols < hi) & (cols < V)
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
    return best, best_i


@triton.jit
def _token_lp(out_ptr, row, tok, lp_ptr, stride_lp, token_lp_ptr, finite_ptr):
    """Store row ``row``'s token, its entry of ``lp`` and clear the finite flag if that is not finite."""
    tl.store(out_ptr + row, tok)
    v = tl.load(lp_ptr + row.to(tl.int64) * stride_lp + tok)
    tl.store(token_lp_ptr + row, v)
    tl.store(finite_ptr, 0, mask=~(tl.abs(v) < float("inf")))  # NaN or +-inf


@triton.jit(do_not_specialize=["V", "stride", "base_seed"])
def _draw_kernel(logits_ptr, temp_ptr, keys_ptr, out_ptr, V, stride, base_seed, eps,
                 KEYED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    _, tok = _race(logits_ptr, temp_ptr, keys_ptr, V, stride, base_seed, eps, row, 0, V, KEYED, BLOCK)
    tl.store(out_ptr + row, tok)


@triton.jit(do_not_specialize=["V", "stride", "base_seed", "stride_lp"])
def _draw_lp_kernel(logits_ptr, temp_ptr, keys_ptr, out_ptr, V, stride, base_seed, eps, lp_ptr, stride_lp,
                    token_lp_ptr, finite_ptr, KEYED: tl.constexpr, BLOCK: tl.constexpr):
    """_draw_kernel, then the drawn token's entry of ``lp`` and the finite flag (any row may clear it)."""
    row = tl.program_id(0)
    _, tok = _race(logits_ptr, temp_ptr, keys_ptr, V, stride, base_seed, eps, row, 0, V, KEYED, BLOCK)
    _token_lp(out_ptr, row, tok, lp_ptr, stride_lp, token_lp_ptr, finite_ptr)


@triton.jit(do_not_specialize=["V", "stride", "base_seed"])
def _piece_race_kernel(logits_ptr, temp_ptr, keys_ptr, best_ptr, idx_ptr, V, stride, base_seed, eps, n_pieces,
                       KEYED: tl.constexpr, BLOCK: tl.constexpr, PIECE: tl.constexpr):
    """Program (row, p): the race over the row's p-th ``PIECE`` columns, into ``best / idx[row, p]``."""
    row = tl.program_id(0)
    p = tl.program_id(1)
    lo = p * PIECE
    best, i = _race(logits_ptr, temp_ptr, keys_ptr, V, stride, base_seed, eps, row, lo, lo + PIECE, KEYED, BLOCK)
    tl.store(best_ptr + row * n_pieces + p, best)
    tl.store(idx_ptr + row * n_pieces + p, i)


@triton.jit
def _piece_winner(best_ptr, idx_ptr, row, n_pieces):
    """The pieces' results folded in column order with the race's own rule (a later piece wins only
    with a strictly larger score): the one-program race's token."""
    best = tl.load(best_ptr + row * n_pieces)
    tok = tl.load(idx_ptr + row * n_pieces)
    for p in range(1, n_pieces):
        m = tl.load(best_ptr + row * n_pieces + p)
        i = tl.load(idx_ptr + row * n_pieces + p)
        take = m > best
        tok = tl.where(take, i, tok)
        best = tl.where(take, m, best)
    return tok


@triton.jit(do_not_specialize=["n_pieces"])
def _piece_fold_kernel(best_ptr, idx_ptr, out_ptr, n_pieces):
    row = tl.program_id(0)
    tl.store(out_ptr + row, _piece_winner(best_ptr, idx_ptr, row, n_pieces))


@triton.jit(do_not_specialize=["n_pieces", "stride_lp"])
def _piece_fold_lp_kernel(best_ptr, idx_ptr, out_ptr, n_pieces, lp_ptr, stride_lp, token_lp_ptr, finite_ptr):
    row = tl.program_id(0)
    _token_lp(out_ptr, row, _piece_winner(best_ptr, idx_ptr, row, n_pieces), lp_ptr, stride_lp, token_lp_ptr,
              finite_ptr)


def draw_pieces(N: int, V: int) -> int:
    """Vocabulary pieces per row: one program per row when the batch fills the GPU or the vocabulary
    is under ``PIECED_VOCAB``, else rows cut into ``PIECE``-column pieces raced in parallel and
    folded in order. From
    host sizes only; the token does not depend on it (a race's maximum and its first column are the
    same whichever way the columns are grouped)."""
    if N >= ROWS_ALONE or V < PIECED_VOCAB:
        return 1
    return triton.cdiv(V, PIECE)


def _launch(logits, temp, keys, out, base_seed, eps, lp_args=None, pieces=None):
    N, V = logits.shape
    keyed = keys is not None
    kp = out if keys is None else keys  # keys unread if None
    seed = int(base_seed) & ((1 << 62) - 1)
    P = draw_pieces(N, V) if pieces is None else int(pieces)
    if P <= 1:
        block = min(BLOCK, triton.next_power_of_2(V))
        warps = 8 if V >= 8192 else 4
        if lp_args is None:
            _draw_kernel[(N,)](logits, temp, kp, out, V, logits.stride(0), seed, float(eps), KEYED=keyed,
                               BLOCK=block, num_warps=warps)
        else:
            lp, token_lp, finite = lp_args
            _draw_lp_kernel[(N,)](logits, temp, kp, out, V, logits.stride(0), seed, float(eps), lp, lp.stride(0),
                                  token_lp, finite, KEYED=keyed, BLOCK=block, num_warps=warps)
        return
    piece = triton.cdiv(triton.cdiv(V, P), BLOCK) * BLOCK  # whole BLOCKs; the last piece may be short
    P = triton.cdiv(V, piece)
    best = torch.empty(N, P, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, P, dtype=torch.int64, device=logits.device)
    _piece_race_kernel[(N, P)](logits, temp, kp, best, idx, V, logits.stride(0), seed, float(eps), P, KEYED=keyed,
                               BLOCK=BLOCK, PIECE=piece, num_warps=8)
    if lp_args is None:
        _piece_fold_kernel[(N,)](best, idx, out, P, num_warps=1)
    else:
        lp, token_lp, finite = lp_args
        _piece_fold_lp_kernel[(N,)](best, idx, out, P, lp, lp.stride(0), token_lp, finite, num_warps=1)


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
                base_seed: int = 0, eps: float = 1e-5, *, pieces: Optional[int] = None) -> torch.Tensor:
    """Token ids ``[N]`` (int64) drawn from ``softmax(logits / T)`` row by row (greedy where
    ``T < eps``); ``keys``: int64 ``[N, 2]`` (seed, counter) per row, or None for ``(base_seed, row)``.
    ``pieces``: vocabulary pieces per row (default :func:`draw_pieces`; the tokens are the same for any)."""
    temp, keys = _check(logits, temperature, keys, "gumbel_draw")
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        _launch(logits, temp, keys, out, base_seed, eps, pieces=pieces)
    return out


def gumbel_draw_with_logprob(logits: torch.Tensor, temperature: torch.Tensor, lp: torch.Tensor,
                             keys: Optional[torch.Tensor] = None, base_seed: int = 0, eps: float = 1e-5, *,
                             pieces: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        _launch(logits, temp, keys, out, base_seed, eps, (lp, token_lp, finite), pieces=pieces)
    return out, token_lp, finite
