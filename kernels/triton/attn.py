"""Batch-invariant causal attention on the GPU (Triton): one fixed KV order for every query.

``attention(q[T, Hq, D], k[S, Hkv, D], v[S, Hkv, Dv], q_positions[T], scale)`` -> ``[T, Hq, Dv]``
(one sequence) and ``attention_batched`` (many sequences over a ``[B, S, Hkv, D]`` cache). Query t
attends to keys 0..q_positions[t] (GQA: query head h reads KV head h // (Hq // Hkv)). Same contract
as the CPU reference (kernels/attn.py).

Order that decides the bits, the same in prefill, chunked prefill and decode:

* the keys are cut into **fixed chunks of ``KV_CHUNK = 256`` positions** (chunk c = keys
  ``[256c, 256c + 256)``), each chunk into KV tiles of ``BLOCK_N = 64`` keys;
* within a chunk, an online softmax from a fresh state over its tiles in order: scores are one fp32
  ``tl.dot`` over D, then ``* scale``; masked scores ``-inf`` -> ``p = 0``;
  ``m_new = max(m, rowmax(s))``, ``alpha = exp(m - m_new)``, ``p = exp(s - m_new)``,
  ``l = l * alpha + rowsum(p)``, ``acc = acc * alpha + dot(p.to(v.dtype), v)`` (P rounded to V's
  dtype for the P@V product, as in FlashAttention; both sides run this kernel);
* the chunk states are merged **in chunk order** from ``(M, L, ACC) = (-inf, 0, 0)``:
  ``M' = max(M, m_c)``, ``a = exp(M - M')``, ``b = exp(m_c - M')``, ``L = L*a + l_c*b``,
  ``ACC = ACC*a + acc_c*b``; ``out = ACC / L`` (IEEE division), rounded once.

Tiles and chunks past a query's position are fully masked and are exact no-ops, so neither the
number of tiles a program runs nor keys / zero-padded slots past the position change a query's bits.
Prefill programs run the chunks one after the other inside one program; decode (``max_q_len == 1``)
runs **one program per (chunk, sequence, KV head)** -- split-KV with split points fixed in key
positions -- and a second kernel merges the fp32 chunk states in chunk order with the same
operations: bitwise the same result (tested), with enough programs to fill the GPU at batch 1.
The paged decode (the engine's) does the same with a fixed number of programs per (sequence, KV
head), each computing every ``splits``-th chunk (``paged_attention``).

Fixed for every call (part of the numerics): ``BLOCK_M = 64`` rows per program (the row sums'
order follows the MMA layout, which changes with BLOCK_M), ``BLOCK_N``, ``KV_CHUNK``, num_warps 4,
and FMA contraction off in all three kernels (each ``x*y + z`` is a multiply then an add, so the
in-program merge and the merge kernel cannot be contracted differently).
Every K/V row a program reads up to its last tile must be finite (as on CPU).
Not bitwise equal to the CPU reference (bf16 P, different trees).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import settings
from . import gpu_info

__all__ = ["attention", "attention_batched", "paged_attention", "paged_kv_write", "decode_splits", "decode_tile",
           "BLOCK_N", "BLOCK_M", "KV_CHUNK"]

BLOCK_N = 64  # KV tile: fixed, part of the numerics contract
BLOCK_M = 64  # rows (query, head) per program: fixed too (see module docstring)
KV_CHUNK = 256  # keys per chunk: fixed split points in key positions
NUM_WARPS = 4


@triton.jit
def _chunk_state(q, kb, vb, pos, lo, hi, S, sk_s, sv_s, scale, rd, rdv,
                 D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_N: tl.constexpr, bt_ptr=None, s_blk=0, PAGE: tl.constexpr = 0):
    """Online softmax from a fresh state over keys [lo, hi) in BLOCK_N tiles (lo tile-aligned).

    ``PAGE == 0``: key j is row ``j`` of ``kb`` / ``vb`` (stride ``sk_s`` / ``sv_s``). ``PAGE > 0``:
    a paged cache, key j in slot ``j % PAGE`` of block ``bt_ptr[j // PAGE]`` (block stride
    ``s_blk``). Only the addresses differ: the tiles, masks and arithmetic are the same, so a paged
    and a contiguous cache holding the same keys give the same bits."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        kv_ok = rn < S
        if PAGE > 0:
            blk = tl.load(bt_ptr + rn // PAGE, mask=kv_ok, other=0).to(tl.int64)
            k_off = blk * s_blk + (rn % PAGE) * sk_s
            v_off = blk * s_blk + (rn % PAGE) * sv_s
        else:
            k_off = rn * sk_s
            v_off = rn * sv_s
        k = tl.load(kb + k_off[:, None] + rd[None, :], mask=kv_ok[:, None] & (rd[None, :] < D), other=0.0)
        s = tl.dot(q, k.T) * scale
        valid = (rn[None, :] <= pos[:, None]) & kv_ok[None, :]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vb + v_off[:, None] + rdv[None, :], mask=kv_ok[:, None] & (rdv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge(M, L, ACC, m_c, l_c, acc_c):
    """Fold chunk state (m_c, l_c, acc_c) into (M, L, ACC); elementwise only."""
    M_new = tl.maximum(M, m_c)
    M_safe = tl.where(M_new == float("-inf"), 0.0, M_new)
    a = tl.exp(M - M_safe)
    b = tl.exp(m_c - M_safe)
    L = L * a + l_c * b
    ACC = ACC * a[:, None] + acc_c * b[:, None]
    return M_new, L, ACC


@triton.jit
def _rows_chunked(q, kb, vb, pos, hi, S, sk_s, sv_s, scale, rd, rdv,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, KV_CHUNK: tl.constexpr, bt_ptr=None, s_blk=0, PAGE: tl.constexpr = 0):
    M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    L = tl.zeros((BLOCK_M,), tl.float32)
    ACC = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for lo in range(0, hi, KV_CHUNK):
        m_c, l_c, acc_c = _chunk_state(q, kb, vb, pos, lo, tl.minimum(lo + KV_CHUNK, hi), S, sk_s, sv_s, scale,
                                       rd, rdv, D, DV, BLOCK_M, BLOCK_DV, BLOCK_N, bt_ptr, s_blk, PAGE)
        M, L, ACC = _merge(M, L, ACC, m_c, l_c, acc_c)
    return L, ACC


@triton.jit
def _finish(L, ACC):
    l_safe = tl.where(L == 0.0, 1.0, L)
    return tl.math.div_rn(ACC, l_safe[:, None])


@triton.jit(do_not_specialize=["T", "S"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, T, S,
                 sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h, scale,
                 GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_CHUNK: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = rm < T
    pos = tl.load(pos_ptr + rm, mask=mm, other=-1)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + rm[:, None] * sq_t + h * sq_h + rd[None, :],
                mask=mm[:, None] & (rd[None, :] < D), other=0.0)
    hi = tl.minimum(tl.max(pos, axis=0) + 1, S)
    L, ACC = _rows_chunked(q, k_ptr + kh * sk_h, v_ptr + kh * sv_h, pos, hi, S, sk_s, sv_s, scale, rd, rdv,
                           D, DV, BLOCK_M, BLOCK_DV, BLOCK_N, KV_CHUNK)
    out = _finish(L, ACC)
    tl.store(o_ptr + rm[:, None] * so_t + h * so_h + rdv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mm[:, None] & (rdv[None, :] < DV))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_positions: torch.Tensor,
              scale: float, *, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Causal attention of one sequence's queries over its KV (see module docstring); no autograd."""
    T, Hq, D = q.shape
    S, Hkv, Dk = k_cache.shape
    Dv = v_cache.shape[-1]
    if Dk != D or v_cache.shape[:2] != (S, Hkv) or Hq % Hkv:
        raise ValueError("attention: shape mismatch")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attention: last dims must be contiguous")
    if k_cache.dtype != q.dtype:
        raise ValueError("attention: q and k must have the same dtype")
    out = torch.empty(T, Hq, Dv, device=q.device, dtype=out_dtype or q.dtype)
    if T == 0:
        return out
    pos = q_positions.to(device=q.device, dtype=torch.int32).contiguous()
    grid = (triton.cdiv(T, BLOCK_M), Hq)
    _attn_kernel[grid](
        q, k_cache, v_cache, pos, out, T, S, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        float(scale), GROUP=Hq // Hkv, D=D, DV=Dv, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DV=triton.next_power_of_2(Dv), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, KV_CHUNK=KV_CHUNK,
        num_warps=NUM_WARPS, num_stages=2, enable_fp_fusion=False)
    return out


# ------------------------------------------------------------------------------------------------
# batched / GQA-packed variant (decode batches, prefill with KV reuse across the query-head group)


@triton.jit
def _batched_rows(q_ptr, pos_ptr, cu_ptr, pid_m, b, kh, sq_t, sq_h,
                  GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    q0 = tl.load(cu_ptr + b)
    nq = tl.load(cu_ptr + b + 1) - q0
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = (query t of this sequence, head g of the group)
    mm = r < nq * GROUP
    t = r // GROUP
    h = kh * GROUP + (r % GROUP)
    qrow = (q0 + t).to(tl.int64)
    pos = tl.load(pos_ptr + qrow, mask=mm, other=-1)
    rd = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + qrow[:, None] * sq_t + h[:, None] * sq_h + rd[None, :],
                mask=mm[:, None] & (rd[None, :] < D), other=0.0)
    return q, pos, mm, qrow, h, rd


@triton.jit(do_not_specialize=["S"])
def _attn_batched_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cu_ptr, o_ptr, S,
                         sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, scale,
                         GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_CHUNK: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    kh = tl.program_id(2)
    q, pos, mm, qrow, h, rd = _batched_rows(q_ptr, pos_ptr, cu_ptr, pid_m, b, kh, sq_t, sq_h, GROUP, D, BLOCK_D,
                                            BLOCK_M)
    rdv = tl.arange(0, BLOCK_DV)
    hi = tl.minimum(tl.max(pos, axis=0) + 1, S)
    kb = k_ptr + b.to(tl.int64) * sk_b + kh * sk_h
    vb = v_ptr + b.to(tl.int64) * sv_b + kh * sv_h
    L, ACC = _rows_chunked(q, kb, vb, pos, hi, S, sk_s, sv_s, scale, rd, rdv, D, DV, BLOCK_M, BLOCK_DV, BLOCK_N,
                           KV_CHUNK)
    out = _finish(L, ACC)
    tl.store(o_ptr + qrow[:, None] * so_t + h[:, None] * so_h + rdv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mm[:, None] & (rdv[None, :] < DV))


@triton.jit(do_not_specialize=["S"])
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cu_ptr, wm_ptr, wl_ptr, wacc_ptr, S, NC,
                       sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, scale,
                       GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_CHUNK: tl.constexpr):
    """Decode: one program per (chunk, sequence, KV head); rows = the group's heads of one query.
    Writes the chunk's raw state (m, l, acc) for every valid row: ws[(q, h), chunk]."""
    c = tl.program_id(0)
    b = tl.program_id(1)
    kh = tl.program_id(2)
    q, pos, mm, qrow, h, rd = _batched_rows(q_ptr, pos_ptr, cu_ptr, 0, b, kh, sq_t, sq_h, GROUP, D, BLOCK_D,
                                            BLOCK_M)
    rdv = tl.arange(0, BLOCK_DV)
    hi = tl.minimum(tl.max(pos, axis=0) + 1, S)
    lo = c * KV_CHUNK
    if lo < hi:
        kb = k_ptr + b.to(tl.int64) * sk_b + kh * sk_h
        vb = v_ptr + b.to(tl.int64) * sv_b + kh * sv_h
        m_c, l_c, acc_c = _chunk_state(q, kb, vb, pos, lo, tl.minimum(lo + KV_CHUNK, hi), S, sk_s, sv_s, scale,
                                       rd, rdv, D, DV, BLOCK_M, BLOCK_DV, BLOCK_N)
        row = qrow * (GROUP * tl.num_programs(2)) + h  # flat (query, head) index
        tl.store(wm_ptr + row * NC + c, m_c, mask=mm)
        tl.store(wl_ptr + row * NC + c, l_c, mask=mm)
        tl.store(wacc_ptr + (row * NC + c)[:, None] * DV + rdv[None, :], acc_c, mask=mm[:, None] & (rdv[None, :] < DV))


@triton.jit
def _fold_chunks(wm_ptr, wl_ptr, wacc_ptr, row, NC, nc, rdv, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Row ``row``'s first ``nc`` chunk states (workspace stride ``NC``) folded in chunk order from
    (-inf, 0, 0) with ``_merge`` (the operations of _rows_chunked), then ``_finish``: ``[1, BLOCK_DV]``."""
    mv = rdv < DV
    M = tl.full((1,), float("-inf"), tl.float32)
    L = tl.zeros((1,), tl.float32)
    ACC = tl.zeros((1, BLOCK_DV), tl.float32)
    for c in range(0, nc):
        m_c = tl.load(wm_ptr + row * NC + c + tl.zeros((1,), tl.int32))
        l_c = tl.load(wl_ptr + row * NC + c + tl.zeros((1,), tl.int32))
        acc_c = tl.load(wacc_ptr + (row * NC + c) * DV + rdv[None, :], mask=mv[None, :], other=0.0)
        M, L, ACC = _merge(M, L, ACC, m_c, l_c, acc_c)
    return _finish(L, ACC)


@triton.jit
def _attn_merge_kernel(wm_ptr, wl_ptr, wacc_ptr, pos_ptr, o_ptr, Hq, NC, so_t, so_h,
                       DV: tl.constexpr, BLOCK_DV: tl.constexpr, KV_CHUNK: tl.constexpr):
    """out[(q, h)] = merge of its chunk states in chunk order (same operations as _rows_chunked)."""
    row = tl.program_id(0).to(tl.int64)
    t = row // Hq
    h = row % Hq
    p = tl.load(pos_ptr + t)
    rdv = tl.arange(0, BLOCK_DV)
    out = _fold_chunks(wm_ptr, wl_ptr, wacc_ptr, row, NC, p // KV_CHUNK + 1, rdv, DV, BLOCK_DV)
    tl.store(o_ptr + t * so_t + h * so_h + rdv[None, :], out.to(o_ptr.dtype.element_ty), mask=rdv[None, :] < DV)


def attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      q_positions: torch.Tensor, scale: float, *, max_q_len: int,
                      out_dtype: Optional[torch.dtype] = None, split_kv: Optional[bool] = None) -> torch.Tensor:
    """Many sequences in one launch, for decode batches and (chunked) prefill.

    ``q[Tq, Hq, D]`` packed: sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (at most
    ``max_q_len``, a host int); its keys/values are ``k_cache[b, :, Hkv, D]`` / ``v_cache[b, :, Hkv, Dv]``
    (key j at position j; every slot up to the last tile read must be finite, e.g. a zero-initialised
    cache). Query row t attends to keys ``0..q_positions[t]``. Returns ``[Tq, Hq, Dv]``.

    Prefill: one program per (64-row tile of (query, head-in-group) pairs, sequence, KV head), the
    KV tile read once for the whole GQA group. Decode (``max_q_len == 1``; ``split_kv`` default):
    split-KV at the fixed 256-key chunk boundaries plus an ordered merge. Every row is bitwise what
    :func:`attention` gives for that query alone (tested), whatever the batch, the other sequences,
    the chunking, decode vs prefill, or ``split_kv``."""
    Tq, Hq, D = q.shape
    B, S, Hkv, Dk = k_cache.shape
    Dv = v_cache.shape[-1]
    if Dk != D or v_cache.shape[:3] != (B, S, Hkv) or Hq % Hkv:
        raise ValueError("attention_batched: shape mismatch")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attention_batched: last dims must be contiguous")
    if cu_seqlens_q.numel() != B + 1:
        raise ValueError("attention_batched: cu_seqlens_q must have B + 1 entries")
    out = torch.empty(Tq, Hq, Dv, device=q.device, dtype=out_dtype or q.dtype)
    if Tq == 0 or B == 0:
        return out
    G = Hq // Hkv
    pos = q_positions.to(device=q.device, dtype=torch.int32).contiguous()
    cu = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    common = dict(GROUP=G, D=D, DV=Dv, BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(Dv),
                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, KV_CHUNK=KV_CHUNK, num_warps=NUM_WARPS, num_stages=2, enable_fp_fusion=False)
    split = (max_q_len == 1 and G <= BLOCK_M) if split_kv is None else bool(split_kv)
    if split:
        if max_q_len != 1 or G > BLOCK_M:
            raise ValueError("attention_batched: split_kv needs one query per sequence and Hq/Hkv <= 64")
        nc = triton.cdiv(S, KV_CHUNK)
        wm = torch.empty(Tq * Hq, nc, device=q.device, dtype=torch.float32)
        wl = torch.empty_like(wm)
        wacc = torch.empty(Tq * Hq, nc, Dv, device=q.device, dtype=torch.float32)
        _attn_split_kernel[(nc, B, Hkv)](
            q, k_cache, v_cache, pos, cu, wm, wl, wacc, S, nc, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), float(scale), **common)
        _attn_merge_kernel[(Tq * Hq,)](wm, wl, wacc, pos, out, Hq, nc, out.stride(0), out.stride(1), DV=Dv,
                                       BLOCK_DV=triton.next_power_of_2(Dv), KV_CHUNK=KV_CHUNK, num_warps=1,
                                       enable_fp_fusion=False)
        return out
    rows_max = int(max_q_len) * G
    grid = (triton.cdiv(rows_max, BLOCK_M), B, Hkv)
    _attn_batched_kernel[grid](
        q, k_cache, v_cache, pos, cu, out, S, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), out.stride(0), out.stride(1), float(scale), **common)
    return out


# ------------------------------------------------------------------------------------------------
# paged KV cache (the aligned vLLM engine on CUDA): same tiles and order, keys found through a block
# table; no host synchronisation, grid fixed by host-side sizes only (CUDA-graph capturable)


@triton.jit
def _paged_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, seqlen_ptr, o_ptr,
                  sq_t, sq_h, s_blk, s_kvh, s_slot, s_bt, so_t, so_h, scale,
                  GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_CHUNK: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    kh = tl.program_id(2)
    q0 = tl.load(cu_ptr + b)
    nq = tl.load(cu_ptr + b + 1) - q0
    L_b = tl.load(seqlen_ptr + b)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = (query t of this sequence, head g of the group)
    mm = r < nq * GROUP
    t = r // GROUP
    h = kh * GROUP + (r % GROUP)
    qrow = (q0 + t).to(tl.int64)
    pos = tl.where(mm, L_b - nq + t, -1)  # a query's position: its sequence's length - queries + index
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + qrow[:, None] * sq_t + h[:, None] * sq_h + rd[None, :],
                mask=mm[:, None] & (rd[None, :] < D), other=0.0)
    hi = tl.minimum(tl.max(pos, axis=0) + 1, L_b)
    kb = k_ptr + kh * s_kvh
    vb = v_ptr + kh * s_kvh
    L, ACC = _rows_chunked(q, kb, vb, pos, hi, L_b, s_slot, s_slot, scale, rd, rdv, D, DV, BLOCK_M, BLOCK_DV,
                           BLOCK_N, KV_CHUNK, bt_ptr + b.to(tl.int64) * s_bt, s_blk, PAGE)
    out = _finish(L, ACC)
    tl.store(o_ptr + qrow[:, None] * so_t + h[:, None] * so_h + rdv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mm[:, None] & (rdv[None, :] < DV))


@triton.jit
def _paged_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, seqlen_ptr, wm_ptr, wl_ptr, wacc_ptr, NC, NSPLIT,
                        sq_t, sq_h, s_blk, s_kvh, s_slot, s_bt, scale, cnt_ptr, o_ptr, so_t, so_h,
                        GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_CHUNK: tl.constexpr,
                        FUSED: tl.constexpr = False):
    """Decode over a paged cache, split-KV: program (s, b, kh) computes the chunks c = s, s + NSPLIT,
    ... of sequence b's keys, each from a fresh state exactly as ``_rows_chunked`` does, and stores
    every chunk's raw state (m, l, acc) at ws[(b, head), c]; ``_paged_merge_kernel`` folds them in
    chunk order. Rows: the GQA group's heads of b's one query (a sequence without a query: nothing).

    ``FUSED``: no merge kernel. After its stores each program checks in on ``cnt_ptr[b, kh]`` (a CTA
    barrier, then one release/acquire atomic at GPU scope: the threadfence-reduction pattern); the
    program that checks in last folds the group's chunk states in chunk order with ``_merge`` /
    ``_finish`` (the merge kernel's elementwise operations, so the same bits), writes the output and
    sets the counter back to 0 for the next launch."""
    s = tl.program_id(0)
    b = tl.program_id(1)
    kh = tl.program_id(2)
    q0 = tl.load(cu_ptr + b)
    nq = tl.load(cu_ptr + b + 1) - q0
    L_b = tl.load(seqlen_ptr + b)
    if nq == 1:
        r = tl.arange(0, BLOCK_M)
        mm = r < GROUP
        h = kh * GROUP + r
        qrow = q0.to(tl.int64)
        pos = tl.where(mm, L_b - 1, -1)
        rd = tl.arange(0, BLOCK_D)
        rdv = tl.arange(0, BLOCK_DV)
        q = tl.load(q_ptr + qrow * sq_t + h[:, None] * sq_h + rd[None, :],
                    mask=mm[:, None] & (rd[None, :] < D), other=0.0)
        kb = k_ptr + kh * s_kvh
        vb = v_ptr + kh * s_kvh
        bt = bt_ptr + b.to(tl.int64) * s_bt
        row = b.to(tl.int64) * (GROUP * tl.num_programs(2)) + h  # flat (sequence, head) index
        for lo in range(s * KV_CHUNK, L_b, NSPLIT * KV_CHUNK):
            c = lo // KV_CHUNK
            m_c, l_c, acc_c = _chunk_state(q, kb, vb, pos, lo, tl.minimum(lo + KV_CHUNK, L_b), L_b, s_slot, s_slot,
                                           scale, rd, rdv, D, DV, BLOCK_M, BLOCK_DV, BLOCK_N, bt, s_blk, PAGE)
            tl.store(wm_ptr + row * NC + c, m_c, mask=mm)
            tl.store(wl_ptr + row * NC + c, l_c, mask=mm)
            tl.store(wacc_ptr + (row * NC + c)[:, None] * DV + rdv[None, :], acc_c,
                     mask=mm[:, None] & (rdv[None, :] < DV))
        if FUSED:
            cnt = cnt_ptr + b.to(tl.int64) * tl.num_programs(2) + kh
            tl.debug_barrier()  # every thread's chunk-state stores, before the release below
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:
                M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                L = tl.zeros((BLOCK_M,), tl.float32)
                ACC = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
                mv = mm[:, None] & (rdv[None, :] < DV)
                for c in range(0, tl.cdiv(L_b, KV_CHUNK)):  # the other programs' states: read from L2
                    m_c = tl.load(wm_ptr + row * NC + c, mask=mm, other=float("-inf"), cache_modifier=".cg")
                    l_c = tl.load(wl_ptr + row * NC + c, mask=mm, other=0.0, cache_modifier=".cg")
                    acc_c = tl.load(wacc_ptr + (row * NC + c)[:, None] * DV + rdv[None, :], mask=mv, other=0.0,
                                    cache_modifier=".cg")
                    M, L, ACC = _merge(M, L, ACC, m_c, l_c, acc_c)
                out = _finish(L, ACC)
                tl.store(o_ptr + qrow * so_t + h[:, None] * so_h + rdv[None, :], out.to(o_ptr.dtype.element_ty),
                         mask=mv)
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next launch / replay


@triton.jit
def _paged_merge_kernel(wm_ptr, wl_ptr, wacc_ptr, cu_ptr, seqlen_ptr, o_ptr, Hq, NC, so_t, so_h,
                        DV: tl.constexpr, BLOCK_DV: tl.constexpr, KV_CHUNK: tl.constexpr):
    """out[b's query, h] = its chunk states folded in chunk order (the operations of _rows_chunked)."""
    row = tl.program_id(0).to(tl.int64)  # (sequence, head)
    b = row // Hq
    h = row % Hq
    q0 = tl.load(cu_ptr + b)
    nq = tl.load(cu_ptr + b + 1) - q0
    if nq == 1:
        rdv = tl.arange(0, BLOCK_DV)
        out = _fold_chunks(wm_ptr, wl_ptr, wacc_ptr, row, NC, tl.cdiv(tl.load(seqlen_ptr + b), KV_CHUNK), rdv, DV,
                           BLOCK_DV)
        tl.store(o_ptr + q0.to(tl.int64) * so_t + h * so_h + rdv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=rdv[None, :] < DV)


# split-KV decode: aim at this many programs per SM (host sizes only: a captured graph keeps its split).
# 8 measured on the H200 (benchmarks/attn_decode_gpu.py, moe1b heads): batch 256 x 1100 keys 206 us at
# 2 splits vs 277 us at 1 (what 4 per SM gave); batch 128 x 768: 76 us (3) vs 81 us (2); no shape slower
SPLIT_PROGRAMS_PER_SM = 8
# and never more than this much fp32 chunk-state workspace (else the one-pass kernel)
SPLIT_WORKSPACE_BYTES = 256 << 20
# fused merge: one int32 check-in counter per (sequence, KV head) of a launch, zero between launches
# (the last program of each resets its own), one buffer per device. Launches on one device must not
# overlap (the engine's forward runs on one stream); batches needing more counters use the merge kernel.
MERGE_COUNTERS = 1 << 16
_COUNTERS: dict = {}


def _merge_counters(device: torch.device, n: int) -> Optional[torch.Tensor]:
    """The device's zeroed counter buffer (made on first use: in a CUDA graph capture its memset is
    captured too, harmless), or None when a batch needs more than ``MERGE_COUNTERS``."""
    if n > MERGE_COUNTERS:
        return None
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return buf


def decode_splits(num_seqs: int, num_kv_heads: int, num_chunks: int, sm_count: int, rows: int = BLOCK_M) -> int:
    """Programs per (sequence, KV head) for a decode batch: enough to give every SM
    ``SPLIT_PROGRAMS_PER_SM`` programs of 4 warps (``rows`` < 64: as many more as each has fewer
    warps), at most one per chunk. Free to choose: the split never changes a bit (every chunk's
    state is computed and merged the same way)."""
    per_sm = SPLIT_PROGRAMS_PER_SM * (BLOCK_M // rows)
    want = triton.cdiv(per_sm * sm_count, max(1, num_seqs * num_kv_heads))
    return max(1, min(num_chunks, want))


def decode_tile(group: int, rows: Optional[int] = None) -> tuple[int, int]:
    """(rows per program, warps) of a split-KV decode program for a GQA group of ``group`` heads:
    16 rows on one warp when ``rows`` (default ``settings.decode_rows()``) is 16 and the group
    fits, else the 64-row prefill tile on four warps."""
    r = settings.decode_rows() if rows is None else int(rows)
    if r == 16 and group <= 16:
        return 16, 1
    return BLOCK_M, NUM_WARPS


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, max_q_len: int,
                    out: torch.Tensor, num_seqs: Optional[int] = None, splits: Optional[int] = None,
                    rows: Optional[int] = None, fused_merge: Optional[bool] = None) -> torch.Tensor:
    """Causal attention over a paged KV cache, written into ``out[Tq, Hq, Dv]`` (rows of other
    tokens are left untouched).

    ``k_cache`` / ``v_cache``: ``[num_blocks, Hkv, PAGE, D]`` views (any strides with a unit last
    stride, the same block / head / slot strides for both, e.g. the two halves of vLLM's
    ``[num_blocks, Hkv, PAGE, 2 * D]`` cache); ``block_table[b, i]`` the block holding keys
    ``i*PAGE ..`` of sequence b; sequence b has ``seq_lens[b]`` keys and queries
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last ones of its keys (query j of n at position
    ``seq_len - n + j``). Sequences with no queries (CUDA-graph padding) do nothing; keys at and past
    ``seq_len`` are never read. Grid: ``(ceil(max_q_len * G / 64), num_seqs, Hkv)``, host sizes only.

    Decode batches (``max_q_len == 1``) split each sequence's keys over ``splits`` programs per
    (sequence, KV head) (default :func:`decode_splits`: from the batch size and the GPU, never from
    device data; ``1``: the one-pass kernel) and fold the 256-key chunk states in chunk order in a
    second kernel -- flash-decoding with split points fixed in key positions, so the bits are the
    one-pass kernel's whatever the split (tested). The chunk count comes from the block table's
    width (host-known), so a captured graph serves every length up to it. ``rows``: query rows per
    split program (:func:`decode_tile`; default ``settings.decode_rows()``, 64): 16 rows run one
    warp with each warp's layout of the 64-row tile, a launch plan only where the GPU gives the
    64-row tile's bits (checked on the machine by the GPU tests). ``fused_merge`` (default
    ``settings.decode_fused_merge()``): the last split program of each (sequence, KV head) folds the
    chunk states instead of a second kernel (one launch; the same operations in the same order).

    Bitwise :func:`attention` / :func:`attention_batched` on the same keys (same tiles, chunks,
    order): prefill, chunked prefill and decode of a sequence give the bits the learner's
    ``causal_attention`` computes over the whole sequence."""
    Tq, Hq, D = q.shape
    nb, Hkv, PAGE, Dk = k_cache.shape
    Dv = v_cache.shape[-1]
    if Dk != D or v_cache.shape[:3] != (nb, Hkv, PAGE) or Hq % Hkv:
        raise ValueError("paged_attention: shape mismatch")
    if k_cache.stride()[:3] != v_cache.stride()[:3]:
        raise ValueError("paged_attention: K and V caches must share block / head / slot strides")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: last dims must be contiguous")
    if k_cache.dtype != q.dtype:
        raise ValueError("paged_attention: q and the cache must have the same dtype")
    B = int(num_seqs) if num_seqs is not None else cu_seqlens_q.numel() - 1
    G = Hq // Hkv
    if Tq == 0 or B == 0 or max_q_len <= 0:
        return out
    if max_q_len == 1 and G <= BLOCK_M:
        nc = triton.cdiv(block_table.shape[1] * PAGE, KV_CHUNK)
        tile, warps = decode_tile(G, rows)
        fits = B * Hq * nc * (Dv + 2) * 4 <= SPLIT_WORKSPACE_BYTES
        if not fits:
            tile, warps = BLOCK_M, NUM_WARPS
        if splits is None:
            on = fits and q.is_cuda and settings.decode_split()
            splits = decode_splits(B, Hkv, nc, gpu_info.sm_count(q.device), tile) if on else 1
        if splits > 1 or tile < BLOCK_M:
            wm = torch.empty(B * Hq, nc, device=q.device, dtype=torch.float32)
            wl = torch.empty_like(wm)
            wacc = torch.empty(B * Hq, nc, Dv, device=q.device, dtype=torch.float32)
            fused = settings.decode_fused_merge() if fused_merge is None else bool(fused_merge)
            cnt = _merge_counters(q.device, B * Hkv) if fused else None
            _paged_split_kernel[(int(splits), B, Hkv)](
                q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, wm, wl, wacc, nc, int(splits),
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                block_table.stride(0), float(scale), cnt if cnt is not None else seq_lens, out,
                out.stride(0), out.stride(1),
                GROUP=G, D=D, DV=Dv, BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(Dv),
                PAGE=PAGE, BLOCK_M=tile, BLOCK_N=BLOCK_N, KV_CHUNK=KV_CHUNK, FUSED=cnt is not None,
                num_warps=warps, num_stages=2, enable_fp_fusion=False)
            if cnt is not None:
                return out
            _paged_merge_kernel[(B * Hq,)](wm, wl, wacc, cu_seqlens_q, seq_lens, out, Hq, nc, out.stride(0),
                                           out.stride(1), DV=Dv, BLOCK_DV=triton.next_power_of_2(Dv),
                                           KV_CHUNK=KV_CHUNK, num_warps=1, enable_fp_fusion=False)
            return out
    grid = (triton.cdiv(int(max_q_len) * G, BLOCK_M), B, Hkv)
    _paged_kernel[grid](
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), float(scale),
        GROUP=G, D=D, DV=Dv, BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(Dv), PAGE=PAGE,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, KV_CHUNK=KV_CHUNK, num_warps=NUM_WARPS, num_stages=2,
        enable_fp_fusion=False)
    return out


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, sk_t, sk_h, sv_t, sv_h, s_blk, s_kvh, s_slot,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot >= 0:
        dst = (slot // PAGE) * s_blk + h * s_kvh + (slot % PAGE) * s_slot
        rd = tl.arange(0, BLOCK_D)
        k = tl.load(k_ptr + i * sk_t + h * sk_h + rd, mask=rd < D)
        tl.store(kc_ptr + dst + rd, k.to(kc_ptr.dtype.element_ty), mask=rd < D)
        v = tl.load(v_ptr + i * sv_t + h * sv_h + rd, mask=rd < DV, other=0.0)
        tl.store(vc_ptr + dst + rd, v.to(vc_ptr.dtype.element_ty), mask=rd < D)  # V zero-padded to D


def paged_kv_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """``k_cache/v_cache[slot // PAGE, :, slot % PAGE] = key/value[i]`` for every token i with
    ``slot_mapping[i] >= 0`` (an exact copy; negative slots are padding). ``key[T, Hkv, D]``,
    ``value[T, Hkv, Dv <= D]`` (stored zero-padded to D); caches as in :func:`paged_attention`."""
    n = min(slot_mapping.shape[0], key.shape[0])
    if n == 0:
        return
    nb, Hkv, PAGE, D = k_cache.shape
    Dv = value.shape[-1]
    if key.shape[1:] != (Hkv, D) or value.shape[1] != Hkv or Dv > D:
        raise ValueError("paged_kv_write: shape mismatch")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("paged_kv_write: last dims must be contiguous")
    _kv_write_kernel[(n, Hkv)](key, value, slot_mapping, k_cache, v_cache, key.stride(0), key.stride(1),
                               value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
                               k_cache.stride(2), D=D, DV=Dv, BLOCK_D=triton.next_power_of_2(D), PAGE=PAGE,
                               num_warps=1)
