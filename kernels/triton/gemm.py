"""Batch-invariant bf16/fp16/fp32 GEMM for the GPU (Triton): ``y = x[M, K] @ W[N, K].T (+ b)``.

What decides the bits (measured on H200, triton 3.6; see kernels/README.md): only how K is cut into
segments and the order in which the fp32 segment partials are added. Tile shape (BLOCK_M/N/K),
mma.sync vs wgmma, TMA vs pointer loads, and reducing the segments in-kernel vs in a second kernel do
not change them. So:

* the K segmentation is a pure function of ``(K, N)`` (:func:`default_k_segments`) or given
  explicitly (``k_segments``, e.g. the row-parallel TP degree) -- **never chosen from M**;
* each segment is accumulated by one ``tl.dot`` chain in fp32 starting from zero, stepping K
  upwards; the segment partials are added left to right starting from ``0.0``
  (``((0 + p0) + p1) + ...``), then the bias (fp32), then one rounding to ``out_dtype``;
* with one segment the dot chain runs over all of K and its result is used directly;
* any tile config may be picked per M (:func:`pick_config`): all of them give the same bits (tested
  in tests/gpu/test_triton_kernels.py). Segmented shapes at small M run one program per
  (tile, segment) writing fp32 partials, reduced by a second kernel in segment order ("split" mode);
  at large M one program loops over the segments with two accumulators.

No atomics, no cuBLAS, no split-K chosen by M.

Split mode's partials handed on (:func:`matmul_partials`): when the picked config is split mode,
the caller may take the fp32 partials ``ws[nseg, M, N]`` instead of the output and finish the sum in
its own next kernel: ``kernels.triton.rmsnorm.add_partials_rms_norm`` adds them in segment order
from ``0.0``, adds the bias in fp32 and rounds once (the same operations, in the same order, as
``_reduce_segments_kernel``) and goes on with the residual add and the next RMSNorm, one launch
where there were two. :func:`reduce_partials` is the reduce kernel alone (a result that is needed
as a plain tensor after all). Which configs are split mode does not change the bits either way.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ..settings import gemm_small_tiles, gemm_table
from . import gemm_table as _gemm_table

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["linear", "LinearGrad", "default_k_segments", "pick_config", "GemmConfig", "CONFIGS", "matmul",
           "matmul_partials", "reduce_partials"]

# fixed segment length used by the default segmentation of long-K / narrow-N shapes
SEGMENT_LEN = 1024


def default_k_segments(K: int, N: int) -> int:
    """Number of equal K segments for a weight of shape [N, K]. Depends on (K, N) only.

    Long K with narrow N (e.g. a 7168 -> 2048 projection) starves decode-sized grids (N / 16 tiles
    of a K-long loop), so K is cut into 1024-long segments that decode runs as parallel programs.
    Everything else is one segment.
    """
    if K >= 4096 and N <= 2048 and K % SEGMENT_LEN == 0:
        return K // SEGMENT_LEN
    return 1


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False
    # segmented shapes only: one program per (tile, segment) + ordered reduce kernel
    split: bool = False
    # a segment that is not a multiple of block_k keeps block_k and masks its last tile at the
    # segment's end (instead of the widest power-of-two tile >= 16 that divides it, e.g. 32 for the
    # 1120-column segments of a 8960-wide down_proj)
    mask_tail: bool = False
    # segmented shapes, one program over all segments (not split): the segment loop and each
    # segment's K loop flattened into one software-pipelined loop (``tl.range(flatten=True)``), so
    # the pipeline does not drain and refill at every segment boundary (8 segments of 192 columns
    # are 3 K steps each); the same dot chains, partials added in the same order
    flat: bool = False

    @property
    def name(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}"
                f"{'_tma' if self.tma else ''}{'_split' if self.split else ''}{'_mt' if self.mask_tail else ''}{'_flat' if self.flat else ''}")


def _c(bm, bn, bk, w, s, g=8, tma=False, split=False, mask_tail=False, flat=False) -> GemmConfig:
    return GemmConfig(bm, bn, bk, w, s, g, tma, split, mask_tail, flat)


# Every config here must give identical bits (test_gemm_all_configs_identical). The dispatcher
# (pick_config) chooses among them by M, N and whether the shape is segmented. Kept small: each one
# is compiled on first use.
CONFIGS = {
    # decode: mma.sync (BLOCK_M 16 / 64 < one wgmma per warpgroup), pointer loads, deep K pipelines
    "d16_n32": _c(16, 32, 256, 4, 4),
    "d16_n64": _c(16, 64, 256, 4, 4),
    "d64_n64": _c(64, 64, 128, 4, 4),
    # mid M: wgmma + TMA
    "m64_n128": _c(64, 128, 64, 4, 4),
    "m64_n128_tma": _c(64, 128, 64, 4, 4, tma=True),
    # prefill: wgmma + TMA, large tiles
    "p128_n128_tma_s5": _c(128, 128, 64, 8, 5, tma=True),
    "p256_n128_tma": _c(256, 128, 64, 8, 3, tma=True),
    "p256_n128_tma_s4": _c(256, 128, 64, 8, 4, tma=True),
    "p128_n256_tma": _c(128, 256, 64, 8, 3, tma=True),
    # segmented shapes, small M: one program per (tile, segment), ordered reduce kernel
    "d16_n64_split": _c(16, 64, 256, 4, 4, split=True),
    "m64_n128_split": _c(64, 128, 64, 4, 4, split=True),
    "d64_n64_split": _c(64, 64, 128, 4, 4, split=True),
    # the same with the segment's last tile masked instead of narrower tiles (m64_n128_split_mt:
    # picked for long-K segmented shapes at M <= 64; gpu_kernels.py --sweep --shapes 8960,1536,8)
    "d16_n64_split_mt": _c(16, 64, 128, 4, 4, split=True, mask_tail=True),
    "m64_n128_split_mt": _c(64, 128, 64, 4, 4, split=True, mask_tail=True),
    # prefill / learner sizes of segmented shapes with the flattened segment loop (candidates for
    # the sweep, not picked yet; on unsegmented shapes they are the plain configs)
    "p128_n128_tma_s5_flat": _c(128, 128, 64, 8, 5, tma=True, flat=True),
    "p128_n256_tma_flat": _c(128, 256, 64, 8, 3, tma=True, flat=True),
    "d64_n64_flat": _c(64, 64, 128, 4, 4, flat=True),
}


# Short-K layers (K <= 2048 with N <= 4096, or K <= 1024: e.g. a ~1B model's projections) have their own table, from the H200
# sweep of those shapes (benchmarks/gpu_kernels.py --groups gemm1b): the prefill tiles of the
# large-K table leave most SMs idle there. Same bits either way. kernels.set_gemm_small_tiles(False)
# (recipe runtime.gemm_small_tiles=false) turns it off.


def _pick_short_k(M: int, N: int, k_segments: int) -> Optional[GemmConfig]:
    if M > 512:
        return None
    if k_segments > 1:
        if M <= 64:
            return CONFIGS["d16_n64_split"]
        return CONFIGS["d64_n64_split" if M <= 256 else "d64_n64"]
    if M <= 16:
        return None
    if N <= 64:
        return CONFIGS["d16_n32"]
    if N <= 128:
        # narrow outputs (a 128-expert router gate): a grid of a few tiles wants the smallest ones
        # (2048 -> 128 on the H100: 5.1 vs 7.9 us at M = 128, 8.8 vs 23.4 at M = 2048; the sweep of
        # benchmarks/results/gpu_2026-12-06d_h100/tune/sweep_qwen3_30b_a3b_4l.log)
        return CONFIGS["d16_n32" if M <= 512 else "d16_n64" if M <= 1024 else "d64_n64"]
    if N > 4096:
        if M <= 64:
            return CONFIGS["m64_n128_tma"]
        return CONFIGS["p128_n128_tma_s5" if M <= 128 else "p256_n128_tma_s4"]
    if M <= 32:
        return CONFIGS["d16_n32" if N <= 2048 else "d16_n64"]
    if M <= 64:
        return CONFIGS["d16_n64" if N <= 2048 else "d64_n64"]
    if M <= 128 or (M <= 256 and N <= 2048):
        return CONFIGS["d64_n64"]
    return CONFIGS["m64_n128_tma"]


def pick_config(M: int, K: int, N: int, k_segments: int) -> GemmConfig:
    """Fastest measured config for this M (H200 sweeps, benchmarks/gpu_kernels.py --sweep / gemm1b).

    The choice may depend on M freely: every config gives the same bits for a given (K, N,
    k_segments). Only the segmentation (an argument here) is fixed per layer. A measured table for
    this GPU (kernels/triton/gemm_table.py; ``runtime.gemm_table``) overrides the heuristics below
    for the shapes and row counts it timed.
    """
    name = _table_pick(M, K, N, k_segments)
    if name is not None:
        return CONFIGS[name]
    if gemm_small_tiles() and K <= 2048 and (N <= 4096 or K <= 1024):
        cfg = _pick_short_k(M, N, k_segments)
        if cfg is not None:
            return cfg
    return _pick_config(M, K, N, k_segments)


_table_index: dict = {}  # setting -> (device name, indexed table or None)


def _table_pick(M: int, K: int, N: int, k_segments: int) -> Optional[str]:
    setting = gemm_table()
    hit = _table_index.get(setting)
    if hit is None:  # once per setting and process: the file is read and checked here
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        path = _gemm_table.table_path(setting, device)
        hit = _table_index[setting] = _gemm_table.load_table(path, CONFIGS) if path is not None else {}
    return _gemm_table.lookup(hit, M, K, N, k_segments) if hit else None


def _pick_config(M: int, K: int, N: int, k_segments: int) -> GemmConfig:
    if k_segments > 1:
        if M <= 64:
            # a segment that is not a multiple of 64 (8960 / 8 = 1120) keeps 64-wide K tiles, its last
            # one masked: 16.4 vs 19.3 us at M = 32 on the H100 (gpu_kernels.py --sweep --shapes
            # 8960,1536,8); the same config as m64_n128_split wherever the segment divides by 64
            return CONFIGS["m64_n128_split_mt"]
        if M <= 256:
            return CONFIGS["m64_n128_split"]
        if M <= 1024:
            return CONFIGS["p128_n128_tma_s5"]
        return CONFIGS["p128_n256_tma"]
    if M <= 16:
        return CONFIGS["d16_n32" if N <= 4096 else "d16_n64"]
    if M <= 64:
        return CONFIGS["d64_n64"]
    if M <= 128:
        return CONFIGS["d64_n64" if N <= 4096 else "m64_n128_tma"]
    if M <= 1024:
        return CONFIGS["p128_n128_tma_s5"]
    return CONFIGS["p256_n128_tma"]


# --------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % width) % gsize)
    pid_n = (pid % width) // gsize
    return pid_m, pid_n


@triton.jit
def _seg_dot(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, k_lo, k_hi, M, N, K,
             stride_xm, stride_xk, stride_wn, stride_wk,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             TMA: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
             IEEE: tl.constexpr):
    """fp32 dot chain over K in [k_lo, k_hi), starting from zero, K ascending."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            a = x_desc.load([off_m, k])
            b = w_desc.load([off_n, k])
            if IEEE:
                acc = tl.dot(a, b.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
    else:
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mask_m = rm < M
        mask_n = rn < N
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            kk = k + rk
            xp = x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk
            wp = w_ptr + rn[:, None] * stride_wn + kk[None, :] * stride_wk
            if EVEN_K:
                a = tl.load(xp, mask=mask_m[:, None], other=0.0)
                b = tl.load(wp, mask=mask_n[:, None], other=0.0)
            else:  # the segment's end (K for one segment): a segment need not fill its last tile
                a = tl.load(xp, mask=mask_m[:, None] & (kk[None, :] < k_hi), other=0.0)
                b = tl.load(wp, mask=mask_n[:, None] & (kk[None, :] < k_hi), other=0.0)
            if IEEE:
                acc = tl.dot(a, b.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _flat_segments(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                   SEG_LEN, NUM_SEGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                   IEEE: tl.constexpr):
    """``((0 + p0) + p1) + ...`` where ``p_s`` is segment s's dot chain from zero, K ascending:
    exactly ``_seg_dot`` per segment, in a loop nest the compiler flattens and pipelines as one."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    for s in tl.range(0, NUM_SEGS, num_stages=NUM_STAGES, flatten=True):
        k_lo = s * SEG_LEN
        k_hi = k_lo + SEG_LEN
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, SEG_LEN, BLOCK_K):  # bounds independent of s: a loop nest the compiler can flatten
            k = k_lo + kk
            if TMA:
                a = x_desc.load([off_m, k])
                b = w_desc.load([off_n, k])
            else:
                kk = k + rk
                xp = x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk
                wp = w_ptr + rn[:, None] * stride_wn + kk[None, :] * stride_wk
                if EVEN_K:
                    a = tl.load(xp, mask=mask_m[:, None], other=0.0)
                    b = tl.load(wp, mask=mask_n[:, None], other=0.0)
                else:
                    a = tl.load(xp, mask=mask_m[:, None] & (kk[None, :] < k_hi), other=0.0)
                    b = tl.load(wp, mask=mask_n[:, None] & (kk[None, :] < k_hi), other=0.0)
            if IEEE:
                acc = tl.dot(a, b.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        total = total + acc
    return total


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, x_desc, w_desc, out_ptr, bias_ptr,
                 M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                 stride_os, SEG_LEN,
                 NUM_SEGS: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, IEEE: tl.constexpr, FLAT: tl.constexpr = False):
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        # one segment per program; fp32 partial to workspace[s, M, N]
        s = tl.program_id(1)
        acc = _seg_dot(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, s * SEG_LEN, (s + 1) * SEG_LEN,
                       M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                       BLOCK_M, BLOCK_N, BLOCK_K, TMA, EVEN_K, NUM_STAGES, IEEE)
        op = out_ptr + s * stride_os + rm[:, None] * stride_om + rn[None, :] * stride_on
        tl.store(op, acc, mask=mask)
    else:
        if NUM_SEGS == 1:
            total = _seg_dot(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, 0, K, M, N, K,
                             stride_xm, stride_xk, stride_wn, stride_wk,
                             BLOCK_M, BLOCK_N, BLOCK_K, TMA, EVEN_K, NUM_STAGES, IEEE)
        elif FLAT:
            total = _flat_segments(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, M, N, K, stride_xm, stride_xk,
                                   stride_wn, stride_wk, SEG_LEN, NUM_SEGS, BLOCK_M, BLOCK_N, BLOCK_K, TMA,
                                   EVEN_K, NUM_STAGES, IEEE)
        else:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, NUM_SEGS):
                part = _seg_dot(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, s * SEG_LEN,
                                (s + 1) * SEG_LEN, M, N, K, stride_xm, stride_xk, stride_wn,
                                stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, TMA, EVEN_K, NUM_STAGES, IEEE)
                total = total + part
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            total = total + bias[None, :]
        op = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
        tl.store(op, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_segments_kernel(ws_ptr, out_ptr, bias_ptr, MN, N, stride_s,
                            NUM_SEGS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out = ((0 + p0) + p1) + ... (+ bias), rounded once. ws is [NUM_SEGS, M, N] contiguous."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(0, NUM_SEGS):  # unrolled: the loads in flight together, the adds in order
        total = total + tl.load(ws_ptr + s * stride_s + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# host side


def _tma_ok(x2: torch.Tensor, w: torch.Tensor) -> bool:
    if TensorDescriptor is None:
        return False
    for t in (x2, w):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def matmul(
    x2: torch.Tensor,
    w: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    k_segments: Optional[int] = None,
    config: Optional[GemmConfig] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """2-D invariant GEMM: ``x2[M, K] @ w[N, K].T (+ bias)`` -> ``[M, N]`` (no autograd)."""
    y, _ = _matmul(x2, w, bias, out_dtype, k_segments, config, out, keep_partials=False)
    return y


def matmul_partials(
    x2: torch.Tensor,
    w: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    k_segments: Optional[int] = None,
    config: Optional[GemmConfig] = None,
) -> tuple[torch.Tensor, bool]:
    """:func:`matmul`, except when the picked config is split mode: then ``(ws, True)``, the fp32
    segment partials ``ws[nseg, M, N]`` (contiguous, bias NOT added), which
    ``reduce_partials(ws, bias, out_dtype=...)`` turns into :func:`matmul`'s output bit for bit (a
    fused consumer adds them the same way). Otherwise ``(out, False)``, the finished ``[M, N]``."""
    return _matmul(x2, w, bias, out_dtype, k_segments, config, None, keep_partials=True)


def reduce_partials(ws: torch.Tensor, bias: Optional[torch.Tensor] = None, *, out_dtype: torch.dtype,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Split mode's second kernel: ``((0 + ws[0]) + ws[1]) + ...`` in fp32, ``+ bias`` in fp32, one
    rounding to ``out_dtype`` -> ``[M, N]``. ``ws``: contiguous fp32 ``[nseg, M, N]``."""
    if ws.dtype != torch.float32 or ws.dim() != 3 or not ws.is_contiguous():
        raise ValueError(f"reduce_partials: ws must be contiguous fp32 [nseg, M, N], got {tuple(ws.shape)} {ws.dtype}")
    nseg, M, N = ws.shape
    if out is None:
        out = torch.empty(M, N, device=ws.device, dtype=out_dtype)
    elif not out.is_contiguous() or tuple(out.shape) != (M, N):
        raise ValueError("reduce_partials: out must be a contiguous [M, N]")
    if M * N == 0:
        return out
    BLOCK = 1024
    _reduce_segments_kernel[(triton.cdiv(M * N, BLOCK),)](
        ws, out, bias if bias is not None else ws, M * N, N, ws.stride(0),
        NUM_SEGS=nseg, HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4)
    return out


def _matmul(x2, w, bias, out_dtype, k_segments, config, out, *, keep_partials: bool) -> tuple[torch.Tensor, bool]:
    M, K = x2.shape
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"matmul: x has K={K} but weight is {tuple(w.shape)}")
    if x2.dtype != w.dtype:
        raise ValueError(f"matmul: x dtype {x2.dtype} != weight dtype {w.dtype}")
    odt = out_dtype or x2.dtype
    nseg = default_k_segments(K, N) if k_segments is None else int(k_segments)
    if nseg < 1 or K % nseg:
        raise ValueError(f"matmul: K={K} is not divisible into k_segments={nseg}")
    seg_len = K // nseg
    cfg = config or pick_config(M, K, N, nseg)
    split = cfg.split and nseg > 1
    if out is None and not (keep_partials and split and M and N and K):  # handed-on partials need none
        out = torch.empty(M, N, device=x2.device, dtype=odt)
    if M == 0 or N == 0:
        return out, False
    if K == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(odt)
        return out, False
    block_k = cfg.block_k
    num_stages = cfg.num_stages
    if x2.element_size() == 4:  # fp32 operands: half the K tile, fewer stages (shared memory)
        block_k = max(16, block_k // 2)
        num_stages = min(num_stages, 3)
    if nseg > 1 and seg_len % block_k and not (cfg.mask_tail and seg_len > block_k):
        # segment boundaries should fall on BLOCK_K steps (bits are unaffected); a segment shorter
        # than 16 or not a multiple of it (e.g. a tiny model's 128-wide o_proj in 16 row-parallel
        # segments of 8) runs 16-wide tiles masked at the segment's end: the masked products are
        # exact zeros, and learner and engine run this same kernel
        bk_max, block_k = block_k, 16
        while block_k * 2 <= bk_max and seg_len % (block_k * 2) == 0:
            block_k *= 2
    even_k = seg_len % block_k == 0
    tma = cfg.tma and even_k and _tma_ok(x2, w)
    if tma:
        x_desc = TensorDescriptor.from_tensor(x2, [cfg.block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, block_k])
    else:
        x_desc = w_desc = None
    has_bias = bias is not None
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
                  TMA=tma, EVEN_K=even_k, NUM_STAGES=num_stages, num_warps=cfg.num_warps,
                  IEEE=x2.dtype == torch.float32, FLAT=cfg.flat and nseg > 1)
    if split:
        ws = torch.empty(nseg, M, N, device=x2.device, dtype=torch.float32)
        _gemm_kernel[(tiles, nseg)](
            x2, w, x_desc, w_desc, ws, ws, M, N, K, x2.stride(0), x2.stride(1), w.stride(0),
            w.stride(1), ws.stride(1), ws.stride(2), ws.stride(0), seg_len,
            NUM_SEGS=nseg, SPLIT=True, HAS_BIAS=False, **common)
        if keep_partials:  # the caller finishes the sum (and adds the bias) in its own kernel
            return ws, True
        if not out.is_contiguous():
            raise ValueError("matmul: out must be contiguous")
        reduce_partials(ws, bias, out_dtype=odt, out=out)
    else:
        _gemm_kernel[(tiles, 1)](
            x2, w, x_desc, w_desc, out, bias if has_bias else out, M, N, K, x2.stride(0),
            x2.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1), 0, seg_len,
            NUM_SEGS=nseg, SPLIT=False, HAS_BIAS=has_bias, **common)
    return out, False


class LinearGrad(torch.autograd.Function):
    """Forward: ``fwd(x, w, b)`` (the invariant GEMM). Backward: the two GEMMs of a linear layer in
    the weight's dtype with fp32 accumulation (cuBLAS), ``dx = dy @ w``, ``dw = dy.T @ x``,
    ``db = sum(dy)`` in fp32 -- what Megatron's own layers compute, with nothing of the forward run
    again (the gradient need not be batch invariant; it is deterministic). An fp32 ``dy`` (an
    fp32-output projection such as the lm_head) is rounded to the weight dtype first, as Megatron's
    output layer's gradient is."""

    @staticmethod
    def forward(ctx, x, w, b, fwd):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        ctx.bias_dtype = None if b is None else b.dtype
        return fwd(x, w, b)

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, w = ctx.saved_tensors
        N, K = w.shape
        g = gy.reshape(-1, N)
        gl = g.to(w.dtype)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (gl @ w).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = (gl.t() @ x.reshape(-1, K).to(w.dtype)).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return gx, gw, gb, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    k_segments: Optional[int] = None,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """Row-invariant ``x[..., K] @ weight[N, K].T + bias`` on CUDA -> ``[..., N]`` in ``out_dtype``.

    ``k_segments=None`` uses :func:`default_k_segments` (a function of (K, N) only); pass the
    row-parallel segment count explicitly to match the other side. Differentiable
    (:class:`LinearGrad`: a linear layer's backward GEMMs in the weight dtype, not invariant).
    """
    K = x.shape[-1]
    N = weight.shape[0]
    odt = out_dtype or x.dtype

    def fwd(x_, w_, b_):
        x2 = x_.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = matmul(x2, w_, b_, out_dtype=odt, k_segments=k_segments, config=config)
        return y.reshape(*x_.shape[:-1], N)

    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return LinearGrad.apply(x, weight, bias, fwd)
    with torch.no_grad():
        return fwd(x, weight, bias)
