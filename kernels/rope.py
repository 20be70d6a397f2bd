"""Rotary position embedding with per-token positions.

Tables: ``inv_freq = 1 / base ** (arange(0, rotary_dim, 2) / rotary_dim)`` and
``angle = position * inv_freq`` are computed in float64, ``cos``/``sin`` in float64, optionally
multiplied by ``attention_factor`` (YaRN mscale) in float64, then rounded once to ``dtype`` (fp32 by
default). A token's entries depend only on its own position (float64 ``cos``/``sin`` agree bitwise
between the CPU's vectorised and scalar paths; checked), so tables may be built per call or cached.

Application: in fp32, ``o1 = x1*cos - x2*sin``, ``o2 = x2*cos + x1*sin`` (separate IEEE multiplies
and adds, no FMA), rounded once to ``x.dtype``. Dimensions beyond ``rotary_dim`` pass through.

Styles:
* ``"neox"``: half split, ``x1 = x[..., :r/2]``, ``x2 = x[..., r/2:r]`` (Llama, Qwen, HF default).
* ``"interleaved"``: adjacent pairs, ``x1 = x[..., 0:r:2]``, ``x2 = x[..., 1:r:2]``, output in the same
  interleaved layout (GPT-J; vLLM's DeepSeek MLA with ``is_neox_style=False``). Note: Hugging Face's
  DeepSeek ``apply_rotary_pos_emb_interleave`` returns the de-interleaved (half-split) layout instead;
  q and k must use one layout on both sides, because the dot product's summation order follows it.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["rope_inv_freq", "rope_cos_sin", "apply_rope"]


def rope_inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """float64 ``[rotary_dim // 2]`` inverse frequencies."""
    if rotary_dim % 2:
        raise ValueError("rotary_dim must be even")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return 1.0 / (torch.tensor(base, dtype=torch.float64) ** exponent)


def rope_cos_sin(
    positions: torch.Tensor,
    rotary_dim: int,
    base: float = 10000.0,
    *,
    inv_freq: Optional[torch.Tensor] = None,
    attention_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``positions.shape + (rotary_dim // 2,)``.

    ``inv_freq``: override (e.g. YaRN / Llama-3 scaled frequencies), converted to float64.
    """
    f = rope_inv_freq(rotary_dim, base) if inv_freq is None else inv_freq.to(torch.float64)
    f = f.to(positions.device)
    ang = positions.to(torch.float64).unsqueeze(-1) * f
    cos = torch.cos(ang)
    sin = torch.sin(ang)
    if attention_factor != 1.0:
        cos = cos * attention_factor
        sin = sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    style: str = "neox",
) -> torch.Tensor:
    """Rotate ``x[..., H, D]`` with ``cos``/``sin`` of shape ``x.shape[:-2] + (r/2,)``.

    ``r = 2 * cos.shape[-1] <= D`` is the rotary dimension. Differentiable (plain torch ops).
    """
    half = cos.shape[-1]
    r = 2 * half
    D = x.shape[-1]
    if r > D:
        raise ValueError(f"apply_rope: rotary dim {r} > head dim {D}")
    c = cos.to(torch.float32).unsqueeze(-2)
    s = sin.to(torch.float32).unsqueeze(-2)
    x32 = x.to(torch.float32)
    if style == "neox":
        x1, x2 = x32[..., :half], x32[..., half:r]
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        rot = torch.cat([o1, o2], dim=-1)
    elif style == "interleaved":
        x1, x2 = x32[..., 0:r:2], x32[..., 1:r:2]
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        rot = torch.stack([o1, o2], dim=-1).flatten(-2)
    else:
        raise ValueError(f"apply_rope: unknown style {style!r} (use 'neox' or 'interleaved')")
    if r < D:
        rot = torch.cat([rot, x32[..., r:]], dim=-1)
    return rot.to(x.dtype)
