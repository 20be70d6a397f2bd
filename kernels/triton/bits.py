"""Exact byte checksums of many tensors in one launch per element size (the weight-sync check).

``bits_many(tensors)`` -> int64 tensor ``[n]`` on the tensors' device, without a host
synchronisation: entry i is ``sum_j pattern_i[j] * (2 * (j % 1000003) + 1) mod 2^64``, where
``pattern_i[j]`` is element j of tensor i (flat, row-major) read as an integer of its own size
(``uint8`` for one-byte types, ``int16`` / ``int32`` / ``int64`` sign-extended for the others): the
number ``vllm_bridge.worker_ext.tensor_bits`` computes with torch ops, one tensor at a time.

One program per (tensor, lane): lane p adds blocks p, p + LANES, ... of its tensor in uint64
(products and sums wrap mod 2^64, so the order of the additions never matters), and the lanes'
partials are summed by torch. The tensors are found through a table of their addresses, so the
whole list costs one launch per element size and reads each byte once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bits_many", "BITS_PERIOD"]

BITS_PERIOD = 1000003  # the position weights repeat with this period (a prime)
LANES = 64  # programs per tensor
BLOCK = 2048  # elements per program step

_ELEM = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _bits_kernel(addr_ptr, numel_ptr, out_ptr, ELEM: tl.constexpr, PERIOD: tl.constexpr, LANES: tl.constexpr,
                 BLOCK: tl.constexpr):
    t = tl.program_id(0)
    lane = tl.program_id(1)
    n = tl.load(numel_ptr + t)
    base = tl.load(addr_ptr + t).to(tl.pointer_type(ELEM))
    offs = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.uint64)
    for start in range(lane.to(tl.int64) * BLOCK, n, LANES * BLOCK):
        idx = start + offs
        m = idx < n
        v = tl.load(base + idx, mask=m, other=0).to(tl.int64)  # zero- (uint8) or sign-extended
        w = (idx % PERIOD) * 2 + 1
        acc += v.to(tl.uint64, bitcast=True) * w.to(tl.uint64, bitcast=True)
    tl.store(out_ptr + t * LANES + lane, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def bits_many(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The exact checksums of ``tensors`` (all on one device) as an int64 tensor on that device;
    non-contiguous tensors are copied to contiguous ones first."""
    if not tensors:
        raise ValueError("bits_many: no tensors")
    dev = tensors[0].device
    out = torch.zeros(len(tensors), dtype=torch.int64, device=dev)
    keep = []
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device != dev:
            raise ValueError(f"bits_many: tensors on {dev} and {t.device}")
        x = t.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        if x.numel():
            keep.append((i, x))
            groups.setdefault(x.element_size(), []).append(len(keep) - 1)
    for size, members in groups.items():
        xs = [keep[k][1].reshape(-1).view(_VIEW[size]) for k in members]
        table = torch.tensor([[x.data_ptr() for x in xs], [x.numel() for x in xs]], dtype=torch.int64).to(dev)
        part = torch.empty(len(xs), LANES, dtype=torch.int64, device=dev)
        _bits_kernel[(len(xs), LANES)](table[0], table[1], part, ELEM=_ELEM[size], PERIOD=BITS_PERIOD, LANES=LANES,
                                       BLOCK=BLOCK, num_warps=4)
        idx = torch.tensor([keep[k][0] for k in members], dtype=torch.int64).to(dev)
        out.index_copy_(0, idx, part.sum(1))  # int64 sums wrap mod 2^64 as the uint64 lanes did
    return out
