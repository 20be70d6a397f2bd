"""Helpers shared by the GPU tests (deterministic CUDA inputs)."""

import pytest
import torch


def need_cuda():
    # The conftest skips `gpu`-marked tests without CUDA; this also guards direct calls.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def gen(seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen(seed)) * scale).to(dtype)
