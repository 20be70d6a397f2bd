"""Token-order-invariant MoE expert compute on the GPU (Triton).

``moe_experts(x[T, H], w_gate[E, I, H], w_up[E, I, H], w_down[E, H, I], topk_ids[T, k],
topk_weights[T, k], shared_out=None)`` -> ``[T, H]``; same dtype rules as the CPU reference
(kernels/moe.py): gate/up projections rounded to ``x.dtype``, ``silu(g) * u`` in fp32 as
``g / (1 + exp(-g)) * u`` rounded once, down projection with the row-parallel K segmentation
(``ROW_PARALLEL_K_SEGMENTS``), combine in fp32 in slot order (slot 0 first), then the shared expert
output(s), rounded once.

Invariance: the (token, slot) pairs are sorted by expert and every expert's rows are computed by a
grouped GEMM whose per-row result is **one fixed fp32 dot chain over K** (segments of fixed length,
added in order) -- the same chain as ``kernels.triton.linear`` with the same ``k_segments``. Nothing
in a row's arithmetic depends on how many rows its expert received, on which other tokens are in
the batch, or on the M tile that holds it (tile shape never changes the bits; see gemm.py). So a
token's MoE output is bitwise the same whatever the batch, and bitwise equal to
``linear(x_t, W_e, k_segments=...)`` computed for that token alone (tested).

Work list on the device (no host sync, CUDA-graph capturable): the flat expert ids are stably sorted;
per-expert counts come from an integer scatter-add (exact); each expert gets ``ceil(count / BLOCK_M)``
row tiles; the grid is the static upper bound ``ceil(T*k / BLOCK_M) + E`` and unused programs exit.
Small lists (decode) are built by one single-program kernel with the same integer values
(``work_list``); the order of rows inside an expert never changes a row's bits anyway.

Kernels: (1) gate+up grouped GEMM with the SwiGLU epilogue (two accumulators, same chains as two
separate GEMMs, rows gathered from x by token id); (2) down grouped GEMM writing each row back to its
(token, slot) place; (3) per-token combine in slot order.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from .. import settings
from ..gemm import ROW_PARALLEL_K_SEGMENTS
from . import gpu_info

_USE_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"
if _USE_LIBDEVICE:
    from triton.language.extra import libdevice
_LIBDEVICE = tl.constexpr(_USE_LIBDEVICE)

__all__ = ["moe_experts", "moe_experts_merged", "grouped_linear", "swiglu", "moe_combine", "expert_mlp",
           "make_work_list", "work_list", "work_list_fused", "grouped_tile_n", "direct_rows"]


@triton.jit
def _exp(x):
    if _LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _silu_mul(g, u):
    """fp32 ``g / (1 + exp(-g)) * u`` (IEEE division)."""
    return tl.math.div_rn(g, 1.0 + _exp(-g)) * u


@triton.jit
def _seg_chain(a_ptr, arow, mask_m, w_base, rn, mask_n, k_lo, k_hi, K, stride_ak, stride_wn, stride_wk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, IEEE: tl.constexpr):
    """fp32 dot chain over K in [k_lo, k_hi), from zero, K ascending (as gemm._seg_dot)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rk = tl.arange(0, BLOCK_K)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        kk = k + rk
        ap = a_ptr + arow[:, None] + kk[None, :] * stride_ak
        wp = w_base + rn[:, None] * stride_wn + kk[None, :] * stride_wk
        if EVEN_K:
            a = tl.load(ap, mask=mask_m[:, None], other=0.0)
            b = tl.load(wp, mask=mask_n[:, None], other=0.0)
        else:  # the segment's end (K for one segment): a segment need not fill its last tile
            a = tl.load(ap, mask=mask_m[:, None] & (kk[None, :] < k_hi), other=0.0)
            b = tl.load(wp, mask=mask_n[:, None] & (kk[None, :] < k_hi), other=0.0)
        if IEEE:
            acc = tl.dot(a, b.T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _chain(a_ptr, arow, mask_m, w_base, rn, mask_n, K, SEG_LEN, stride_ak, stride_wn, stride_wk,
           NUM_SEGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, IEEE: tl.constexpr):
    """Segmented chain: one segment -> the chain itself; else ((0 + p0) + p1) + ... (gemm.py)."""
    if NUM_SEGS == 1:
        total = _seg_chain(a_ptr, arow, mask_m, w_base, rn, mask_n, 0, K, K, stride_ak, stride_wn,
                           stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, NUM_STAGES, IEEE)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, NUM_SEGS):
            part = _seg_chain(a_ptr, arow, mask_m, w_base, rn, mask_n, s * SEG_LEN, (s + 1) * SEG_LEN, K,
                              stride_ak, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                              NUM_STAGES, IEEE)
            total = total + part
    return total


@triton.jit
def _grouped_kernel(a_ptr, a_rows_ptr, w_ptr, w2_ptr, out_ptr, out_rows_ptr, tile_expert_ptr, tile_start_ptr,
                    expert_end_ptr, N, K, stride_am, stride_ak, stride_we, stride_wn, stride_wk,
                    stride_om, stride_on, SEG_LEN, ROW_DIV,
                    NUM_SEGS: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr,
                    SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                    IEEE: tl.constexpr, DIRECT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DIRECT:
        # one (token, slot) row per program, in flat order: tile_expert_ptr is the flat expert ids,
        # the input row is row // ROW_DIV (the token for gate/up, the row itself for down), the
        # output row the row itself; no work list (the tile's other rows are masked)
        e = tl.load(tile_expert_ptr + pid_m).to(tl.int32)
        rm = pid_m + tl.arange(0, BLOCK_M)
        mask_m = rm < pid_m + 1
        src = rm // ROW_DIV
    else:
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        row0 = tl.load(tile_start_ptr + pid_m)
        row_end = tl.load(expert_end_ptr + e)
        rm = row0 + tl.arange(0, BLOCK_M)
        mask_m = rm < row_end
        if GATHER_A:
            src = tl.load(a_rows_ptr + rm, mask=mask_m, other=0)
        else:
            src = rm
    arow = src.to(tl.int64) * stride_am
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    w_base = w_ptr + e.to(tl.int64) * stride_we
    acc = _chain(a_ptr, arow, mask_m, w_base, rn, mask_n, K, SEG_LEN, stride_ak, stride_wn, stride_wk,
                 NUM_SEGS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, NUM_STAGES, IEEE)
    odt = out_ptr.dtype.element_ty
    if SWIGLU:
        w2_base = w2_ptr + e.to(tl.int64) * stride_we
        acc2 = _chain(a_ptr, arow, mask_m, w2_base, rn, mask_n, K, SEG_LEN, stride_ak, stride_wn, stride_wk,
                      NUM_SEGS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, NUM_STAGES, IEEE)
        g = acc.to(odt).to(tl.float32)  # gate / up rounded to the activation dtype, as two linears
        u = acc2.to(odt).to(tl.float32)
        res = _silu_mul(g, u).to(odt)
    else:
        res = acc.to(odt)
    if SCATTER_OUT and not DIRECT:
        dst = tl.load(out_rows_ptr + rm, mask=mask_m, other=0)
    else:
        dst = rm
    op = out_ptr + dst.to(tl.int64)[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(op, res, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, o_ptr, N, sg, su, so, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + row * sg + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * so + offs, _silu_mul(g, u).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_weight(w_ptr, i, W_ROUND: tl.constexpr):
    """Slot weight ``i`` in fp32: loaded in its own dtype and widened (exact); with ``W_ROUND`` 1 / 2
    first rounded to bf16 / fp16 (round to nearest even, as ``torch.Tensor.to``). The bf16 rounding
    is done on the fp32 bits (add 0x7FFF plus the kept lowest bit, clear the low 16 bits: torch's own
    formula, NaN left as it is), so Triton's interpreter, which truncates an fp32 -> bf16 cast,
    computes the GPU's bits."""
    w = tl.load(w_ptr + i).to(tl.float32)
    if W_ROUND == 1:
        b = w.to(tl.uint32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
        w = tl.where(w == w, b.to(tl.float32, bitcast=True), w)
    elif W_ROUND == 2:
        w = w.to(tl.float16).to(tl.float32)
    return w


@triton.jit
def _combine_kernel(y_ptr, w_ptr, shared_ptr, out_ptr, H, stride_y, stride_s, stride_o,
                    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, W_ROUND: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < H
    w0 = _combine_weight(w_ptr, t * TOP_K, W_ROUND)
    acc = w0 * tl.load(y_ptr + (t * TOP_K) * stride_y + offs, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        wj = _combine_weight(w_ptr, t * TOP_K + j, W_ROUND)
        acc = acc + wj * tl.load(y_ptr + (t * TOP_K + j) * stride_y + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + t * stride_s + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------ host


def _block_m(rows: int, n_experts: int) -> int:
    """Row tile from the average rows per expert (free: the tile never changes a row's bits)."""
    avg = rows / max(1, n_experts)
    if avg <= 16:
        return 16
    if avg <= 64:
        return 64
    return 128


@triton.jit
def _work_list_kernel(ids_ptr, order_ptr, tok_ptr, tile_expert_ptr, tile_start_ptr, expert_end_ptr, R, MAX_TILES,
                      TOP_K: tl.constexpr, E: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                      CH: tl.constexpr):
    """The whole work list in one program (integers only, so exact): per-expert counts, their
    cumulative ends, each (token, slot) row's place in the stable expert sort (the rows of one
    expert keep their flat order: rank = rows of that expert before it), and the tile table; the
    same values as ``make_work_list``'s torch ops."""
    re = tl.arange(0, E_P2)
    rc = tl.arange(0, CH)
    counts = tl.zeros((E_P2,), tl.int32)
    for r0 in range(0, R, CH):
        e = tl.load(ids_ptr + r0 + rc, mask=r0 + rc < R, other=-1).to(tl.int32)  # -1: no expert
        counts += tl.sum((e[:, None] == re[None, :]).to(tl.int32), axis=0)
    end = tl.cumsum(counts, axis=0)
    start = end - counts
    tl.store(expert_end_ptr + re, end, mask=re < E)
    run = start
    for r0 in range(0, R, CH):
        ri = r0 + rc
        e = tl.load(ids_ptr + ri, mask=ri < R, other=-1).to(tl.int32)
        oh = (e[:, None] == re[None, :]).to(tl.int32)
        before = tl.cumsum(oh, axis=0) - oh  # rows of the same expert earlier in this chunk
        dst = tl.sum(oh * (before + run[None, :]), axis=1)
        tl.store(order_ptr + dst, ri, mask=ri < R)
        tl.store(tok_ptr + dst, ri // TOP_K, mask=ri < R)
        run += tl.sum(oh, axis=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tcum = tl.cumsum(tiles, axis=0)
    tfirst = tcum - tiles
    for t0 in range(0, MAX_TILES, CH):
        t = t0 + rc
        te = tl.sum(((tcum[None, :] <= t[:, None]) & (re[None, :] < E)).to(tl.int32), axis=1)  # searchsorted right
        te_c = tl.minimum(te, E - 1)
        sel = (re[None, :] == te_c[:, None]).to(tl.int32)
        ts = tl.sum(sel * start[None, :], axis=1) + (t - tl.sum(sel * tfirst[None, :], axis=1)) * BLOCK_M
        tl.store(tile_expert_ptr + t, tl.where(te < E, te_c, -1), mask=t < MAX_TILES)
        tl.store(tile_start_ptr + t, ts, mask=t < MAX_TILES)


# one-program work list up to this many (token, slot) rows and experts (decode batches); larger
# lists (prefill) take the torch ops, whose sort is faster there (same values)
FUSED_WORK_LIST_ROWS = 1024
FUSED_WORK_LIST_EXPERTS = 512


def work_list(flat_ids: torch.Tensor, n_experts: int, block_m: int, top_k: int = 1):
    """``(order, tok, tile_expert, tile_start, expert_end)``, all int32 on the device, no host sync:
    :func:`make_work_list`'s values plus ``tok = order // top_k`` (the token of each sorted row).
    Small lists are one launch (``_work_list_kernel``), larger ones torch's sort and scans; the
    choice is a function of host sizes only and never changes a value."""
    R = flat_ids.numel()
    e_p2 = triton.next_power_of_2(max(2, n_experts))
    if (flat_ids.is_cuda and R <= FUSED_WORK_LIST_ROWS and e_p2 <= FUSED_WORK_LIST_EXPERTS
            and settings.fused_work_list()):
        return work_list_fused(flat_ids, n_experts, block_m, top_k)
    order, tile_expert, tile_start, expert_end = make_work_list(flat_ids.to(torch.int64), n_experts, block_m)
    return (order.to(torch.int32), (order // top_k).to(torch.int32), tile_expert, tile_start, expert_end)


def work_list_fused(flat_ids: torch.Tensor, n_experts: int, block_m: int, top_k: int):
    dev = flat_ids.device
    R = flat_ids.numel()
    e_p2 = triton.next_power_of_2(max(2, n_experts))
    max_tiles = triton.cdiv(R, block_m) + n_experts
    order = torch.empty(R, device=dev, dtype=torch.int32)
    tok = torch.empty(R, device=dev, dtype=torch.int32)
    tile_expert = torch.empty(max_tiles, device=dev, dtype=torch.int32)
    tile_start = torch.empty(max_tiles, device=dev, dtype=torch.int32)
    expert_end = torch.empty(n_experts, device=dev, dtype=torch.int32)
    ch = max(16, min(256, 8192 // e_p2))
    _work_list_kernel[(1,)](flat_ids.contiguous(), order, tok, tile_expert, tile_start, expert_end, R, max_tiles,
                            TOP_K=top_k, E=n_experts, E_P2=e_p2, BLOCK_M=block_m, CH=ch, num_warps=4)
    return order, tok, tile_expert, tile_start, expert_end


def make_work_list(flat_ids: torch.Tensor, n_experts: int, block_m: int):
    """Stable expert sort and the per-program tile table, all on the device (no host sync).

    Returns ``(order, tile_expert, tile_start, expert_end)``: ``order[j]`` = flat (token*k + slot)
    index of sorted row ``j``; tile ``p`` covers sorted rows ``tile_start[p] ..`` of expert
    ``tile_expert[p]`` (``-1``: unused program); expert ``e``'s rows end at ``expert_end[e]``."""
    dev = flat_ids.device
    R = flat_ids.numel()
    _, order = torch.sort(flat_ids, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    expert_end = torch.cumsum(counts, 0)
    expert_start = expert_end - counts
    tiles = (counts + block_m - 1) // block_m
    tile_cum = torch.cumsum(tiles, 0)
    max_tiles = triton.cdiv(R, block_m) + n_experts
    t = torch.arange(max_tiles, device=dev)
    te = torch.searchsorted(tile_cum, t, right=True)
    ok = te < n_experts
    te_c = te.clamp(max=n_experts - 1)
    first = (tile_cum - tiles)[te_c]
    tile_start = expert_start[te_c] + (t - first) * block_m
    tile_expert = torch.where(ok, te_c, torch.full_like(te_c, -1))
    return (order, tile_expert.to(torch.int32).contiguous(), tile_start.to(torch.int32).contiguous(),
            expert_end.to(torch.int32).contiguous())


def grouped_tile_n(rows: int, n_experts: int, N: int, block_m: int, swiglu: bool, sm_count: int,
                   narrow: Optional[bool] = None) -> tuple[int, int]:
    """(output columns per program, warps) of a grouped GEMM launch over ``rows`` (token, slot) rows.

    Default: 64 columns for 16-row tiles, else 128 (64 with the SwiGLU epilogue's two accumulators).
    With narrow tiles (``settings.moe_narrow_tiles()``, or ``narrow``) a 16-row tile's width halves,
    down to 16 columns, until the experts that can hold rows (``min(rows, n_experts)``) give
    ``2 * sm_count`` programs; one warp per 16 columns. Host sizes only, so a captured CUDA graph keeps
    its plan. A launch plan: every column is the same dot chain over K whatever the width."""
    block_n = 64 if block_m <= 16 else 128
    if swiglu:
        block_n = min(block_n, 64)
    warps = 4 if block_m <= 64 else 8
    if settings.moe_narrow_tiles() if narrow is None else narrow:
        if block_m <= 16:
            active = max(1, min(int(rows), int(n_experts)))
            while block_n > 16 and active * triton.cdiv(N, block_n) < 2 * int(sm_count):
                block_n //= 2
            warps = block_n // 16
    return block_n, warps


def direct_rows(rows: int, n_experts: int, on: Optional[bool] = None) -> bool:
    """Whether :func:`moe_experts` runs ``rows`` (token, slot) rows without a work list, one program
    row each (``settings.moe_direct_rows()``, or ``on``): only while ``2 * rows <= n_experts``, where
    few experts receive two rows (each row streams its expert's weights itself). Same chains, so a
    launch plan only; host sizes only."""
    use = settings.moe_direct_rows() if on is None else on
    return bool(use) and 0 < 2 * int(rows) <= int(n_experts)


def _launch_grouped(a, a_rows, w, w2, out, out_rows, work, N, K, nseg, swiglu, block_m, rows, *,
                    direct_ids=None, row_div=1):
    """One grouped GEMM launch over a work list (``work``), or with ``direct_ids`` (the flat expert
    ids of ``rows`` (token, slot) rows) one program row per (token, slot) row in flat order, input
    row ``row // row_div``, no work list."""
    if direct_ids is not None:
        tile_expert = tile_start = expert_end = direct_ids
    else:
        tile_expert, tile_start, expert_end = work[-3:]
    if K % nseg:
        raise ValueError(f"grouped GEMM: K={K} not divisible into {nseg} segments")
    seg_len = K // nseg
    sms = gpu_info.sm_count(a.device) if a.is_cuda else 132  # (CPU tensors: Triton's interpreter; an H100's count)
    block_n, num_warps = grouped_tile_n(rows, w.shape[0], N, block_m, swiglu, sms)
    block_k = 128 if block_m <= 16 else 64
    if a.element_size() == 4:
        block_k = max(16, block_k // 2)
    if nseg > 1 and seg_len % block_k:
        # as gemm.matmul: the widest tile that divides the segment, else 16-wide tiles masked at the
        # segment's end (a tiny model's 64-wide expert down_proj in 8 row-parallel segments of 8)
        bk_max, block_k = block_k, 16
        while block_k * 2 <= bk_max and seg_len % (block_k * 2) == 0:
            block_k *= 2
    even_k = seg_len % block_k == 0
    grid = (rows if direct_ids is not None else tile_expert.numel(), triton.cdiv(N, block_n))
    _grouped_kernel[grid](
        a, a_rows if a_rows is not None else tile_start, w, w2 if w2 is not None else w, out,
        out_rows if out_rows is not None else tile_start, tile_expert, tile_start, expert_end,
        N, K, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), seg_len, int(row_div),
        NUM_SEGS=nseg, GATHER_A=a_rows is not None, SCATTER_OUT=out_rows is not None, SWIGLU=swiglu,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=even_k, NUM_STAGES=3,
        IEEE=a.dtype == torch.float32, DIRECT=direct_ids is not None, num_warps=num_warps)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, *, k_segments: int = 1,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Row ``i`` of ``x[R, K]`` times expert ``expert_ids[i]``'s ``w[E, N, K]``: ``[R, N]``.

    Bitwise ``kernels.triton.linear(x[i:i+1], w[e], k_segments=k_segments)`` for every row."""
    R, K = x.shape
    E, N, _ = w.shape
    out = torch.empty(R, N, device=x.device, dtype=out_dtype or x.dtype)
    if R == 0:
        return out
    bm = _block_m(R, E)
    work = work_list(expert_ids.reshape(-1), E, bm)
    order = work[0]
    _launch_grouped(x, order, w, None, out, order, work, N, K, int(k_segments), False, bm, R)
    return out


def _as_list(shared_out) -> list:
    if shared_out is None:
        return []
    return [shared_out] if isinstance(shared_out, torch.Tensor) else list(shared_out)


# weights_dtype of moe_combine -> the kernel's W_ROUND
_W_ROUND = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def moe_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor,
                shared_out: Union[None, torch.Tensor, Sequence[torch.Tensor]] = None, *,
                out_dtype: Optional[torch.dtype] = None, weights_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``expert_out[T, k, H]`` x ``topk_weights[T, k]`` (+ shared) in fp32, slot order, rounded once.

    The weights are read in their own dtype and widened to fp32 in the kernel (no copy first).
    ``weights_dtype`` (bf16 / fp16): the weights are first rounded to it in the kernel, the bits of
    ``moe_combine(expert_out, topk_weights.to(weights_dtype), ...)`` without that conversion's launch
    (Qwen3-MoE rounds its fp32 routing weights to the activations' dtype)."""
    if weights_dtype not in _W_ROUND:
        raise ValueError(f"moe_combine: weights_dtype {weights_dtype} is not one of bf16, fp16, fp32")
    T, k, H = expert_out.shape
    odt = out_dtype or expert_out.dtype
    shared = _as_list(shared_out)
    y = expert_out.reshape(T * k, H)
    if y.stride(-1) != 1:
        y = y.contiguous()
    w = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    w_round = _W_ROUND[weights_dtype] if weights_dtype != w.dtype else 0
    # one shared tensor is fused; more are added afterwards in list order (fp32, then one rounding)
    fused = shared[0] if len(shared) == 1 else None
    if fused is not None and fused.stride(-1) != 1:
        fused = fused.contiguous()
    out = torch.empty(T, H, device=expert_out.device, dtype=odt if len(shared) <= 1 else torch.float32)
    if T:
        block_h = min(1024, triton.next_power_of_2(H))
        _combine_kernel[(T, triton.cdiv(H, block_h))](
            y, w, fused if fused is not None else y, out, H, y.stride(0),
            fused.stride(0) if fused is not None else 0, out.stride(0),
            TOP_K=k, HAS_SHARED=fused is not None, BLOCK_H=block_h, W_ROUND=w_round, num_warps=4,
            enable_fp_fusion=False)
    if len(shared) > 1:
        for s in shared:
            out = out + s.to(torch.float32)
        out = out.to(odt)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32 (``g / (1 + exp(-g)) * u``), rounded once to ``gate.dtype``."""
    N = gate.shape[-1]
    g2 = gate.reshape(-1, N)
    u2 = up.reshape(-1, N)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    out = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    if out.numel():
        block = min(1024, triton.next_power_of_2(N))
        _swiglu_kernel[(g2.shape[0], triton.cdiv(N, block))](
            g2, u2, out, N, g2.stride(0), u2.stride(0), out.stride(0), BLOCK=block, num_warps=4,
            enable_fp_fusion=False)
    return out.reshape(gate.shape)


def expert_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
               k_segments_down: int = ROW_PARALLEL_K_SEGMENTS) -> torch.Tensor:
    """Dense SwiGLU MLP (shared experts, dense layers) with the invariant GEMM; same chains as the
    grouped path (gate/up one segment, down ``k_segments_down``)."""
    from .gemm import linear

    g = linear(x, w_gate, k_segments=1)
    u = linear(x, w_up, k_segments=1)
    return linear(swiglu(g, u), w_down, k_segments=k_segments_down)


def moe_experts_merged(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, shared_out=None, *,
                       k_segments_down: int = ROW_PARALLEL_K_SEGMENTS,
                       weights_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Same as :func:`moe_experts` with a merged ``w_gate_up[E, 2I, H]`` (gate rows first)."""
    I = w_gate_up.shape[1] // 2
    return moe_experts(x, w_gate_up[:, :I], w_gate_up[:, I:], w_down, topk_ids, topk_weights, shared_out,
                       k_segments_down=k_segments_down, weights_dtype=weights_dtype)


def moe_experts(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor, shared_out=None, *,
                k_segments_down: int = ROW_PARALLEL_K_SEGMENTS,
                weights_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Routed experts + fixed-order combine. ``x[T, H]``, ``w_gate/w_up[E, I, H]`` (may be strided
    views of one merged tensor, last dim contiguous, equal strides), ``w_down[E, H, I]``,
    ``topk_ids/topk_weights[T, k]``, ``shared_out``: already computed shared expert output(s) [T, H]
    (use :func:`expert_mlp`). ``weights_dtype``: the routing weights rounded to it first, in the
    combine kernel (:func:`moe_combine`). No autograd."""
    T, H = x.shape
    E, I, _ = w_gate.shape
    k = topk_ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w_up.stride() != w_gate.stride():
        w_up = w_up.contiguous()
        w_gate = w_gate.contiguous()
    R = T * k
    y = torch.empty(R, H, device=x.device, dtype=x.dtype)
    if T == 0:
        return torch.empty(0, H, device=x.device, dtype=x.dtype)
    bm = _block_m(R, E)
    act = torch.empty(R, I, device=x.device, dtype=x.dtype)
    if direct_rows(R, E):
        # a few rows over many experts: each (token, slot) row its own program, no work list
        ids = topk_ids.reshape(-1)
        ids = ids if ids.is_contiguous() else ids.contiguous()
        _launch_grouped(x, None, w_gate, w_up, act, None, None, I, H, 1, True, bm, R, direct_ids=ids, row_div=k)
        _launch_grouped(act, None, w_down, None, y, None, None, H, I, int(k_segments_down), False, bm, R,
                        direct_ids=ids)
        return moe_combine(y.view(T, k, H), topk_weights, shared_out, out_dtype=x.dtype, weights_dtype=weights_dtype)
    work = work_list(topk_ids.reshape(-1), E, bm, top_k=k)
    order, tok = work[0], work[1]
    _launch_grouped(x, tok, w_gate, w_up, act, None, work, I, H, 1, True, bm, R)
    _launch_grouped(act, None, w_down, None, y, order, work, H, I, int(k_segments_down), False, bm, R)
    return moe_combine(y.view(T, k, H), topk_weights, shared_out, out_dtype=x.dtype, weights_dtype=weights_dtype)


def expert_rows(x: torch.Tensor, tok: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, *, k_segments_down: int = ROW_PARALLEL_K_SEGMENTS) -> torch.Tensor:
    """Row ``r`` = expert ``ids[r]`` (``w_gate_up[E, 2I, H]`` gate rows first, ``w_down[E, H, I]``) on
    ``x[tok[r]]`` -> ``[R, H]``, before any combine: the grouped kernels of :func:`moe_experts` (same
    chains, so bitwise ``expert_mlp`` of each row alone). No host sync, no autograd."""
    H = x.shape[-1]
    E, I2, _ = w_gate_up.shape
    I = I2 // 2
    R = ids.numel()
    y = torch.empty(R, H, device=x.device, dtype=x.dtype)
    if R == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    bm = _block_m(R, E)
    work = work_list(ids.reshape(-1), E, bm, top_k=1)
    order = work[0]
    a_rows = tok.to(torch.int32)[order.long()].contiguous()
    act = torch.empty(R, I, device=x.device, dtype=x.dtype)
    _launch_grouped(x, a_rows, w_gate_up[:, :I], w_gate_up[:, I:], act, None, work, I, H, 1, True, bm, R)
    _launch_grouped(act, None, w_down, None, y, order, work, H, I, int(k_segments_down), False, bm, R)
    return y
