"""Batch-invariant token log-probabilities on the GPU (Triton).

    z  = logits.float() / temperature                       (IEEE div_rn; T=1 is exact)
    lp = (z[target] - max(z)) - log(sum(exp(z - max(z))))   (fp32)

Fixed order, independent of the number of rows: the vocabulary is cut into pieces of ``PIECE``
columns (a constant, so the cut depends on V only). Program (row, piece) computes the piece's exact
max ``m_p`` and ``s_p = sum(exp(z - m_p))`` (a BLOCK-wide fp32 vector accumulated chunk by chunk
in ascending column order, then one tree reduction); then the pieces of a row are merged in piece
order, ``M = max_p m_p``, ``S = ((0 + s_0 e^{m_0-M}) + s_1 e^{m_1-M}) + ...``, by one helper
(``_row_max_sum``) wherever a value is written, and the value is ``(z - M) - log S``. exp/log are
libdevice's (accurate, deterministic). Not bitwise equal to torch's log_softmax (different order);
agreement with it is ~1e-6 relative.

Launches: :func:`logprobs_from_logits` 2 (piece stats; merge + the target's value);
:func:`log_softmax` 2 (piece stats; every (row, column block) program merges its row's piece stats
itself and writes its columns). Its element ``[r, t]`` is bitwise ``logprobs_from_logits`` of
target t: the same piece stats, the same merge, the same final expression. With
``kernels.settings.fused_sampler()`` off, :func:`log_softmax` runs the three-launch plan of the
same numbers (a kernel writes each row's ``(M, log S)``, the output kernel reads it): kept so
benchmarks and the GPU tests can set the two plans side by side.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

import os

from .. import settings

_USE_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"  # the CPU interpreter has no libdevice
if _USE_LIBDEVICE:
    from triton.language.extra import libdevice
_LIBDEVICE = tl.constexpr(_USE_LIBDEVICE)


@triton.jit
def _exp(x):
    if _LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x):
    if _LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


__all__ = ["logprobs_from_logits", "log_softmax", "token_logprobs", "PIECE", "BLOCK"]

PIECE = 16384  # vocabulary columns per program (fixed: the split depends on V only)
BLOCK = 2048  # columns per chunk inside a piece (a multiple of it divides PIECE)


@triton.jit
def _row_temperature(temperature, temp_ptr, row, ROW_T: tl.constexpr):
    """The row's temperature: the scalar argument, or element ``row`` of an fp32 tensor (the same
    fp32 value gives the same ``div_rn`` bits either way)."""
    if ROW_T:
        return tl.load(temp_ptr + row)
    else:
        return temperature


@triton.jit
def _piece_stats_kernel(logits_ptr, stats_ptr, V, stride_row, n_pieces, temperature, temp_ptr,
                        PIECE: tl.constexpr, BLOCK: tl.constexpr, ROW_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    temperature = _row_temperature(temperature, temp_ptr, row, ROW_T)
    base = logits_ptr + row * stride_row
    start = p * PIECE
    offs = tl.arange(0, BLOCK)
    m_vec = tl.full((BLOCK,), float("-inf"), tl.float32)
    for c in range(start, start + PIECE, BLOCK):
        cols = c + offs
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        z = tl.math.div_rn(z, temperature)
        m_vec = tl.maximum(m_vec, z)
    m = tl.max(m_vec, axis=0)
    # A piece whose columns are all -inf (masked logits, e.g. top-k over a large vocabulary) has
    # m = -inf: exp(z - m) would be exp(nan) and make the whole row nan. Subtracting 0 instead gives
    # s = 0 (and the merge's s_p * exp(m_p - M) is then 0); any piece with a finite max keeps m, so
    # its bits are unchanged.
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    s_vec = tl.zeros((BLOCK,), tl.float32)
    for c in range(start, start + PIECE, BLOCK):
        cols = c + offs
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        z = tl.math.div_rn(z, temperature)
        e = _exp(z - m_sub)
        s_vec = s_vec + tl.where(cols < V, e, 0.0)
    s = tl.sum(s_vec, axis=0)
    out = stats_ptr + (row * n_pieces + p) * 2
    tl.store(out, m)
    tl.store(out + 1, s)


@triton.jit
def _row_max_sum(stats_ptr, row, n_pieces, NP_BLOCK: tl.constexpr):
    """A row's (M, S) from its piece stats: M the max of the piece maxima, S the piece sums
    rescaled to M and added in piece order from 0."""
    offs = tl.arange(0, NP_BLOCK)
    msk = offs < n_pieces
    st = stats_ptr + row * n_pieces * 2
    m_all = tl.load(st + offs * 2, mask=msk, other=float("-inf"))
    M = tl.max(m_all, axis=0)
    S = 0.0
    for p in range(0, n_pieces):
        m_p = tl.load(st + p * 2)
        s_p = tl.load(st + p * 2 + 1)
        S = S + s_p * _exp(m_p - M)
    return M, S


@triton.jit
def _merge_kernel(logits_ptr, stats_ptr, targets_ptr, out_ptr, stride_row, n_pieces, temperature, temp_ptr,
                  NP_BLOCK: tl.constexpr, ROW_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temperature = _row_temperature(temperature, temp_ptr, row, ROW_T)
    M, S = _row_max_sum(stats_ptr, row, n_pieces, NP_BLOCK)
    t = tl.load(targets_ptr + row)
    zt = tl.load(logits_ptr + row * stride_row + t).to(tl.float32)
    zt = tl.math.div_rn(zt, temperature)
    tl.store(out_ptr + row, (zt - M) - _log(S))


Temperature = Union[float, torch.Tensor]


def _temperature_args(temperature: Temperature, rows: int, device) -> tuple[float, torch.Tensor, bool]:
    """(scalar, per-row fp32 tensor, per-row?) kernel arguments. A tensor gives one temperature per
    row (``[rows]``, on the logits' device; no host sync: the caller guarantees ``> 0``)."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
        if t.numel() != rows:
            raise ValueError(f"per-row temperature of {t.numel()} values for {rows} rows")
        return 1.0, t, True
    if not temperature > 0:
        raise ValueError("temperature must be > 0")
    return float(temperature), _dummy(device), False


def _dummy(device) -> torch.Tensor:
    return torch.empty(1, device=device, dtype=torch.float32)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: Temperature = 1.0) -> torch.Tensor:
    """fp32 log-prob of ``targets[...]`` under ``softmax(logits.float() / temperature)``;
    ``temperature`` a float or an fp32 tensor with one value per row (bitwise the float path for
    rows of that value)."""
    t = targets.reshape(-1).to(torch.int64).contiguous()
    l2, stats, (temp, temp_rows, row_t) = _piece_stats(logits, temperature)
    out = torch.empty(l2.shape[0], device=logits.device, dtype=torch.float32)
    if stats is None:
        return out.reshape(targets.shape)
    n_pieces = stats.shape[1]
    _merge_kernel[(l2.shape[0],)](l2, stats, t, out, l2.stride(0), n_pieces, temp, temp_rows,
                                  NP_BLOCK=max(16, triton.next_power_of_2(n_pieces)), ROW_T=row_t, num_warps=1)
    return out.reshape(targets.shape)


def _piece_stats(logits: torch.Tensor, temperature: Temperature):
    """(rows [R, V] with a unit column stride, piece stats [R, n_pieces, 2] (None when R == 0),
    the temperature's kernel arguments)."""
    V = logits.shape[-1]
    l2 = logits.reshape(-1, V)
    if l2.stride(-1) != 1:
        l2 = l2.contiguous()
    R = l2.shape[0]
    targs = _temperature_args(temperature, R, logits.device)
    if R == 0:
        return l2, None, targs
    n_pieces = triton.cdiv(V, PIECE)
    stats = torch.empty(R, n_pieces, 2, device=logits.device, dtype=torch.float32)
    _piece_stats_kernel[(R, n_pieces)](l2, stats, V, l2.stride(0), n_pieces, targs[0], targs[1],
                                       PIECE=PIECE, BLOCK=BLOCK, ROW_T=targs[2], num_warps=8)
    return l2, stats, targs


@triton.jit
def _row_lse_kernel(stats_ptr, lse_ptr, n_pieces, NP_BLOCK: tl.constexpr):
    """(M, log S) of a row from its piece stats (the three-launch plan of :func:`log_softmax`)."""
    row = tl.program_id(0).to(tl.int64)
    M, S = _row_max_sum(stats_ptr, row, n_pieces, NP_BLOCK)
    tl.store(lse_ptr + row * 2, M)
    tl.store(lse_ptr + row * 2 + 1, _log(S))


@triton.jit
def _write_columns(logits_ptr, out_ptr, M, logS, V, stride_row, stride_out, temperature, temp_ptr, row,
                   BLOCK: tl.constexpr, ROW_T: tl.constexpr):
    """Columns ``[c*BLOCK, (c+1)*BLOCK)`` (c = program_id(1)) of row ``row``: ``(z - M) - log S``."""
    temperature = _row_temperature(temperature, temp_ptr, row, ROW_T)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = cols < V
    z = tl.load(logits_ptr + row * stride_row + cols, mask=msk, other=0.0).to(tl.float32)
    z = tl.math.div_rn(z, temperature)
    tl.store(out_ptr + row * stride_out + cols, (z - M) - logS, mask=msk)


@triton.jit
def _rows_out_kernel(logits_ptr, stats_ptr, out_ptr, V, stride_row, stride_out, n_pieces, temperature, temp_ptr,
                     BLOCK: tl.constexpr, NP_BLOCK: tl.constexpr, ROW_T: tl.constexpr):
    """The two-launch plan's second kernel: each (row, column block) program merges its row's piece
    stats itself (the same ``_row_max_sum`` and ``_log`` as _merge_kernel and _row_lse_kernel, so
    the same M and log S) and writes its columns."""
    row = tl.program_id(0).to(tl.int64)
    M, S = _row_max_sum(stats_ptr, row, n_pieces, NP_BLOCK)
    _write_columns(logits_ptr, out_ptr, M, _log(S), V, stride_row, stride_out, temperature, temp_ptr, row,
                   BLOCK, ROW_T)


@triton.jit
def _rows_out_lse_kernel(logits_ptr, lse_ptr, out_ptr, V, stride_row, stride_out, temperature, temp_ptr,
                         BLOCK: tl.constexpr, ROW_T: tl.constexpr):
    """The three-launch plan's last kernel: M and log S read from ``lse`` (_row_lse_kernel's)."""
    row = tl.program_id(0).to(tl.int64)
    M = tl.load(lse_ptr + row * 2)
    logS = tl.load(lse_ptr + row * 2 + 1)
    _write_columns(logits_ptr, out_ptr, M, logS, V, stride_row, stride_out, temperature, temp_ptr, row,
                   BLOCK, ROW_T)


def log_softmax(logits: torch.Tensor, temperature: Temperature = 1.0, *, fold: Optional[bool] = None) -> torch.Tensor:
    """fp32 ``log_softmax(logits.float() / temperature)`` of every column, ``[..., V]``: element
    ``[r, t]`` is bitwise :func:`logprobs_from_logits` of target t in row r (same piece stats, same
    merge, same final ``(z - M) - log S``). What the aligned engine's sampler reports on the GPU.

    ``fold``: two launches (True) or the three-launch plan (False) of the same bits; None follows
    ``kernels.settings.fused_sampler()``."""
    l2, stats, (temp, temp_rows, row_t) = _piece_stats(logits, temperature)
    R, V = l2.shape
    out = torch.empty(R, V, device=logits.device, dtype=torch.float32)
    if stats is None:
        return out.reshape(logits.shape)
    n_pieces = stats.shape[1]
    np_block = max(16, triton.next_power_of_2(n_pieces))
    if fold is None:
        fold = settings.fused_sampler()
    grid = (R, triton.cdiv(V, BLOCK))
    if fold:
        _rows_out_kernel[grid](l2, stats, out, V, l2.stride(0), out.stride(0), n_pieces, temp, temp_rows,
                               BLOCK=BLOCK, NP_BLOCK=np_block, ROW_T=row_t, num_warps=4)
    else:
        lse = torch.empty(R, 2, device=logits.device, dtype=torch.float32)
        _row_lse_kernel[(R,)](stats, lse, n_pieces, NP_BLOCK=np_block, num_warps=1)
        _rows_out_lse_kernel[grid](l2, lse, out, V, l2.stride(0), out.stride(0), temp, temp_rows,
                                   BLOCK=BLOCK, ROW_T=row_t, num_warps=4)
    return out.reshape(logits.shape)


def token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0, *, logits_dtype: Optional[torch.dtype] = None,
                   k_segments: Optional[int] = None) -> torch.Tensor:
    """fp32 log-probs of ``targets`` from ``hidden[..., H]`` (invariant GEMM, then the above)."""
    from .gemm import linear

    logits = linear(hidden, lm_head_weight, out_dtype=logits_dtype, k_segments=k_segments)
    return logprobs_from_logits(logits, targets, temperature)
