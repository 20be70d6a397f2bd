"""MoE router on the GPU (Triton): one program per token, fp32, deterministic top-k.

``route(logits[T, E], top_k, *, score, expert_bias, num_groups, group_topk, norm_topk_prob,
scaling_factor)`` -> ``(ids int64 [T, k], weights fp32 [T, k])``: the semantics of the CPU
reference (kernels/router.py, Hugging Face Qwen3-MoE softmax, DeepSeek-V3 ``noaux_tc`` sigmoid and
DeepSeek-V4's sqrtsoftplus):

* softmax: ``e = exp(x - max(x))``, ``p = e / sum(e)``; sigmoid: ``1 / (1 + exp(-x))`` (libdevice
  ``exp``, IEEE ``div_rn``); sqrtsoftplus: kernels.dsv4.sqrtsoftplus's steps (``exp`` of
  ``min(x, 20)``, ``log1p`` as ``log(u) * (e / (u - 1))``, ``x`` above 20, IEEE ``sqrt_rn``). The
  softmax sum is one ``tl.sum`` over a ``BLOCK_E = next_pow2(E)`` vector with exact-zero padding,
  i.e. a tree fixed by E alone.
* selection on ``score + bias``; grouped: group score = top1 + top2 of the group (biased), the
  ``group_topk`` best groups kept; top-k over the kept experts.
* top-k = k rounds of (exact max, then the LOWEST index holding it, then mask it): the same order as
  the reference's stable descending sort, so ties go to the lowest expert / group id and slot 0 is
  the best expert.
* weights = unbiased scores of the chosen experts; normaliser a left fold over slots 0..k-1
  (``+ 1e-20`` for sigmoid and sqrtsoftplus), IEEE division; then ``* scaling_factor``.

Every step is a function of the token's own row: **exactly per token, batch invariant** (one program
per row; no cross-row state). Agreement with the CPU reference: ids equal except at near-ties of
1-2 ulp (libdevice ``exp`` and the sum tree differ from the CPU's), weights within ~1e-6 relative.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

_USE_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"
if _USE_LIBDEVICE:
    from triton.language.extra import libdevice
_LIBDEVICE = tl.constexpr(_USE_LIBDEVICE)

__all__ = ["route"]


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


SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, EG, stride_l, scaling_factor,
                   TOP_K: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
                   NUM_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr, NORM: tl.constexpr,
                   SCALE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rg = tl.arange(0, BLOCK_G)
    rj = tl.arange(0, BLOCK_EG)
    eid = rg[:, None] * EG + rj[None, :]  # expert id of each [group, slot-in-group] cell
    valid = (rg[:, None] < NUM_GROUPS) & (rj[None, :] < EG)
    x = tl.load(logits_ptr + row * stride_l + eid, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORE == 1:  # sigmoid
        sc = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x))
        sc = tl.where(valid, sc, 0.0)
    elif SCORE == 2:  # sqrtsoftplus (DeepSeek-V4): kernels.dsv4.sqrtsoftplus's steps, IEEE div / sqrt
        e = _exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        d = u - 1.0
        l1p = tl.where(d == 0.0, e, _log(u) * tl.math.div_rn(e, tl.where(d == 0.0, 1.0, d)))
        sc = tl.math.sqrt_rn(tl.where(x > 20.0, x, l1p))
        sc = tl.where(valid, sc, 0.0)
    else:
        m = tl.max(tl.max(x, axis=1), axis=0)
        e = tl.where(valid, _exp(x - m), 0.0)
        s = tl.sum(tl.sum(e, axis=1), axis=0)
        sc = tl.math.div_rn(e, tl.full(e.shape, 1.0, tl.float32) * s)
    choice = sc
    if HAS_BIAS:
        b = tl.load(bias_ptr + eid, mask=valid, other=0.0).to(tl.float32)
        choice = choice + b
    NEG = float("-inf")
    BIG = 1 << 30
    choice = tl.where(valid, choice, NEG)
    if NUM_GROUPS > 1:
        # top-2 per group (first occurrence of the max removed, so equal maxima give top2 == top1)
        t1 = tl.max(choice, axis=1)
        j1 = tl.min(tl.where(choice == t1[:, None], rj[None, :], BIG), axis=1)
        rest = tl.where(rj[None, :] == j1[:, None], NEG, choice)
        t2 = tl.max(rest, axis=1)
        gs = tl.where(rg < NUM_GROUPS, t1 + t2, NEG)
        keep = rg < 0
        for _ in tl.static_range(GROUP_TOPK):
            best = tl.max(gs, axis=0)
            gi = tl.min(tl.where(gs == best, rg, BIG), axis=0)
            keep = keep | (rg == gi)
            gs = tl.where(rg == gi, NEG, gs)
        choice = tl.where(keep[:, None], choice, NEG)
    rk = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int64)
    ws = tl.zeros((BLOCK_K,), tl.float32)
    denom = 0.0
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(choice == best, eid, BIG), axis=1), axis=0)
        hit = eid == idx
        wi = tl.sum(tl.sum(tl.where(hit, sc, 0.0), axis=1), axis=0)  # exact: one nonzero term
        choice = tl.where(hit, NEG, choice)
        ids = tl.where(rk == i, idx.to(tl.int64), ids)
        ws = tl.where(rk == i, wi, ws)
        if i == 0:
            denom = wi
        else:
            denom = denom + wi
    if NORM:
        if SCORE != 0:  # sigmoid / sqrtsoftplus, as the reference
            denom = denom + 1e-20
        ws = tl.math.div_rn(ws, tl.full(ws.shape, 1.0, tl.float32) * denom)
    if SCALE:
        ws = ws * scaling_factor
    mk = rk < TOP_K
    tl.store(ids_ptr + row * TOP_K + rk, ids, mask=mk)
    tl.store(w_ptr + row * TOP_K + rk, ws, mask=mk)


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    num_groups: int = 1,
    group_topk: Optional[int] = None,
    norm_topk_prob: bool = False,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``logits[T, E]`` (CUDA) -> ``(topk_ids int64 [T, k], topk_weights fp32 [T, k])``.

    No autograd (``kernels.route`` adds the reference gradient for the weights)."""
    if logits.dim() != 2:
        raise ValueError("route: logits must be [T, E]")
    if score not in SCORES:
        raise ValueError(f"route: unknown score {score!r}")
    T, E = logits.shape
    if num_groups < 1 or E % num_groups:
        raise ValueError(f"route: E={E} not divisible by num_groups={num_groups}")
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k={top_k} out of range for E={E}")
    l2 = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(T, top_k, device=logits.device, dtype=torch.int64)
    w = torch.empty(T, top_k, device=logits.device, dtype=torch.float32)
    if T == 0:
        return ids, w
    eg = E // num_groups
    gk = num_groups if group_topk is None else int(group_topk)
    bias = None if expert_bias is None else expert_bias.to(device=logits.device).contiguous()
    _router_kernel[(T,)](
        l2, bias if bias is not None else l2, ids, w, E, eg, l2.stride(0), float(scaling_factor),
        TOP_K=int(top_k), SCORE=SCORES[score], HAS_BIAS=bias is not None,
        NUM_GROUPS=int(num_groups), GROUP_TOPK=gk, NORM=bool(norm_topk_prob),
        SCALE=float(scaling_factor) != 1.0, BLOCK_G=triton.next_power_of_2(num_groups),
        BLOCK_EG=triton.next_power_of_2(eg), BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4 if E <= 256 else 8, enable_fp_fusion=False)
    return ids, w
