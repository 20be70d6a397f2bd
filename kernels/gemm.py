"""Row-invariant linear layer: ``y = x @ W.T (+ b)``.

Dtype rules
-----------
* ``x`` and ``W`` may be fp32 or bf16 (fp16 works too). Both are converted to fp32; products of two
  bf16 numbers are exact in fp32. (float64 inputs are computed in float64 throughout: only for
  references and gradcheck.)
* Each output element is the :func:`~kernels._common.tree_sum` over K of the fp32 products
  ``x[m, k] * W[n, k]``: a fixed adjacent-pair binary tree whose shape depends on K only (or on the
  K segment length, see ``k_segments``).
* The bias (converted to fp32) is added after the K reduction, then the result is rounded once to
  ``out_dtype`` (default: ``x.dtype``).

Invariance
----------
Every output element is computed by the same sequence of IEEE fp32 operations whatever M (batch
size), the row's position, the other rows, N (so a column-parallel / merged gate-up split gives the
same bits as the full weight), the thread count or the memory alignment of the tensors. No BLAS call
is involved; a CPU ``torch.mm`` is *not* invariant in N or in the thread count (see README).

Tensor parallelism
------------------
A row-parallel linear splits K across ranks. ``linear(x, W, k_segments=s)`` reduces each of the
``s`` equal K segments with its own tree and adds the fp32 segment partials in segment order
(:func:`sum_partials`). Rank ``r`` of a TP group of size ``t`` (``t`` dividing ``s``) holds K columns
``r*K/t .. (r+1)*K/t``, i.e. segments ``r*s/t .. (r+1)*s/t - 1``, and computes one
``linear_partial`` per segment; gathering every rank's partials in rank order (= segment order) and
calling :func:`sum_partials` then :func:`finish_linear` gives bitwise the one-rank
``linear(x, W, k_segments=s)``. A plain all-reduce does not. Every row-parallel projection uses
``s = ROW_PARALLEL_K_SEGMENTS`` (8), whatever the TP degree (docs/tp.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from . import _native
from ._common import PRODUCT_BUDGET, fold_sum, tree_sum, with_reference_grad

__all__ = ["linear", "linear_partial", "sum_partials", "finish_linear"]



# The row-parallel contract (docs/tp.md): every row-parallel projection (attention o_proj, MLA and
# KDA output, DSv4 grouped output wo_b, every dense / shared / routed-expert down_proj) reduces K in
# this many equal segments (width K / 8), the fp32 segment partials added in segment order, on BOTH
# sides (learner and engine). The segmentation is fixed, independent of the TP degree: a TP=t rank
# computes the 8/t segments of its K shard, the partials are gathered and added in order, which is
# bitwise the one-rank result. 8 = every single-node TP (1, 2, 4, 8 all divide it); every
# row-parallel K of a supported model must be a multiple of 8 (megatron_rz.learner.aligned_spec
# .check_aligned_supported says which recipe key is not).
ROW_PARALLEL_K_SEGMENTS = 8

def _acc_dtype(*ts: Optional[torch.Tensor]) -> torch.dtype:
    """fp32, or float64 when an input is float64 (for gradcheck-style references)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def partial_fp32(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] = tree over K of x2[M, K] * w[N, K] (both already in the accumulation dtype).

    fp32 CPU tensors go to the compiled kernel (:mod:`kernels._native`: the same operations in the
    same order, so the same bits) when it is available; anything else to the torch code below.
    """
    if (x2.dtype == torch.float32 and w.dtype == torch.float32 and x2.device.type == "cpu"
            and w.device.type == "cpu" and _native.available()):
        return _native.gemm(x2, w)
    return _partial_fp32_torch(x2, w)


def _partial_fp32_torch(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch reference of :func:`partial_fp32`: explicit products, :func:`tree_sum` over K."""
    M, K = x2.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    xt = x2.t()  # [K, M]
    wt = w.t()  # [K, N]
    nb = max(1, min(N, PRODUCT_BUDGET // K))
    mb = max(1, min(M, PRODUCT_BUDGET // (K * nb)))
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        xa = xt[:, m0:m1, None]
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            prod = xa * wt[:, None, n0:n1]  # [K, mb, nb], exact products rounded once
            out[m0:m1, n0:n1] = tree_sum(prod, dim=0)
    return out


def linear_partial(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 partial ``x @ weight.T`` over this K shard, not rounded, no bias: ``[..., N]``.

    Use on each rank of a row-parallel layer; combine with :func:`sum_partials` (in rank order) and
    :func:`finish_linear`. Not differentiable through the invariant path (no autograd wrapper).
    """
    K = x.shape[-1]
    if weight.shape[-1] != K:
        raise ValueError(f"linear: x has K={K} but weight is {tuple(weight.shape)}")
    acc = _acc_dtype(x, weight)
    x2 = x.reshape(-1, K).to(acc)
    w = weight.to(acc)
    with torch.no_grad():
        out = partial_fp32(x2, w)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def sum_partials(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Add fp32 partials in list (= rank / K-segment) order: ``((p0 + p1) + p2) + ...``."""
    return fold_sum(list(partials))


def finish_linear(
    acc: torch.Tensor, bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Add the bias in fp32 after the K reduction and round once to ``out_dtype``."""
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    return acc.to(out_dtype)


def _segments(K: int, k_segments: int) -> list[tuple[int, int]]:
    if k_segments < 1 or K % k_segments:
        raise ValueError(f"linear: K={K} is not divisible into k_segments={k_segments}")
    s = K // k_segments
    return [(i * s, (i + 1) * s) for i in range(k_segments)]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    k_segments: int = 1,
) -> torch.Tensor:
    """Row-invariant ``x[..., K] @ weight[N, K].T + bias[N]`` -> ``[..., N]`` in ``out_dtype``.

    ``k_segments``: split K into this many equal segments reduced separately and added in order
    (1 = one tree over all of K; row-parallel projections pass ``ROW_PARALLEL_K_SEGMENTS`` on both
    sides, whatever their TP degree).
    Differentiable (backward: plain ``F.linear`` in fp32).
    """
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"linear: x has K={K} but weight is {tuple(weight.shape)}")
    N = weight.shape[0]
    odt = out_dtype or x.dtype
    segs = _segments(K, k_segments)

    acc = _acc_dtype(x, weight, bias)

    def fwd(x_, w_, b_):
        x2 = x_.reshape(-1, K).to(acc)
        w32 = w_.to(acc)
        parts = [partial_fp32(x2[:, a:b], w32[:, a:b]) for a, b in segs]
        y = finish_linear(sum_partials(parts), b_, odt)
        return y.reshape(*x_.shape[:-1], N)

    def ref(x_, w_, b_):
        y = F.linear(x_.to(acc), w_.to(acc), None if b_ is None else b_.to(acc))
        return y.to(odt)

    return with_reference_grad(fwd, ref, x, weight, bias)
