"""Helpers shared by the GPU tests (deterministic CUDA inputs)."""

import pytest
import torch


def need_cuda():
    # The conftest skips `gpu`-marked tests without CUDA; this also guards direct calls.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def have_cuda_vllm() -> bool:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform

        return current_platform.is_cuda()
    except Exception:
        return False


def moe1b_checkpoint(tmp_path_factory) -> str:
    """The ~1B Qwen3-MoE random bf16 checkpoint of benchmarks/rollout_gpu.py (RZ_GPU_CKPT, or made
    here once per module); skips without CUDA vLLM."""
    import os

    need_cuda()
    if not have_cuda_vllm():
        pytest.skip("needs CUDA vLLM (docs/gpu.md)")
    import benchmarks.rollout_gpu as rg

    d = os.environ.get("RZ_GPU_CKPT") or str(tmp_path_factory.mktemp("ckpt") / "moe1b")
    if not os.path.exists(os.path.join(d, "config.json")):
        rg.make_ckpt("moe1b", d)
    return d


def gen(seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen(seed)) * scale).to(dtype)


def run_parallel_check(ckpt: str, out, recipe: str, *, nproc: int, tp: int, ep: int, args=()) -> dict:
    """megatron_rz.learner.parallel_check under torchrun (one rank per GPU) on `recipe` (a recipes/ name);
    returns what rank 0 saved to `out`."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           "-m", "megatron_rz.learner.parallel_check", "--hf-dir", str(ckpt), "--recipe", str(root / "recipes" / f"{recipe}.yaml"),
           "--tp", str(tp), "--ep", str(ep), "--out", str(out), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)
