"""Kimi Delta Attention (KDA): reference numerics of the linear-attention layer of Kimi-Linear / Kimi-K3.

Contract (what the learner and the rollout engine both compute):

> **Prefill chunked at any boundary == token-by-token decode, bitwise.** The recurrent state
> ``S[b, h]`` (``[K, V]``, fp32 -- what vLLM's state cache holds; its ``mamba_ssm_cache_dtype``
> ``auto`` is fp32) and the short-convolution state (the last ``kernel - 1`` raw q/k/v projections,
> activation dtype) carried across a chunk or decode boundary give the same output bits and the same
> final state as one pass over the whole sequence; a sequence's bits do not depend on the other
> sequences of the batch.

How: every token runs the same update, in the same order, on the fp32 state
(:func:`kda_step`)::

    S     = S * exp(g_t)[:, None]                 # per-key-channel decay, g_t = log-decay <= 0
    mem   = tree_K(S * k_t[:, None])              # [V], fixed adjacent-pair tree over K
    delta = (v_t - mem) * beta_t
    S     = S + k_t[:, None] * delta[None, :]     # exact per-element product, one rounding each
    o_t   = tree_K(S * q_t[:, None])              # [V]

Every product / sum above is elementwise or a :func:`kernels.tree_sum` over the key dim,
whose addition order depends only on K (never torch matmul, whose order is unspecified and changes
with the batch / chunk shape). :func:`kda_chunked` runs exactly that per-token step inside each
chunk and carries the fp32 state across chunk boundaries, so it equals :func:`kda_recurrent`
bitwise for any chunk size. (The parallel intra-chunk WY / UT-transform form used by FLA / vLLM's
GPU prefill kernels -- ``transformers``' ``chunk_kimi_delta_attention`` -- re-associates the sums:
equal to rounding, NOT bitwise, and deliberately not part of this contract; it is not implemented
here.)

Layer semantics are transformers 5.19 ``KimiLinearDeltaAttention`` (``models/kimi_linear``), read,
not copied, plus what vLLM 0.32's ``KimiK3DeltaAttention`` (``vllm/models/kimi_k3``) adds:

* q/k/v = ``kernels.linear`` (rounded to the activation dtype); a depthwise causal convolution of
  width ``kernel`` over the concatenated ``[q | k | v]`` channels (no bias) as
  ``tree_j(w[c, j] * x[t - kernel + 1 + j, c])`` in fp32, SiLU ``x / (1 + exp(-x))``, rounded to the
  activation dtype (transformers: ``F.conv1d`` + SiLU; vLLM: ``causal_conv1d_fn`` / ``_update``);
* per head: q, k L2-normalised in fp32 as ``x / sqrt(tree(x * x) + 1e-6)``, q scaled by
  ``1 / sqrt(head_dim)``;
* forget gate (per key channel): ``raw = f_b(f_a(h)).float() + dt_bias``; ``g = -exp(A_log[h]) *
  softplus(raw)`` with ``softplus(x) = x if x > 20 else log(1 + exp(x))`` (transformers,
  vLLM without lower bound), or, with K3's ``gate_lower_bound`` (vLLM "safe gate"),
  ``g = lower_bound * sigmoid(exp(A_log[h]) * raw)``;
* ``beta = sigmoid(b_proj(h))`` as ``1 / (1 + exp(-x))`` in fp32 (vLLM's order: sigmoid of the
  fp32-converted projection; transformers applies torch.sigmoid in the activation dtype -- the same
  value in fp32 up to torch.sigmoid's own ulp);
* recurrence above; its output rounded to the activation dtype;
* output gate ``gate = g_b(g_a(h))`` (Kimi-Linear, low rank) or ``g_proj(h)`` (K3 full rank);
  gated RMSNorm per head, strict fp32: ``x * (1 / sqrt(tree(x * x) / D + eps)) * w *
  sigmoid(gate)``, rounded once; ``o_proj``.

Weights: a mapping (or getter) with transformers' ``kimi_linear`` names relative to the layer's
``self_attn.`` prefix: ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``,
``conv1d.weight [3P, 1, W]``, ``forget_gate.f_a_proj.weight``, ``forget_gate.f_b_proj.weight``,
``forget_gate.dt_bias [P]``, ``forget_gate.A_log [1, 1, H, 1]``, ``b_proj.weight``,
``g_a_proj.weight``, ``g_b_proj.weight``, ``o_norm.weight [D]``, ``o_proj.weight``. The Kimi
checkpoint names vLLM loads are accepted as well: ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``
(merged: the convolution is per channel, so merging changes no bits), ``f_a_proj`` / ``f_b_proj`` /
``dt_bias`` / ``A_log`` without the ``forget_gate.`` prefix, and ``g_proj.weight`` (K3's full-rank
output gate) instead of ``g_a_proj`` / ``g_b_proj``.

State: ``{"conv": [B, 3P, W - 1] activation dtype (channel-first, as vLLM's "DS" layout and
transformers' cache), "recurrent": [B, H, K, V] fp32}``. vLLM's Triton kernels store the recurrent
state transposed (``[H, V, K]``); the aligned engine class keeps this layout (or transposes exactly).

Float64 inputs run every step above in float64 instead of fp32 (the tests' exact reference); the
contract is the fp32 path.

Imports torch and ``kernels`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple, Union

import torch

import kernels
from kernels import tree_sum

__all__ = [
    "KDAConfig",
    "kda_config",
    "l2norm",
    "sigmoid",
    "kda_gate",
    "kda_beta",
    "short_conv",
    "kda_step",
    "kda_recurrent",
    "kda_chunked",
    "gated_rms_norm",
    "kda_layer_forward",
    "empty_state",
]

Weights = Union[Mapping[str, torch.Tensor], Callable[[str], torch.Tensor]]
State = dict

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


@dataclass
class KDAConfig:
    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-5
    gate_lower_bound: Optional[float] = None

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        v = cfg.get(name)
    else:
        v = getattr(cfg, name, None)
    return default if v is None else v


def kda_config(config: Any) -> KDAConfig:
    """KDAConfig from a transformers ``KimiLinearConfig``, a config.json dict (``linear_attn_config``
    sub-dict as in the Kimi checkpoints, optionally with K3's ``gate_lower_bound``) or a KDAConfig."""
    if isinstance(config, KDAConfig):
        return config
    lac = _get(config, "linear_attn_config", {}) or {}
    heads = lac.get("num_heads", _get(config, "linear_num_heads"))
    head_dim = lac.get("head_dim", _get(config, "linear_head_dim"))
    kernel = lac.get("short_conv_kernel_size", _get(config, "linear_conv_kernel_dim", 4))
    if heads is None or head_dim is None:
        raise ValueError("KDA config needs linear_attn_config.num_heads/head_dim (or linear_num_heads/linear_head_dim)")
    lb = lac.get("gate_lower_bound", _get(config, "gate_lower_bound"))
    return KDAConfig(
        hidden_size=int(_get(config, "hidden_size")),
        num_heads=int(heads),
        head_dim=int(head_dim),
        conv_kernel=int(kernel),
        rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-5)),
        gate_lower_bound=None if lb is None else float(lb),
    )


# ------------------------------------------------------------------------------ elementwise pieces


def _f(x: torch.Tensor) -> torch.Tensor:
    """The compute dtype: fp32 (the contract), or float64 for a float64 input (tests' exact reference)."""
    return x if x.dtype == torch.float64 else x.to(torch.float32)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``1 / (1 + exp(-x))`` (torch.sigmoid's vector and scalar CPU paths differ by an ulp)."""
    x32 = _f(x)
    return 1.0 / (1.0 + torch.exp(-x32))


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """fp32 ``x / sqrt(tree_sum(x * x) + eps)`` over the last dim (FLA's form: ``+ eps``, not max)."""
    x32 = _f(x)
    return x32 / torch.sqrt(tree_sum(x32 * x32, dim=-1, keepdim=True) + eps)


def kda_gate(raw: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, num_heads: int,
             lower_bound: Optional[float] = None) -> torch.Tensor:
    """Per-key-channel log-decay ``g`` fp32 ``[..., H, D]`` from ``raw = f_b(f_a(h))`` ``[..., H*D]``.

    ``A_log``: ``[H]`` or transformers' ``[1, 1, H, 1]``; ``dt_bias``: ``[H*D]``.
    """
    g = _f(raw) + dt_bias.to(_f(raw).dtype)
    g = g.unflatten(-1, (num_heads, -1))
    a = torch.exp(A_log.to(g.dtype).reshape(num_heads, 1))
    if lower_bound is not None:
        return float(lower_bound) * sigmoid(a * g)
    sp = torch.where(g > SOFTPLUS_THRESHOLD, g, torch.log(1.0 + torch.exp(g)))
    return -a * sp


def kda_beta(raw_beta: torch.Tensor) -> torch.Tensor:
    """``beta`` fp32 ``[..., H]`` = sigmoid of the fp32-converted ``b_proj`` output."""
    return sigmoid(raw_beta)


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU, token-major.

    ``x [B, T, C]`` (activation dtype), ``weight [C, W]`` (or ``[C, 1, W]``), ``conv_state
    [B, C, W - 1]`` (the previous ``W - 1`` raw inputs, oldest first; None = zeros). Returns
    ``(y [B, T, C] in x.dtype, new_state [B, C, W - 1] in x.dtype)``. Each output is
    ``silu(tree_j(w[c, j] * x_ext[t + j, c]))`` in fp32 -- its own ``W`` taps only, so a token's bits
    do not depend on T, the batch or where a chunk starts.
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    B, T, C = x.shape
    W = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(B, C, W - 1)
    ext = torch.cat([conv_state.to(x.dtype).transpose(1, 2), x], dim=1)  # [B, W-1+T, C]
    ext32 = _f(ext)
    w32 = weight.to(ext32.dtype)
    prods = torch.stack([ext32[:, j:j + T, :] * w32[:, j] for j in range(W)], dim=-1)  # [B, T, C, W]
    acc = tree_sum(prods, dim=-1)
    y = (acc / (1.0 + torch.exp(-acc))).to(x.dtype)
    new_state = ext[:, ext.shape[1] - (W - 1):, :].transpose(1, 2).contiguous()
    return y, new_state


# ------------------------------------------------------------------------------------ the recurrence


def kda_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
             beta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, fp32, fixed order (see the module docstring).

    ``S [B, H, K, V]``; ``q, k [B, H, K]`` (already l2-normalised, q scaled); ``v [B, H, V]``;
    ``decay = exp(g) [B, H, K]``; ``beta [B, H]``. Returns ``(o [B, H, V], S_new)``.
    """
    S = S * decay.unsqueeze(-1)
    mem = tree_sum(S * k.unsqueeze(-1), dim=-2)
    delta = (v - mem) * beta.unsqueeze(-1)
    S = S + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = tree_sum(S * q.unsqueeze(-1), dim=-2)
    return o, S


def _prepare(q, k, v, g, beta, scale, qk_l2norm):
    D = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(D)  # transformers' 1 / (D ** 0.5)
    q32 = _f(q)
    dt = q32.dtype
    k32 = k.to(dt)
    if qk_l2norm:
        q32 = l2norm(q32)
        k32 = l2norm(k32)
    q32 = q32 * scale
    return q32, k32, v.to(dt), torch.exp(g.to(dt)), beta.to(dt)


def _initial(initial_state, B, H, K, V, q):
    dt = _f(q).dtype if q.dtype == torch.float64 else torch.float32
    if initial_state is None:
        return torch.zeros(B, H, K, V, dtype=dt, device=q.device)
    if initial_state.dtype != dt:
        raise ValueError(f"KDA contract: the recurrent state is {dt} (got {initial_state.dtype})")
    return initial_state


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: Optional[torch.Tensor] = None, *, scale: Optional[float] = None,
                  qk_l2norm: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA (the decode path, and the definition of the contract).

    ``q, k [B, T, H, K]``, ``v [B, T, H, V]`` (activation dtype), ``g [B, T, H, K]`` fp32 log-decay,
    ``beta [B, T, H]``, ``initial_state [B, H, K, V]`` fp32 or None. ``qk_l2norm``: normalise q, k in
    fp32 first (transformers' / vLLM's ``use_qk_l2norm_in_kernel=True``). Returns ``(o [B, T, H, V]``
    in ``q.dtype``, final state fp32)``.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    q32, k32, v32, dec, b32 = _prepare(q, k, v, g, beta, scale, qk_l2norm)
    S = _initial(initial_state, B, H, K, V, q)
    outs = []
    for t in range(T):
        o, S = kda_step(S, q32[:, t], k32[:, t], v32[:, t], dec[:, t], b32[:, t])
        outs.append(o)
    out = torch.stack(outs, dim=1) if outs else S.new_zeros(B, 0, H, V)
    return out.to(q.dtype), S


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: Optional[torch.Tensor] = None, *, chunk_size: int = 64,
                scale: Optional[float] = None, qk_l2norm: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunked-prefill KDA: bitwise equal to :func:`kda_recurrent` for every ``chunk_size``.

    Each chunk prepares its own tokens (l2norm, scale, ``exp(g)``: elementwise / per-token trees, so
    the bits do not depend on the chunk) and runs :func:`kda_step` over them, starting from the fp32
    state the previous chunk left -- exactly what an engine does when a prompt is prefilled in
    several scheduler steps with the state in its cache between them. Same signature and returns as
    :func:`kda_recurrent`.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = _initial(initial_state, B, H, K, V, q)
    outs = []
    for s in range(0, T, chunk_size):
        e = min(T, s + chunk_size)
        q32, k32, v32, dec, b32 = _prepare(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                           scale, qk_l2norm)
        for t in range(e - s):
            o, S = kda_step(S, q32[:, t], k32[:, t], v32[:, t], dec[:, t], b32[:, t])
            outs.append(o)
    out = torch.stack(outs, dim=1) if outs else S.new_zeros(B, 0, H, V)
    return out.to(q.dtype), S


# ---------------------------------------------------------------------------------------- the layer


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Strict-fp32 gated RMSNorm over the last dim: ``x * (1/sqrt(tree(x*x)/D + eps)) * w * sigmoid(gate)``,
    rounded once to ``x.dtype`` (transformers' ``KimiLinearRMSNormGated`` / FLA's FusedRMSNormGated)."""
    D = x.shape[-1]
    x32 = _f(x)
    ms = tree_sum(x32 * x32, dim=-1, keepdim=True) / D
    y = x32 * (1.0 / torch.sqrt(ms + eps))
    y = y * weight.to(x32.dtype)
    y = y * sigmoid(gate)
    return y.to(x.dtype)


def _getter(weights: Weights) -> Callable[[str], Optional[torch.Tensor]]:
    if callable(weights) and not isinstance(weights, Mapping):
        def get(name: str) -> Optional[torch.Tensor]:
            try:
                return weights(name)
            except KeyError:
                return None
        return get
    return lambda name: weights.get(name)


def _first(get, *names: str) -> torch.Tensor:
    for n in names:
        t = get(n)
        if t is not None:
            return t
    raise KeyError(f"KDA weights: none of {names}")


def empty_state(cfg: Any, batch: int, dtype: torch.dtype, device: Any = None) -> State:
    """Zero state: ``{"conv": [B, 3P, W-1] dtype, "recurrent": [B, H, K, V] fp32}``."""
    c = kda_config(cfg)
    return {
        "conv": torch.zeros(batch, 3 * c.proj_dim, c.conv_kernel - 1, dtype=dtype, device=device),
        "recurrent": torch.zeros(batch, c.num_heads, c.head_dim, c.head_dim,
                                 dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device),
    }


def kda_layer_forward(hidden: torch.Tensor, weights: Weights, config: Any, state: Optional[State] = None, *,
                      chunk_size: Optional[int] = None) -> Tuple[torch.Tensor, State]:
    """The KDA mixer of one decoder layer (input = the post-norm hidden states, output before the residual).

    ``hidden [B, T, hidden]`` (fp32 or bf16), every row a real token (no padding); ``weights``: see the
    module docstring; ``state``: the incoming ``{"conv", "recurrent"}`` (None = start of the
    sequences). ``chunk_size``: None runs :func:`kda_recurrent` over the T tokens, an int
    :func:`kda_chunked` -- the same bits either way. Returns ``(out [B, T, hidden] in hidden.dtype,
    new_state)``.
    """
    c = kda_config(config)
    get = _getter(weights)
    B, T, _ = hidden.shape
    H, D, P = c.num_heads, c.head_dim, c.proj_dim
    lin = kernels.linear

    qkv = torch.cat([lin(hidden, get("q_proj.weight")), lin(hidden, get("k_proj.weight")),
                     lin(hidden, get("v_proj.weight"))], dim=-1)
    conv_w = get("conv1d.weight")
    if conv_w is None:
        conv_w = torch.cat([_first(get, f"{n}_conv1d.weight").reshape(P, -1) for n in ("q", "k", "v")], dim=0)
    conv_w = conv_w.reshape(3 * P, -1)
    if conv_w.shape[-1] != c.conv_kernel:
        raise ValueError(f"conv weight width {conv_w.shape[-1]} != conv_kernel {c.conv_kernel}")
    qkv, conv_state = short_conv(qkv, conv_w, None if state is None else state["conv"])
    q, k, v = (t.unflatten(-1, (H, D)) for t in qkv.split(P, dim=-1))

    f = lin(lin(hidden, _first(get, "forget_gate.f_a_proj.weight", "f_a_proj.weight")),
            _first(get, "forget_gate.f_b_proj.weight", "f_b_proj.weight"))
    g = kda_gate(f, _first(get, "forget_gate.dt_bias", "dt_bias"), _first(get, "forget_gate.A_log", "A_log"),
                 H, c.gate_lower_bound)
    beta = kda_beta(lin(hidden, get("b_proj.weight")))

    S0 = None if state is None else state["recurrent"]
    if chunk_size is None:
        o, S = kda_recurrent(q, k, v, g, beta, S0)
    else:
        o, S = kda_chunked(q, k, v, g, beta, S0, chunk_size=chunk_size)

    g_full = get("g_proj.weight")
    if g_full is not None:
        gate = lin(hidden, g_full)
    else:
        gate = lin(lin(hidden, get("g_a_proj.weight")), get("g_b_proj.weight"))
    o = gated_rms_norm(o, gate.unflatten(-1, (H, D)), get("o_norm.weight"), c.rms_norm_eps)
    out = lin(o.flatten(-2), get("o_proj.weight"), k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)  # row-parallel
    return out, {"conv": conv_state, "recurrent": S}
