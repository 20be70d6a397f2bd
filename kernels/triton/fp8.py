"""Blockwise FP8 on the GPU (Triton): per-1x128-group activation quantiser and a batch-invariant
block-scaled GEMM. Formats and formulas: kernels/fp8.py (the exact reference).

* ``quantize_act_groupwise(x)``: one program per (row, 8 groups); ``amax`` exact, IEEE ``div_rn``,
  clamp, round-to-nearest-even cast to e4m3. Bitwise equal to the CPU reference (tested).
* ``fp8_gemm(xq, xs, wq, ws)``: K walked in 128-blocks in ascending order; per block one fp32
  tensor-core dot of the e4m3 tiles started from zero, then ``acc = acc + d * (xs * ws)`` on the CUDA
  cores (fp32, FMA contraction off; ``s = xs[m] * ws`` is one product per row): DeepSeek-V3's promotion of the FP8 partial sum every 128 K, in a
  fixed order. No split-K, no atomics; BLOCK_K = 128 is part of the numerics, the M/N tile is chosen
  per M freely (all configs give the same bits; tested), so a row's result never depends on the
  batch. (Each block's dot is one FP8 wgmma chain; BLOCK_M is kept >= 64 so every config uses wgmma.)
* ``fp8_gemm(..., k_segments=s)``, ``s > 1`` (row-parallel layers, docs/tp.md "FP8"): K in ``s`` equal
  segments of whole 128-blocks; each segment's blocks chained as above into their own fp32 partial
  started from zero, each partial folded into a running total at its segment's end (the first one
  becomes the total, then ``total = total + part``: ``kernels.sum_partials``'s order), then bias and one
  rounding. ``s = 1`` runs the single-chain code unchanged. (Untested on a GPU at the time of writing:
  tests/gpu/test_triton_fp8.py::test_fp8_gemm_k_segments checks it against the per-segment partials.)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover
    TensorDescriptor = None

from ..fp8 import ACT_EPS, BLOCK, FP8_DTYPE, FP8_MAX

__all__ = ["quantize_act_groupwise", "fp8_gemm", "fp8_linear", "Fp8Config", "FP8_CONFIGS", "pick_fp8_config"]


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, NG, stride_x, stride_q, stride_s, eps, fmax,
                      GROUP: tl.constexpr, GPP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * GPP
    rg = g0 + tl.arange(0, GPP)
    rc = tl.arange(0, GROUP)
    col = rg[:, None] * GROUP + rc[None, :]
    m = (rg[:, None] < NG) & (col < K)
    x = tl.load(x_ptr + row * stride_x + col, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, eps), tl.full(amax.shape, 1.0, tl.float32) * fmax)
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    y = tl.minimum(tl.maximum(y, -fmax), fmax)
    tl.store(q_ptr + row * stride_q + col, y.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + row * stride_s + rg, scale, mask=rg < NG)


def quantize_act_groupwise(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., K]`` (CUDA) -> ``(xq e4m3 [..., K], xs fp32 [..., ceil(K/128)])``; no autograd."""
    if group != BLOCK:
        raise ValueError("quantize_act_groupwise: only 128-wide groups")
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    ng = triton.cdiv(K, group)
    q = torch.empty(R, K, device=x.device, dtype=FP8_DTYPE)
    s = torch.empty(R, ng, device=x.device, dtype=torch.float32)
    if R and K:
        gpp = 8
        _act_quant_kernel[(R, triton.cdiv(ng, gpp))](
            x2, q, s, K, ng, x2.stride(0), q.stride(0), s.stride(0), ACT_EPS, FP8_MAX,
            GROUP=group, GPP=gpp, num_warps=4, enable_fp_fusion=False)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], ng)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    pipe: bool = False
    group_m: int = 8

    @property
    def name(self) -> str:
        return (f"{self.block_m}x{self.block_n}x128_w{self.num_warps}_s{self.num_stages}{'_tma' if self.tma else ''}"
                f"{'_pipe' if self.pipe else ''}")


# every config gives the same bits (tests/gpu/test_triton_fp8.py)
FP8_CONFIGS = {
    "d64_n64": Fp8Config(64, 64, 4, 4),
    "d64_n128": Fp8Config(64, 128, 4, 4),
    "m64_n128_tma": Fp8Config(64, 128, 4, 4, tma=True),
    "m64_n128_tma_pipe": Fp8Config(64, 128, 4, 4, tma=True, pipe=True),
    "p128_n128_tma": Fp8Config(128, 128, 8, 4, tma=True),
    "p128_n128_tma_pipe": Fp8Config(128, 128, 8, 4, tma=True, pipe=True),
    "p128_n128_tma_s3_pipe": Fp8Config(128, 128, 8, 3, tma=True, pipe=True),
    "p128_n64_tma_pipe": Fp8Config(128, 64, 4, 4, tma=True, pipe=True),
    "p256_n128_tma_pipe": Fp8Config(256, 128, 8, 3, tma=True, pipe=True),
    "p128_n128": Fp8Config(128, 128, 8, 4),
}


def pick_fp8_config(M: int, N: int, K: int) -> Fp8Config:
    """Any config gives the same bits; choose by M (decode: more programs along N)."""
    if M <= 64:
        return FP8_CONFIGS["d64_n64"] if N <= 8192 else FP8_CONFIGS["d64_n128"]
    if M <= 256:
        return FP8_CONFIGS["m64_n128_tma"]
    return FP8_CONFIGS["p128_n128_tma"]


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
def _load_ab(a_ptr, b_ptr, a_desc, b_desc, off_m, off_n, rm, rn, mask_m, mask_n, k, K, stride_am, stride_bn,
             BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        a = a_desc.load([off_m, k])
        b = b_desc.load([off_n, k])
    else:
        kk = k + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[:, None].to(tl.int64) * stride_bn + kk[None, :],
                    mask=mask_n[:, None] & (kk[None, :] < K), other=0.0)
    return a, b


@triton.jit
def _seg_chain(a_ptr, b_ptr, a_desc, b_desc, as_ptr, bs_ptr, off_m, off_n, rm, rn, mask_m, mask_n, nb, kb0, kb1, K,
               stride_am, stride_bn, stride_asm, stride_bsn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, TMA: tl.constexpr, NUM_STAGES: tl.constexpr):
    """fp32 chain of K blocks kb0 .. kb1-1 from zero: ``part = part + d * (xs * ws)`` in ascending order."""
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        a, b = _load_ab(a_ptr, b_ptr, a_desc, b_desc, off_m, off_n, rm, rn, mask_m, mask_n, kb * BLOCK_K, K,
                        stride_am, stride_bn, BLOCK_K, TMA)
        d = tl.dot(a, b.T)
        sc = tl.load(as_ptr + rm * stride_asm + kb, mask=mask_m, other=0.0) * tl.load(bs_ptr + nb * stride_bsn + kb)
        part = part + d * sc[:, None]
    return part


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, b_ptr, a_desc, b_desc, as_ptr, bs_ptr, out_ptr, bias_ptr, M, N, K,
                     stride_am, stride_bn, stride_asm, stride_bsn, stride_om, stride_on,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
                     NUM_STAGES: tl.constexpr, PIPE: tl.constexpr, K_SEGMENTS: tl.constexpr = 1):
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    nb = off_n // BLOCK_K  # BLOCK_N divides the 128-row weight block: one weight scale per K block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    KB = tl.cdiv(K, BLOCK_K)
    if K_SEGMENTS > 1:
        # row-parallel form: segment 0's chain is the running total; each later segment's chain
        # (from zero) is added to it at the segment's end, in segment order (host: K % (s*128) == 0)
        SB = KB // K_SEGMENTS
        acc = _seg_chain(a_ptr, b_ptr, a_desc, b_desc, as_ptr, bs_ptr, off_m, off_n, rm, rn, mask_m, mask_n, nb,
                         0, SB, K, stride_am, stride_bn, stride_asm, stride_bsn, BLOCK_M, BLOCK_N, BLOCK_K, TMA,
                         NUM_STAGES)
        for seg in range(1, K_SEGMENTS):
            part = _seg_chain(a_ptr, b_ptr, a_desc, b_desc, as_ptr, bs_ptr, off_m, off_n, rm, rn, mask_m, mask_n,
                              nb, seg * SB, (seg + 1) * SB, K, stride_am, stride_bn, stride_asm, stride_bsn,
                              BLOCK_M, BLOCK_N, BLOCK_K, TMA, NUM_STAGES)
            acc = acc + part
    elif PIPE:
        # the dot of block kb is issued before block kb-1 is promoted (same operations, same order)
        a, b = _load_ab(a_ptr, b_ptr, a_desc, b_desc, off_m, off_n, rm, rn, mask_m, mask_n, 0, K,
                        stride_am, stride_bn, BLOCK_K, TMA)
        d_prev = tl.dot(a, b.T)
        s_prev = tl.load(as_ptr + rm * stride_asm, mask=mask_m, other=0.0) * tl.load(bs_ptr + nb * stride_bsn)
        for kb in tl.range(1, KB, num_stages=NUM_STAGES):
            a, b = _load_ab(a_ptr, b_ptr, a_desc, b_desc, off_m, off_n, rm, rn, mask_m, mask_n, kb * BLOCK_K, K,
                            stride_am, stride_bn, BLOCK_K, TMA)
            d = tl.dot(a, b.T)
            acc = acc + d_prev * s_prev[:, None]
            d_prev = d
            s_prev = tl.load(as_ptr + rm * stride_asm + kb, mask=mask_m, other=0.0) * \
                tl.load(bs_ptr + nb * stride_bsn + kb)
        acc = acc + d_prev * s_prev[:, None]
    else:
        for kb in tl.range(0, KB, num_stages=NUM_STAGES):
            a, b = _load_ab(a_ptr, b_ptr, a_desc, b_desc, off_m, off_n, rm, rn, mask_m, mask_n, kb * BLOCK_K, K,
                            stride_am, stride_bn, BLOCK_K, TMA)
            d = tl.dot(a, b.T)
            sc = tl.load(as_ptr + rm * stride_asm + kb, mask=mask_m, other=0.0) * tl.load(bs_ptr + nb * stride_bsn + kb)
            acc = acc + d * sc[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _tma_ok(*ts: torch.Tensor) -> bool:
    if TensorDescriptor is None:
        return False
    for t in ts:
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
             bias: Optional[torch.Tensor] = None, *, out_dtype: torch.dtype = torch.bfloat16,
             config: Optional[Fp8Config] = None, k_segments: int = 1) -> torch.Tensor:
    """Block-scaled GEMM of quantised operands (CUDA): ``xq[M, K]``, ``xs[M, ceil(K/128)]``,
    ``wq[N, K]``, ``ws[ceil(N/128), ceil(K/128)]`` -> ``[M, N]`` in ``out_dtype``. No autograd.
    ``k_segments > 1``: the row-parallel form (module docstring; K a multiple of k_segments * 128)."""
    M, K = xq.shape
    N = wq.shape[0]
    if wq.shape[1] != K:
        raise ValueError("fp8_gemm: K mismatch")
    if k_segments != 1:
        from ..fp8 import fp8_segments

        fp8_segments(K, k_segments)  # raises unless K splits into whole 128-blocks per segment
    cfg = config or pick_fp8_config(M, N, K)
    if BLOCK % cfg.block_n:
        raise ValueError("fp8_gemm: BLOCK_N must divide 128")
    out = torch.empty(M, N, device=xq.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    xs = xs.to(torch.float32)
    ws = ws.to(torch.float32)
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    tma = cfg.tma and K % BLOCK == 0 and _tma_ok(xq, wq)
    if tma:
        a_desc = TensorDescriptor.from_tensor(xq, [cfg.block_m, BLOCK])
        b_desc = TensorDescriptor.from_tensor(wq, [cfg.block_n, BLOCK])
    else:
        a_desc = b_desc = None
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        xq, wq, a_desc, b_desc, xs, ws, out, bias if bias is not None else out, M, N, K,
        xq.stride(0), wq.stride(0), xs.stride(0), ws.stride(0), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK,
        GROUP_M=cfg.group_m, TMA=tma, NUM_STAGES=cfg.num_stages, PIPE=cfg.pipe, K_SEGMENTS=k_segments,
        num_warps=cfg.num_warps, enable_fp_fusion=False)
    return out


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               out_dtype: Optional[torch.dtype] = None, config: Optional[Fp8Config] = None,
               weight: Optional[torch.Tensor] = None, k_segments: int = 1) -> torch.Tensor:
    """Quantise ``x[..., K]`` per 1x128 group, then :func:`fp8_gemm`. Gradient: straight-through
    (``F.linear`` with the dequantised weight; ``weight``, the master weight, gets its gradient too),
    as the CPU reference."""
    from .._common import with_reference_grad
    from ..fp8 import ste_reference

    K = x.shape[-1]
    N = wq.shape[0]
    odt = out_dtype or (x.dtype if x.dtype != torch.float32 else torch.float32)

    def fwd(x_, b_, w_=None):
        xq, xs = quantize_act_groupwise(x_.reshape(-1, K))
        return fp8_gemm(xq, xs, wq, ws, b_, out_dtype=odt, config=config,
                        k_segments=k_segments).reshape(*x_.shape[:-1], N)

    return with_reference_grad(fwd, ste_reference(wq, ws, odt), x, bias, weight)
