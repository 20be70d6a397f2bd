"""vllm_bridge.weights.ipc's bucket packing (the bytes a CUDA IPC handle exposes): every tensor of a
bucket survives pack -> unpack bit for bit, whatever its dtype, shape or size (empty, odd byte
counts), at aligned offsets that never overlap. The handle exchange itself needs CUDA
(tests/gpu/test_ipc_transport.py)."""

from __future__ import annotations

import torch

from vllm_bridge.weights import ipc


def _bucket():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 13, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(5, generator=g),
        "c.scale": torch.randn(3, 3, generator=g).to(torch.float16),
        "d.ids": torch.randint(-5, 5, (11,), generator=g, dtype=torch.int64),
        "e.empty": torch.empty(0, 4),
        "f.bytes": torch.randint(0, 255, (1,), generator=g, dtype=torch.uint8),
        "g.fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
    }


def test_pack_unpack_round_trip_is_bitwise():
    bucket = _bucket()
    buf, table = ipc.pack(bucket, device="cpu")
    out = ipc.unpack(buf, table, "cpu")
    assert list(out) == list(bucket)
    buf.fill_(0)  # the unpacked tensors are copies: the producer may reuse its buffer
    for name, t in bucket.items():
        got = out[name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)) if t.numel() else got.numel() == 0


def test_offsets_are_aligned_and_disjoint():
    _, table = ipc.pack(_bucket(), device="cpu")
    spans = sorted((off, off + n) for _, _, _, off, n in table)
    assert all(off % ipc.ALIGN == 0 for off, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_a_strided_tensor_is_packed_by_value():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    bucket = {"t": base.t()}  # not contiguous
    buf, table = ipc.pack(bucket, device="cpu")
    assert torch.equal(ipc.unpack(buf, table, "cpu")["t"], base.t())
