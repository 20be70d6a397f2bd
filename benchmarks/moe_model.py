"""A Qwen3-MoE-shaped decoder built twice from the same weights, for GPU benchmarks and parity tests.

* ``aligned``: our batch-invariant ops (``kernels.linear`` / ``rms_norm`` / ``apply_rope`` /
  ``route`` dispatch to Triton on CUDA; ``kernels.triton.attn.attention_batched`` over a KV cache;
  ``kernels.triton.moe.moe_experts_merged``; ``kernels.token_logprobs``).
* ``fast``: stock torch: cuBLAS ``F.linear``, ``F.rms_norm``, RoPE in torch elementwise ops, SDPA
  (flash) over the KV cache, ``softmax`` + ``topk`` router, ``torch._grouped_mm`` experts (fallback:
  a per-expert loop), ``log_softmax`` + ``gather``.

Architecture (per layer): RMSNorm -> merged qkv -> per-head q/k RMSNorm -> neox RoPE -> GQA
attention (KV cache) -> o_proj (row-parallel: K in ``ROW_PARALLEL_K_SEGMENTS`` segments) -> residual;
RMSNorm -> router (fp32 logits, softmax top-k, renormalised) -> routed experts (SwiGLU) + one shared
expert -> fixed-order combine -> residual. Final RMSNorm, lm_head, fp32 log-probs of given tokens.

``ONE_B``: hidden 1024, 16 layers, 16 q / 4 kv heads of 128, 32 experts (top-4) of 512, a shared
expert of 1024, vocab 32768: ~1.0 B parameters (``param_count``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab: int = 32768
    hidden: int = 1024
    layers: int = 16
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 32
    top_k: int = 4
    moe_inter: int = 512
    shared_inter: int = 1024
    rope_base: float = 1e6
    eps: float = 1e-6
    max_seq: int = 2048


ONE_B = MoEConfig()
TINY = MoEConfig(vocab=512, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2,
                 moe_inter=64, shared_inter=64, max_seq=256)


def param_count(c: MoEConfig) -> int:
    qkv = (c.heads + 2 * c.kv_heads) * c.head_dim * c.hidden
    o = c.hidden * c.heads * c.head_dim
    experts = c.experts * 3 * c.hidden * c.moe_inter
    shared = 3 * c.hidden * c.shared_inter
    per_layer = qkv + o + experts + shared + c.experts * c.hidden + 2 * c.hidden + 2 * c.head_dim
    return c.layers * per_layer + 2 * c.vocab * c.hidden + c.hidden


def init_weights(c: MoEConfig, seed: int = 0, device: str = "cuda", dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def rn(*shape, std):
        return (torch.randn(*shape, device=device, generator=g) * std).to(dtype)

    def norm_w(n):
        return (1.0 + 0.1 * torch.randn(n, device=device, generator=g)).to(dtype)

    H, D = c.hidden, c.head_dim
    W = {"embed": rn(c.vocab, H, std=1.0), "lnf": norm_w(H), "lm_head": rn(c.vocab, H, std=H ** -0.5),
         "layers": []}
    for _ in range(c.layers):
        W["layers"].append({
            "ln1": norm_w(H), "ln2": norm_w(H), "qn": norm_w(D), "kn": norm_w(D),
            "wqkv": rn((c.heads + 2 * c.kv_heads) * D, H, std=H ** -0.5),
            "wo": rn(H, c.heads * D, std=(c.heads * D) ** -0.5 / math.sqrt(2 * c.layers)),
            "wr": rn(c.experts, H, std=H ** -0.5),
            "w_gate_up": rn(c.experts, 2 * c.moe_inter, H, std=H ** -0.5),
            "w_down": rn(c.experts, H, c.moe_inter, std=c.moe_inter ** -0.5 / math.sqrt(2 * c.layers)),
            "s_gate_up": rn(2 * c.shared_inter, H, std=H ** -0.5),
            "s_down": rn(H, c.shared_inter, std=c.shared_inter ** -0.5 / math.sqrt(2 * c.layers)),
        })
    return W


def rope_tables(c: MoEConfig, device="cuda"):
    from kernels import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(c.max_seq), c.head_dim, c.rope_base)
    return cos.to(device), sin.to(device)


class KVCache:
    """Per layer ``k, v``: aligned layout ``[B, S, Hkv, D]``; fast (SDPA) layout ``[B, Hkv, S, D]``."""

    def __init__(self, c: MoEConfig, batch: int, layout: str, device="cuda", dtype=torch.bfloat16):
        shape = (batch, c.max_seq, c.kv_heads, c.head_dim) if layout == "aligned" else \
            (batch, c.kv_heads, c.max_seq, c.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.layers)]


# ------------------------------------------------------------------------------------- aligned


def aligned_forward(c: MoEConfig, W: dict, cache: KVCache, tables, tokens: torch.Tensor, seq_idx: torch.Tensor,
                    positions: torch.Tensor, cu_seqlens: torch.Tensor, max_q_len: int,
                    targets: torch.Tensor) -> torch.Tensor:
    """Packed tokens ``[T]`` of several sequences (sequence ``seq_idx[t]``, position ``positions[t]``;
    rows of a sequence contiguous, described by ``cu_seqlens``); writes their K/V into the cache
    and returns the fp32 log-probs of ``targets[T]``. Prefill, chunked prefill and decode alike."""
    import kernels
    from kernels.triton.attn import attention_batched
    from kernels.triton.moe import moe_experts_merged

    T = tokens.shape[0]
    Hq, Hkv, D = c.heads, c.kv_heads, c.head_dim
    cos, sin = tables[0][positions], tables[1][positions]
    h = W["embed"][tokens]
    scale = D ** -0.5
    segs = kernels.ROW_PARALLEL_K_SEGMENTS
    for li, L in enumerate(W["layers"]):
        a = kernels.rms_norm(h, L["ln1"], c.eps)
        qkv = kernels.linear(a, L["wqkv"])
        q = qkv[:, : Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        q = kernels.apply_rope(kernels.rms_norm(q, L["qn"], c.eps), cos, sin, "neox")
        k = kernels.apply_rope(kernels.rms_norm(k, L["kn"], c.eps), cos, sin, "neox")
        cache.k[li][seq_idx, positions] = k
        cache.v[li][seq_idx, positions] = v
        o = attention_batched(q, cache.k[li], cache.v[li], cu_seqlens, positions, scale, max_q_len=max_q_len)
        h = h + kernels.linear(o.view(T, Hq * D), L["wo"], k_segments=segs)
        a = kernels.rms_norm(h, L["ln2"], c.eps)
        logits = kernels.router_logits(a, L["wr"])
        ids, w = kernels.route(logits, c.top_k, norm_topk_prob=True)
        shared = kernels.expert_mlp_merged(a, L["s_gate_up"], L["s_down"])
        h = h + moe_experts_merged(a, L["w_gate_up"], L["w_down"], ids, w, shared, k_segments_down=segs)
    h = kernels.rms_norm(h, W["lnf"], c.eps)
    return kernels.token_logprobs(h, W["lm_head"], targets)


# ---------------------------------------------------------------------------------------- fast


def rope_fast(x, cos, sin):
    half = cos.shape[-1]
    c = cos.unsqueeze(-2)
    s = sin.unsqueeze(-2)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


_GROUPED_MM_OK: Optional[bool] = None


def experts_fast(a, w_gate_up, w_down, ids, wts):
    """torch's grouped expert compute: sort by expert, two torch._grouped_mm (cuBLAS/CUTLASS grouped
    GEMM), silu*up in torch; per-expert loop if _grouped_mm is missing."""
    global _GROUPED_MM_OK
    T, H = a.shape
    E, I2, _ = w_gate_up.shape
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = a[order // k]
    counts = torch.zeros(E, dtype=torch.int32, device=a.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    if _GROUPED_MM_OK is not False:
        try:
            gu = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)
            act = F.silu(gu[:, : I2 // 2]) * gu[:, I2 // 2:]
            yd = torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs)
            _GROUPED_MM_OK = True
        except Exception as e:  # noqa: BLE001
            print(f"torch._grouped_mm unavailable ({type(e).__name__}: {str(e)[:100]}); per-expert loop")
            _GROUPED_MM_OK = False
    if _GROUPED_MM_OK is False:
        yd = torch.empty(xs.shape[0], H, device=a.device, dtype=a.dtype)
        ends = offs.tolist()
        start = 0
        for e in range(E):
            if ends[e] > start:
                gu = F.linear(xs[start:ends[e]], w_gate_up[e])
                yd[start:ends[e]] = F.linear(F.silu(gu[:, : I2 // 2]) * gu[:, I2 // 2:], w_down[e])
            start = ends[e]
    y = torch.empty_like(yd)
    y[order] = yd
    return (y.view(T, k, H).float() * wts.unsqueeze(-1)).sum(1)


def fast_decode(c: MoEConfig, W: dict, cache: KVCache, tables, tokens: torch.Tensor, pos: int,
                targets: torch.Tensor, fused_misc: bool = False) -> torch.Tensor:
    """One decode token for each of ``B = tokens.numel()`` sequences, all at position ``pos``.

    ``fused_misc``: RoPE and the router through our one-kernel Triton versions instead of chains of
    torch elementwise ops (as a serving engine would use fused kernels for them); GEMMs stay cuBLAS,
    attention SDPA, experts torch._grouped_mm. Isolates the cost of the aligned GEMM/attention/MoE."""
    if fused_misc:
        from kernels.triton.rope import apply_rope as _trope
        from kernels.triton.router import route as _troute
    B = tokens.shape[0]
    Hq, Hkv, D = c.heads, c.kv_heads, c.head_dim
    cos, sin = tables[0][pos].expand(B, -1), tables[1][pos].expand(B, -1)
    h = W["embed"][tokens]
    for li, L in enumerate(W["layers"]):
        a = F.rms_norm(h, (c.hidden,), L["ln1"], c.eps)
        qkv = F.linear(a, L["wqkv"])
        q = qkv[:, : Hq * D].view(B, Hq, D)
        k = qkv[:, Hq * D: (Hq + Hkv) * D].view(B, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(B, Hkv, D)
        if fused_misc:
            q = _trope(F.rms_norm(q, (D,), L["qn"], c.eps), cos, sin)
            k = _trope(F.rms_norm(k, (D,), L["kn"], c.eps), cos, sin)
        else:
            q = rope_fast(F.rms_norm(q, (D,), L["qn"], c.eps), cos, sin)
            k = rope_fast(F.rms_norm(k, (D,), L["kn"], c.eps), cos, sin)
        cache.k[li][:, :, pos] = k
        cache.v[li][:, :, pos] = v
        o = F.scaled_dot_product_attention(q.unsqueeze(2), cache.k[li][:, :, : pos + 1],
                                           cache.v[li][:, :, : pos + 1], enable_gqa=True)
        h = h + F.linear(o.reshape(B, Hq * D), L["wo"])
        a = F.rms_norm(h, (c.hidden,), L["ln2"], c.eps)
        if fused_misc:
            ids, wts = _troute(F.linear(a, L["wr"]), c.top_k, norm_topk_prob=True)
        else:
            probs = F.linear(a, L["wr"]).float().softmax(-1)
            wts, ids = probs.topk(c.top_k, dim=-1)
            wts = wts / wts.sum(-1, keepdim=True)
        gu = F.linear(a, L["s_gate_up"])
        i = gu.shape[-1] // 2
        shared = F.linear(F.silu(gu[:, :i]) * gu[:, i:], L["s_down"])
        h = h + (experts_fast(a, L["w_gate_up"], L["w_down"], ids, wts) + shared.float()).to(h.dtype)
    h = F.rms_norm(h, (c.hidden,), W["lnf"], c.eps)
    logits = F.linear(h, W["lm_head"])
    return logits.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def aligned_decode(c: MoEConfig, W: dict, cache: KVCache, tables, tokens: torch.Tensor, pos: int,
                   targets: torch.Tensor, *, _meta={}) -> torch.Tensor:  # noqa: B006
    """Same step as :func:`fast_decode` through :func:`aligned_forward` (B sequences, one token each)."""
    B = tokens.shape[0]
    key = (B, pos, tokens.device)
    if key not in _meta:
        _meta.clear()
        _meta[key] = (torch.arange(B, device=tokens.device), torch.full((B,), pos, device=tokens.device),
                      torch.arange(B + 1, device=tokens.device, dtype=torch.int32))
    seq_idx, positions, cu = _meta[key]
    return aligned_forward(c, W, cache, tables, tokens, seq_idx, positions, cu, 1, targets)
