"""Mixture-of-experts pieces: SwiGLU expert MLP, token dispatch, fixed-order top-k combine.

Dtype rules:
* Every projection is the row-invariant :func:`~kernels.gemm.linear`, rounded to the activation
  dtype (bf16 model -> bf16 gate/up/down outputs; fp32 model -> fp32).
* ``silu(g) * u`` is computed in fp32 as ``g / (1 + exp(-g)) * u`` (``torch.sigmoid``/``F.silu`` are
  avoided: their vectorised and scalar CPU paths differ in fp32) and rounded once to the activation
  dtype before the down projection.
* :func:`moe_combine` accumulates in fp32 in a fixed order: slot 0 (highest routing score), slot 1,
  ..., slot k-1, then the shared expert outputs in list order; each routed term is
  ``w_fp32 * y.float()``; the sum is rounded once to ``out_dtype`` (default: the experts' dtype).

Invariance: an expert processes each of its tokens as an independent row (the linear is
row-invariant), so a token's expert output does not depend on how many other tokens the expert
received or which; the combine order is fixed per token. This also holds under expert parallelism
as long as the outputs come back to their (token, slot) place before :func:`moe_combine`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .gemm import ROW_PARALLEL_K_SEGMENTS, linear

__all__ = ["silu", "swiglu", "expert_mlp", "expert_mlp_merged", "moe_combine", "moe_experts"]


def silu(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x / (1 + exp(-x))`` (returns fp32)."""
    x32 = x.to(torch.float32)
    return x32 / (1.0 + torch.exp(-x32))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, rounded once to ``gate.dtype``."""
    return (silu(gate) * up.to(torch.float32)).to(gate.dtype)


def expert_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``: ``x[..., H]``, ``w_gate/w_up [I, H]``, ``w_down [H, I]``."""
    # down_proj is row-parallel under TP: fixed K segmentation (see gemm.ROW_PARALLEL_K_SEGMENTS).
    return linear(swiglu(linear(x, w_gate), linear(x, w_up)), w_down, k_segments=ROW_PARALLEL_K_SEGMENTS)


def expert_mlp_merged(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Same with a merged ``[2I, H]`` gate-then-up weight (vLLM / Megatron fc1 layout).

    Bitwise equal to :func:`expert_mlp` with the two halves (the linear is invariant in N)."""
    gu = linear(x, w_gate_up)
    i = w_gate_up.shape[0] // 2
    return linear(swiglu(gu[..., :i], gu[..., i:]), w_down, k_segments=ROW_PARALLEL_K_SEGMENTS)


def moe_combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_out: Union[None, torch.Tensor, Sequence[torch.Tensor]] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``expert_out[T, k, H]`` (slot j = the j-th routed expert of each token), ``topk_weights[T, k]``
    and optional shared expert output(s) ``[T, H]`` -> ``[T, H]``, summed in fp32 in slot order."""
    T, k, H = expert_out.shape
    odt = out_dtype or expert_out.dtype
    w = topk_weights.to(torch.float32)
    acc = w[:, 0:1] * expert_out[:, 0].to(torch.float32)
    for j in range(1, k):
        acc = acc + w[:, j : j + 1] * expert_out[:, j].to(torch.float32)
    if shared_out is not None:
        shared = [shared_out] if isinstance(shared_out, torch.Tensor) else list(shared_out)
        for s in shared:
            acc = acc + s.to(torch.float32)
    return acc.to(odt)


def moe_experts(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: Optional[Sequence[Sequence[torch.Tensor]]] = None,
) -> torch.Tensor:
    """Reference MoE layer: ``x[T, H]``, stacked expert weights ``w_gate/w_up [E, I, H]``,
    ``w_down [E, H, I]``, routing ``topk_ids/topk_weights [T, k]``, optional shared experts as a list
    of ``(w_gate, w_up, w_down)``. Tokens are grouped per expert (any grouping gives the same bits)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    y = x.new_zeros(T * k, H)
    for e in torch.unique(flat_ids).tolist():
        sel = (flat_ids == e).nonzero().squeeze(1)
        tok = torch.div(sel, k, rounding_mode="floor")
        y = y.index_copy(0, sel, expert_mlp(x[tok], w_gate[e], w_up[e], w_down[e]))
    shared_out = None
    if shared:
        shared_out = [expert_mlp(x, *ws) for ws in shared]
    return moe_combine(y.view(T, k, H), topk_weights, shared_out, out_dtype=x.dtype)


def expert_rows(x: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, top_k: int) -> torch.Tensor:
    """Routed-expert outputs per (token, slot) row, before the combine: row ``r`` is
    :func:`expert_mlp_merged` of token ``slots[r] // top_k`` (``x[T, H]``) through expert ``ids[r]``
    (``w_gate_up[E, 2I, H]``, ``w_down[E, H, I]``) -> ``[R, H]``. Rows are grouped per expert (any
    grouping gives the same bits: every op is row-invariant). The learner's MoE forward."""
    R, H = ids.numel(), x.shape[-1]
    y = x.new_empty(R, H)
    tok = torch.div(slots, top_k, rounding_mode="floor")
    for e in torch.unique(ids).tolist():
        sel = (ids == e).nonzero().squeeze(1)
        y = y.index_copy(0, sel, expert_mlp_merged(x[tok[sel]], w_gate_up[e], w_down[e]))
    return y
