"""Causal grouped-query attention whose per-token result is independent of batching and of
prefill / chunked prefill / decode.

Per query row (token t, query head h, position p = q_positions[t], kv head h // (Hq // Hkv)):

    s_j  = tree_sum_d(q[d] * k_j[d]) * scale        for every key j in the given KV (fp32)
    s_j  = -inf                                      where j > p  (causal mask)
    m    = max_j s_j                                 (exact)
    e_j  = exp(s_j - m)                              (masked keys give exactly 0)
    l    = tree_sum_j(e_j)
    o    = tree_sum_j(e_j * v_j) / l                 (fp32, then rounded once to out_dtype)

All sums are :func:`~kernels._common.tree_sum` (adjacent-pair trees), which are zero-extension
invariant: the masked keys beyond ``p`` contribute exact zeros, so the result is the same whether
the KV holds only the prefix (decode: S = p + 1), the whole sequence (prefill) or anything between
(chunked prefill). Requirement: every K/V row the call sees must be finite (zero-padding is fine;
uninitialised cache slots are not: ``0 * inf = nan``).

Dtype rules: q, k, v in fp32 or bf16; everything is computed in fp32 (bf16 products are exact);
the output is rounded once to ``out_dtype`` (default ``q.dtype``). The probabilities ``e`` stay in fp32
(a GPU version must not round P to bf16 before P @ V unless both sides do).

Supports Dv != Dqk (MLA; for absorbed MLA decode pass Hkv = 1 with k = [c_kv, k_pe], v = c_kv) and
any ``scale`` (applied to the fp32 dot product, not folded into q).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _native
from ._common import PRODUCT_BUDGET, tree_sum, with_reference_grad

__all__ = ["attention", "attention_packed", "causal_attention", "varlen_attention"]


def check_inputs(q, k, v, q_positions):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("attention: q [T,Hq,D], k [S,Hkv,D], v [S,Hkv,Dv] expected")
    T, Hq, D = q.shape
    S, Hkv, Dk = k.shape
    if Dk != D or v.shape[0] != S or v.shape[1] != Hkv:
        raise ValueError(f"attention: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if Hq % Hkv:
        raise ValueError(f"attention: Hq={Hq} not a multiple of Hkv={Hkv}")
    if q_positions.shape != (T,):
        raise ValueError("attention: q_positions must be [T]")
    if T and (int(q_positions.max()) >= S or int(q_positions.min()) < 0):
        raise ValueError("attention: every query position p needs keys 0..p in the KV (p < S)")


def _use_native(*ts) -> bool:
    return all(t.device.type == "cpu" and t.dtype != torch.float64 for t in ts) and _native.available()


def _f32(t: torch.Tensor) -> torch.Tensor:
    t = t.to(torch.float32)
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def _packed_fwd(q, k, v, q_start, nq, key_start, pos, scale, odt):
    """Several sequences in one compiled call (bitwise :func:`_attention_fwd_torch` per sequence)."""
    return _native.attention_packed(_f32(q), _f32(k), _f32(v), q_start, nq, key_start, pos, scale).to(odt)


def _attention_fwd(q, k, v, pos, scale, odt):
    if _use_native(q, k, v):
        return _packed_fwd(q, k, v, [0], [q.shape[0]], [0], pos, scale, odt)
    return _attention_fwd_torch(q, k, v, pos, scale, odt)


def _attention_fwd_torch(q, k, v, pos, scale, odt):
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    Dv = v.shape[-1]
    G = Hq // Hkv
    qf, kf, vf = q.to(torch.float32), k.to(torch.float32), v.to(torch.float32)
    out = torch.empty(T, Hq, Dv, dtype=torch.float32, device=q.device)
    if T == 0:
        return out.to(odt)
    key_idx = torch.arange(S, device=q.device)
    rows_pos = pos.repeat_interleave(G)  # row (t, g) -> position of token t
    rb = max(1, PRODUCT_BUDGET // max(1, S * max(D, Dv)))
    for h in range(Hkv):
        qt = qf[:, h * G : (h + 1) * G, :].reshape(T * G, D).t()  # [D, T*G]
        kt = kf[:, h, :].t()  # [D, S]
        vh = vf[:, h, :]  # [S, Dv]
        oh = torch.empty(T * G, Dv, dtype=torch.float32, device=q.device)
        for r0 in range(0, T * G, rb):
            r1 = min(T * G, r0 + rb)
            # reduced dimension leading: the tree adds contiguous blocks
            s = tree_sum(qt[:, r0:r1, None] * kt[:, None, :], dim=0) * scale  # [R, S]
            s = s.masked_fill(key_idx[None, :] > rows_pos[r0:r1, None], float("-inf"))
            m = s.amax(dim=-1, keepdim=True)
            e = torch.exp(s - m)
            l = tree_sum(e, dim=-1, keepdim=True)
            acc = tree_sum(e.t()[:, :, None] * vh[:, None, :], dim=0)  # [R, Dv]
            oh[r0:r1] = acc / l
        out[:, h * G : (h + 1) * G, :] = oh.view(T, G, Dv)
    return out.to(odt)


def attention_reference(q, k, v, pos, scale, odt):
    """Plain-torch reference (for gradients and tests)."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    G = Hq // Hkv
    qf = q.to(torch.float32).transpose(0, 1)  # [Hq, T, D]
    kf = k.to(torch.float32).repeat_interleave(G, dim=1).transpose(0, 1)  # [Hq, S, D]
    vf = v.to(torch.float32).repeat_interleave(G, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale
    mask = torch.arange(S, device=q.device)[None, :] > pos[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1).to(odt)


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Queries ``q[T, Hq, D]`` of ONE sequence at positions ``q_positions[T]`` attend causally to
    ``k_cache[S, Hkv, D]`` / ``v_cache[S, Hkv, Dv]`` (key j is at position j). Returns ``[T, Hq, Dv]``.

    The queries may be any subset of the sequence's positions in any order (a decode step, a chunk
    of a chunked prefill, the whole prompt); each row's bits are the same in every case.
    Differentiable (backward: plain softmax attention in fp32).
    """
    check_inputs(q, k_cache, v_cache, q_positions)
    odt = out_dtype or q.dtype
    pos = q_positions.to(torch.long)

    def fwd(q_, k_, v_):
        return _attention_fwd(q_, k_, v_, pos, scale, odt)

    def ref(q_, k_, v_):
        return attention_reference(q_, k_, v_, pos, scale, odt)

    return with_reference_grad(fwd, ref, q, k_cache, v_cache)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Learner helper: full-sequence causal attention ``q[B,S,Hq,D], k[B,S,Hkv,D], v[B,S,Hkv,Dv]``
    -> ``[B, S, Hq, Dv]``; token ``i`` of each sequence is at position ``i`` (right padding only).

    Bitwise equal, token by token, to :func:`attention` called with any subset of the queries.
    """
    B, S = q.shape[:2]
    pos = torch.arange(S, device=q.device)
    if B and S and _use_native(q, k, v):
        odt = out_dtype or q.dtype
        Hq, Hkv = q.shape[2], k.shape[2]
        starts = [b * S for b in range(B)]

        def fwd(q_, k_, v_):
            o = _packed_fwd(q_.reshape(B * S, Hq, -1), k_.reshape(B * S, Hkv, -1), v_.reshape(B * S, Hkv, -1),
                            starts, [S] * B, starts, pos.repeat(B), scale, odt)
            return o.reshape(B, S, Hq, -1)

        def ref(q_, k_, v_):  # the whole batch at once (gradients only: correct to rounding)
            G = Hq // Hkv
            qf = q_.to(torch.float32).transpose(1, 2)  # [B, Hq, S, D]
            kf = k_.to(torch.float32).repeat_interleave(G, dim=2).transpose(1, 2)
            vf = v_.to(torch.float32).repeat_interleave(G, dim=2).transpose(1, 2)
            s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
            mask = torch.ones(S, S, dtype=torch.bool, device=q_.device).triu(1)
            p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
            return torch.matmul(p, vf).transpose(1, 2).to(odt)

        return with_reference_grad(fwd, ref, q, k, v)
    outs = [attention(q[b], k[b], v[b], pos, scale, out_dtype=out_dtype) for b in range(B)]
    if not outs:
        return q.new_empty(0, S, q.shape[2], v.shape[-1], dtype=out_dtype or q.dtype)
    return torch.stack(outs, dim=0)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Packed sequences: ``q[Tq, Hq, D]``, ``k[Tk, Hkv, D]``, ``v[Tk, Hkv, Dv]``; sequence ``b`` owns
    query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.

    The queries of a sequence are its LAST ``n_q`` tokens: query ``j`` is at position
    ``n_k - n_q + j`` (vLLM's convention for prefill, chunked prefill and decode; the learner's
    packed THD layout has ``n_q == n_k``). Each row is bitwise what :func:`attention` gives.
    """
    cq = [int(c) for c in cu_seqlens_q]
    ck = [int(c) for c in cu_seqlens_k]
    if len(cq) != len(ck) or cq[0] != 0 or ck[0] != 0 or cq[-1] != q.shape[0] or ck[-1] != k.shape[0]:
        raise ValueError("varlen_attention: cu_seqlens_q/k must start at 0 and end at the token counts")
    nqs = [cq[b + 1] - cq[b] for b in range(len(cq) - 1)]
    nks = [ck[b + 1] - ck[b] for b in range(len(ck) - 1)]
    for b, (nq, nk) in enumerate(zip(nqs, nks)):
        if nq > nk:
            raise ValueError(f"varlen_attention: sequence {b} has more queries ({nq}) than keys ({nk})")
    if q.shape[0] and _use_native(q, k, v):
        odt = out_dtype or q.dtype
        pos = torch.cat([torch.arange(nk - nq, nk) for nq, nk in zip(nqs, nks)])

        def fwd(q_, k_, v_):
            return _packed_fwd(q_, k_, v_, cq[:-1], nqs, ck[:-1], pos, scale, odt)

        def ref(q_, k_, v_):
            return torch.cat([attention_reference(q_[cq[b]:cq[b + 1]], k_[ck[b]:ck[b + 1]], v_[ck[b]:ck[b + 1]],
                                             pos[cq[b]:cq[b + 1]], scale, odt) for b in range(len(nqs))])

        return with_reference_grad(fwd, ref, q, k, v)
    outs = []
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        pos = torch.arange(nk - nq, nk, device=q.device)
        outs.append(attention(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]], pos, scale,
                              out_dtype=out_dtype))
    if not outs:
        return q.new_empty(0, q.shape[1], v.shape[-1], dtype=out_dtype or q.dtype)
    return torch.cat(outs, dim=0)


def attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start,
    nq,
    key_start,
    q_positions: torch.Tensor,
    scale: float,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Many sequences in one call, each row bitwise what :func:`attention` gives for its sequence.

    Sequence ``i`` owns query rows ``q_start[i] : q_start[i] + nq[i]`` of ``q[T, Hq, D]`` and key /
    value rows ``key_start[i] + j`` of ``k[Sk, Hkv, D]`` / ``v[Sk, Hkv, Dv]`` (its key ``j`` is at
    position ``j``); query row ``t`` is at position ``q_positions[t]`` and sees keys ``0..q_positions[t]``
    of its own sequence (only those are read: other rows may hold anything). Rows not owned by any
    sequence come back as zeros. On the CPU this is one compiled call for the whole batch
    (:mod:`kernels._native`); otherwise one :func:`attention` per sequence.
    """
    odt = out_dtype or q.dtype
    qs = [int(a) for a in q_start]
    ns = [int(a) for a in nq]
    ks = [int(a) for a in key_start]
    pos = q_positions.to(torch.long)
    T = q.shape[0]
    if T and qs and _use_native(q, k, v):
        tiled = qs[0] == 0 and all(a + n == b for a, n, b in zip(qs, ns, qs[1:] + [T]))
        if tiled:  # the sequences own every row (the usual case)
            owned, posn = None, pos
        else:
            owned = torch.zeros(T, dtype=torch.bool)
            for a, n in zip(qs, ns):
                owned[a:a + n] = True
            posn = torch.where(owned, pos, torch.zeros_like(pos))  # unowned rows: any valid position

        def fwd(q_, k_, v_):
            o = _packed_fwd(q_, k_, v_, qs, ns, ks, posn, scale, odt)
            if owned is not None:
                o[~owned] = 0
            return o

        def ref(q_, k_, v_):
            o = torch.zeros(T, q_.shape[1], v_.shape[-1], dtype=odt)
            for a, n, kb in zip(qs, ns, ks):
                if n:
                    L = int(pos[a:a + n].max()) + 1
                    o[a:a + n] = attention_reference(q_[a:a + n], k_[kb:kb + L], v_[kb:kb + L], pos[a:a + n], scale, odt)
            return o

        return with_reference_grad(fwd, ref, q, k, v)
    out = q.new_zeros(T, q.shape[1], v.shape[-1], dtype=odt)
    for a, n, kb in zip(qs, ns, ks):
        if n:
            L = int(pos[a:a + n].max()) + 1
            out[a:a + n] = attention(q[a:a + n], k[kb:kb + L], v[kb:kb + L], pos[a:a + n], scale, out_dtype=odt)
    return out
