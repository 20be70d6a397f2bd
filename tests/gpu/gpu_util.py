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


def run_parallel_check(ckpt: str, out, recipe: str, *, nproc: int, tp: int, ep: int, args=()) -> dict:
    """megatron_rz.parallel_check under torchrun (one rank per GPU) on `recipe` (a recipes/ name);
    returns what rank 0 saved to `out`."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           "-m", "megatron_rz.parallel_check", "--hf-dir", str(ckpt), "--recipe", str(root / "recipes" / f"{recipe}.yaml"),
           "--tp", str(tp), "--ep", str(ep), "--out", str(out), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)
