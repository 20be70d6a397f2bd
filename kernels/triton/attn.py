"""Batch-invariant causal attention on the GPU (Triton): one fixed KV tile order for every query.

``attention(q[T, Hq, D], k[S, Hkv, D], v[S, Hkv, Dv], q_positions[T], scale)`` -> ``[T, Hq, Dv]``.
Queries of one call belong to one sequence; query t attends to keys 0..q_positions[t] (GQA: query
head h reads KV head h // (Hq // Hkv)). Same contract as the CPU reference (kernels/attn.py).

Order that decides the bits, the same in prefill, chunked prefill and decode:

* KV tiles of ``BLOCK_N = 64`` keys from key 0 upwards (no split-KV); a program stops after the tile
  holding its last query's position. For a query, tiles past its own position are fully masked and
  are exact no-ops (max unchanged, ``alpha = 1``, ``p = 0``), so the number of tiles a program runs
  does not change the query's bits, nor do keys or zero-padded slots past its position;
* scores: one fp32 ``tl.dot`` over D, then ``* scale``; masked scores are ``-inf`` -> ``p = 0``;
* online softmax: ``m_new = max(m, rowmax(s))``, ``alpha = exp(m - m_new)``, ``p = exp(s - m_new)``,
  ``l = l * alpha + rowsum(p)``, ``acc = acc * alpha + dot(p.to(v.dtype), v)`` (P is rounded to V's
  dtype for the P@V product, as in FlashAttention; both sides run this kernel);
* ``out = acc / l`` (IEEE division), rounded once.

Every K/V row a program reads up to its last tile must be finite (as on CPU).
Not bitwise equal to the CPU reference (bf16 P, different trees).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["attention", "BLOCK_N", "BLOCK_M"]

BLOCK_N = 64  # KV tile: fixed, part of the numerics contract
# Queries per program: fixed too. The row sums (tl.sum over the KV tile) reduce in an order set by
# the MMA output layout, which changes with BLOCK_M (measured on H200: BLOCK_M 16 vs 64 changed
# bits), so decode uses the same 64-query tile as prefill (its unused rows cost no memory traffic).
BLOCK_M = 64


@triton.jit(do_not_specialize=["T", "S"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, T, S,
                 sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h, scale,
                 GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for start in range(0, hi, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        kv_ok = rn < S
        k = tl.load(k_ptr + rn[:, None] * sk_s + kh * sk_h + rd[None, :],
                    mask=kv_ok[:, None] & (rd[None, :] < D), other=0.0)
        s = tl.dot(q, k.T) * scale
        valid = (rn[None, :] <= pos[:, None]) & kv_ok[None, :]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rn[:, None] * sv_s + kh * sv_h + rdv[None, :],
                    mask=kv_ok[:, None] & (rdv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = tl.math.div_rn(acc, l_safe[:, None])
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
    bm = BLOCK_M
    grid = (triton.cdiv(T, bm), Hq)
    _attn_kernel[grid](
        q, k_cache, v_cache, pos, out, T, S, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        float(scale), GROUP=Hq // Hkv, D=D, DV=Dv, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DV=triton.next_power_of_2(Dv), BLOCK_M=bm, BLOCK_N=BLOCK_N,
        num_warps=4, num_stages=2)
    return out
