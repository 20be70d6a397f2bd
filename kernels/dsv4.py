"""Aligned ops that DeepSeek-V4 adds over V3 (same contract as the other kernels).

Every op's per-token result depends only on that token's inputs and, for attention and the
compressors, on its own sequence's earlier tokens at their absolute positions; never on the batch,
on how many tokens follow, or on prefill vs decode. Built only from the invariant pieces of
``_common`` (elementwise IEEE ops, ``exp``/``log``, exact selections, :func:`tree_sum`) and the
row-invariant :func:`kernels.gemm.linear`:

* :func:`hc_mix`, :func:`hc_expand`, :func:`hc_head`: manifold-constrained hyper-connections (the
  residual is ``hc_mult`` streams mixed by a Sinkhorn-normalised matrix);
* :func:`compress_windows`: gated pooling of ``ratio`` consecutive tokens into one compressed KV entry
  (heavily compressed attention), or of two overlapping windows (compressed sparse attention and its
  indexer);
* :func:`indexer_scores`, :func:`select_entries`: the lightning indexer's per-query top-k of the
  compressed entries (ties broken by the lower entry index, so the choice is deterministic);
* :func:`sink_attention`: one query row against a sliding window of per-token keys plus its chosen
  compressed entries plus a per-head sink logit, K = V (single shared KV head);
* :func:`sqrtsoftplus`, :func:`swiglu_clamped`: the V4 router score and expert activation.

Sliding keys are addressed by absolute position and compressed entries by entry index, and every sum
is a zero-extension invariant tree, so a row attends the same way whether the history holds the whole
training sequence (learner) or only the prefix the rollout engine has cached.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import PRODUCT_BUDGET, tree_sum, with_reference_grad
from .gemm import linear
from .moe import silu
from .norm import rms_norm

__all__ = [
    "sigmoid",
    "hc_mix",
    "hc_expand",
    "hc_head",
    "compress_windows",
    "indexer_scores",
    "select_entries",
    "sink_attention",
    "sqrtsoftplus",
    "swiglu_clamped",
]

_NEG_INF = float("-inf")


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in fp32 (torch.sigmoid's vector and scalar paths differ by an ulp)."""
    return 1.0 / (1.0 + torch.exp(-x.to(torch.float32)))


def _softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / tree_sum(e, dim=dim, keepdim=True)


# --------------------------------------------------------------------------------------------------
# Hyper-connections
# --------------------------------------------------------------------------------------------------


def hc_mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams[T, n, D]`` -> ``(post [T, n] fp32, comb [T, n, n] fp32, collapsed [T, D])``.

    One linear map of the RMS-normalised flattened streams gives the collapse weights ``pre``
    (sigmoid + eps), the expansion weights ``post`` (2 sigmoid) and the stream-mixing matrix ``comb``
    (softmax + eps, then Sinkhorn: columns, then ``sinkhorn_iters - 1`` row/column rounds)."""
    T, n, D = streams.shape
    flat = rms_norm(streams.reshape(T, n * D).to(torch.float32), None, norm_eps)
    mixes = linear(flat, fn, out_dtype=torch.float32)
    b = base.to(torch.float32)
    s = scale.to(torch.float32)
    pre = sigmoid(mixes[:, :n] * s[0] + b[:n]) + eps
    post = 2.0 * sigmoid(mixes[:, n : 2 * n] * s[1] + b[n : 2 * n])
    comb = mixes[:, 2 * n :].reshape(T, n, n) * s[2] + b[2 * n :].reshape(n, n)
    comb = _softmax(comb, dim=-1) + eps
    comb = comb / (tree_sum(comb, dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tree_sum(comb, dim=-1, keepdim=True) + eps)
        comb = comb / (tree_sum(comb, dim=-2, keepdim=True) + eps)
    collapsed = tree_sum(pre.unsqueeze(-1) * streams.to(torch.float32), dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``[T, n, D]``: stream k = ``post[k] * out + sum_j comb[j, k] * streams[j]``
    (computed in the streams' dtype, as the reference model does)."""
    dt = streams.dtype
    mixed = tree_sum(comb.to(dt).unsqueeze(-1) * streams.unsqueeze(2), dim=1)  # [T, n(k), D]
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def hc_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float, norm_eps: float
) -> torch.Tensor:
    """Final collapse of the streams ``[T, n, D]`` -> ``[T, D]`` (sigmoid weights + eps)."""
    T, n, D = streams.shape
    flat = rms_norm(streams.reshape(T, n * D).to(torch.float32), None, norm_eps)
    mixes = linear(flat, fn, out_dtype=torch.float32)
    pre = sigmoid(mixes * scale.to(torch.float32) + base.to(torch.float32)) + eps
    return tree_sum(pre.unsqueeze(-1) * streams.to(torch.float32), dim=1).to(streams.dtype)


# --------------------------------------------------------------------------------------------------
# Compressed KV entries and the lightning indexer
# --------------------------------------------------------------------------------------------------


def compress_windows(
    kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, *, overlap: bool
) -> torch.Tensor:
    """Pool the complete windows of one sequence's per-token projections ``kv, gate [S, C]`` into
    compressed entries ``[S // ratio, d]`` (fp32, before the entry norm and RoPE).

    Entry ``w`` = sum over slots of ``softmax_slots(gate + ape) * kv``. Without ``overlap`` the slots
    are window w's ``ratio`` tokens (d = C). With ``overlap`` (C = 2d) they are window w-1's first
    halves then window w's second halves (2 * ratio slots; window 0's missing predecessor slots get
    weight 0). Depends on tokens of windows w-1 and w only."""
    S, C = kv.shape
    n = S // ratio
    k = kv[: n * ratio].to(torch.float32).reshape(n, ratio, C)
    g = gate[: n * ratio].to(torch.float32).reshape(n, ratio, C) + ape.to(torch.float32)
    if overlap:
        d = C // 2
        prev_k = k.new_zeros(n, ratio, d)
        prev_g = g.new_full((n, ratio, d), _NEG_INF)
        if n > 1:
            prev_k[1:] = k[:-1, :, :d]
            prev_g[1:] = g[:-1, :, :d]
        k = torch.cat([prev_k, k[:, :, d:]], dim=1)
        g = torch.cat([prev_g, g[:, :, d:]], dim=1)
    return tree_sum(k * _softmax(g, dim=1), dim=1)


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """``sum_h weights[t, h] * relu(q[t, h] . keys[s]) * softmax_scale`` -> ``[T, N]`` fp32.

    ``q [T, Hi, Di]``, ``weights [T, Hi]`` fp32, ``keys [N, Di]``."""
    T, Hi, Di = q.shape
    N = keys.shape[0]
    if N == 0:
        return q.new_zeros(T, 0, dtype=torch.float32)
    dots = linear(q.reshape(T * Hi, Di).to(torch.float32), keys.to(torch.float32), out_dtype=torch.float32)
    s = torch.clamp_min(dots, 0.0).reshape(T, Hi, N) * softmax_scale
    return tree_sum(s * weights.to(torch.float32).unsqueeze(-1), dim=1)


def select_entries(scores: torch.Tensor, n_ready: torch.Tensor, topk: int) -> torch.Tensor:
    """Boolean ``[T, N]``: entry s is kept for query t iff ``s < n_ready[t]`` (its window is complete
    before the query) and it is among the ``topk`` best-scoring such entries (ties: lower index).

    Entries at or beyond ``n_ready`` never change the choice, so the result for a query does not
    depend on how many entries the caller's history holds."""
    T, N = scores.shape
    ready = torch.arange(N, device=scores.device)[None, :] < n_ready[:, None]
    keep = torch.zeros(T, N, dtype=torch.bool, device=scores.device)
    if N == 0:
        return keep
    masked = scores.masked_fill(~ready, _NEG_INF)
    _, order = torch.sort(masked, dim=-1, descending=True, stable=True)
    keep.scatter_(1, order[:, : min(topk, N)], True)
    return keep & ready


# --------------------------------------------------------------------------------------------------
# Attention: sliding window + compressed entries + sink
# --------------------------------------------------------------------------------------------------


def _sink_attention_fwd(q, pos, kv, window, comp, comp_keep, sinks, scale, odt):
    T, H, D = q.shape
    S = kv.shape[0]
    N = 0 if comp is None else comp.shape[0]
    qf = q.to(torch.float32)
    kf = kv.to(torch.float32)
    cf = None if comp is None else comp.to(torch.float32)
    sk = sinks.to(torch.float32)
    key_pos = torch.arange(S, device=q.device)
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    rows = max(1, PRODUCT_BUDGET // max(1, H * max(S, N, 1) * D))
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        qr = qf[r0:r1]  # [R, H, D]
        p = pos[r0:r1, None]
        s1 = tree_sum(qr.unsqueeze(2) * kf[None, None], dim=-1) * scale  # [R, H, S]
        hide = (key_pos[None, :] > p) | (key_pos[None, :] <= p - window)  # [R, S]
        s1 = s1.masked_fill(hide[:, None, :], _NEG_INF)
        m = torch.maximum(s1.amax(dim=-1), sk[None, :])  # [R, H]
        if N:
            s2 = tree_sum(qr.unsqueeze(2) * cf[None, None], dim=-1) * scale  # [R, H, N]
            s2 = s2.masked_fill(~comp_keep[r0:r1, None, :], _NEG_INF)
            m = torch.maximum(m, s2.amax(dim=-1))
        e1 = torch.exp(s1 - m[..., None])
        den = tree_sum(e1, dim=-1)
        num = tree_sum(e1.unsqueeze(-1) * kf[None, None], dim=2)  # [R, H, D]
        if N:
            e2 = torch.exp(s2 - m[..., None])
            den = den + tree_sum(e2, dim=-1)
            num = num + tree_sum(e2.unsqueeze(-1) * cf[None, None], dim=2)
        den = den + torch.exp(sk[None, :] - m)
        out[r0:r1] = num / den[..., None]
    return out.to(odt)


def _sink_attention_ref(q, pos, kv, window, comp, comp_keep, sinks, scale, odt):
    S = kv.shape[0]
    keys = kv.to(torch.float32)
    key_pos = torch.arange(S, device=q.device)
    hide = (key_pos[None, :] > pos[:, None]) | (key_pos[None, :] <= pos[:, None] - window)
    if comp is not None and comp.shape[0]:
        keys = torch.cat([keys, comp.to(torch.float32)], dim=0)
        hide = torch.cat([hide, ~comp_keep], dim=1)
    s = torch.einsum("thd,sd->ths", q.to(torch.float32), keys) * scale
    s = s.masked_fill(hide[:, None, :], _NEG_INF)
    sink = sinks.to(torch.float32)[None, :, None].expand(s.shape[0], -1, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("ths,sd->thd", p, keys).to(odt)


def sink_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    kv: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    *,
    window: int,
    comp: Optional[torch.Tensor] = None,
    comp_keep: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Queries ``q[T, H, D]`` of ONE sequence at ``q_positions[T]`` attend to the per-token keys
    ``kv[S, D]`` (key j at position j; K = V) within the causal sliding window
    ``p - window < j <= p``, to the compressed entries ``comp[N, D]`` where ``comp_keep[T, N]``, and
    to a per-head sink logit ``sinks[H]`` that takes probability mass but has no value.

    Per row: logits by tree dot products, one max over all three parts, then
    ``(tree(e1 v1) + tree(e2 v2)) / ((tree(e1) + tree(e2)) + e_sink)``. Differentiable (backward:
    plain softmax attention)."""
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"sink_attention: q [T,H,D], kv [S,D] expected, got {tuple(q.shape)}, {tuple(kv.shape)}")
    if (comp is None) != (comp_keep is None):
        raise ValueError("sink_attention: pass comp and comp_keep together")
    odt = out_dtype or q.dtype
    pos = q_positions.to(torch.long)
    if q.shape[0] and int(pos.max()) >= kv.shape[0]:
        raise ValueError("sink_attention: every query position p needs keys 0..p")

    def fwd(q_, kv_, comp_, sinks_):
        return _sink_attention_fwd(q_, pos, kv_, window, comp_, comp_keep, sinks_, scale, odt)

    def ref(q_, kv_, comp_, sinks_):
        return _sink_attention_ref(q_, pos, kv_, window, comp_, comp_keep, sinks_, scale, odt)

    return with_reference_grad(fwd, ref, q, kv, comp, sinks)


# --------------------------------------------------------------------------------------------------
# Router score and expert activation
# --------------------------------------------------------------------------------------------------


def sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x))`` in fp32 from ``exp``/``log`` (F.softplus's vector and scalar paths
    differ). ``log1p(e)`` as ``log(u) * e / (u - 1)`` with ``u = 1 + e`` (Goldberg's trick: accurate
    when ``e`` is tiny, where ``log(1 + e)`` alone loses most digits); ``softplus = x`` above 20."""
    x = x.to(torch.float32)
    e = torch.exp(torch.clamp(x, max=20.0))
    u = 1.0 + e
    d = u - 1.0
    log1p = torch.where(d == 0, e, torch.log(u) * (e / torch.where(d == 0, torch.ones_like(d), d)))
    return torch.sqrt(torch.where(x > 20.0, x, log1p))


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32, rounded to ``gate.dtype``."""
    g = torch.clamp(gate.to(torch.float32), max=limit)
    u = torch.clamp(up.to(torch.float32), min=-limit, max=limit)
    return (silu(g) * u).to(gate.dtype)
