"""The batched exact checksum kernel (kernels.triton.bits, the weight-sync check on the GPU) gives
tensor_bits' numbers: run in Triton's interpreter on the CPU (the GPU test runs it compiled)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import torch
from kernels.triton.bits import bits_many
from vllm_bridge.worker_ext import bit_patterns, bits_weights, tensor_bits

torch.manual_seed(0)
ts = [torch.randn(1000).to(torch.bfloat16), torch.randn(3, 7), torch.randint(-2**62, 2**62, (50,)),
      torch.randn(5000).to(torch.float8_e4m3fn), torch.randn(4, 6)[:, ::2], torch.zeros(0),
      torch.randn(1000003 + 4100).to(torch.float16),  # past the weights' period
      torch.randint(0, 255, (77,), dtype=torch.uint8), torch.randint(-9, 9, (33,), dtype=torch.int32)]
got = bits_many(ts).tolist()
want = [tensor_bits(t) for t in ts]
assert got == want, (got, want)
# the definition, written out: patterns x odd weights, mod 2^64
for t, g in zip(ts, got):
    p = bit_patterns(t)
    ref = int((p * bits_weights(torch.arange(p.numel()))).sum()) if p.numel() else 0
    assert (g - ref) % (1 << 64) == 0
# one flipped bit anywhere changes the checksum
x = ts[6].clone()
xv = x.view(torch.int16)
for pos in (0, 1000002, 1000003, x.numel() - 1):
    y = x.clone()
    y.view(torch.int16)[pos] ^= 1
    assert bits_many([y]).tolist() != bits_many([x]).tolist(), pos
print("bits kernel OK")
'''


def test_bits_kernel_equals_tensor_bits_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "bits kernel OK" in r.stdout
