"""Megatron's distributed optimizer (parallel.distributed_optimizer=true) on 2 GPUs over NCCL.

dp=2 x ep=2 (dense and expert parameter families both sharded), megatron_rz.learner.parallel_check under
torchrun: two steps agree with the plain optimizer to fp32 reduction order; a per-rank checkpoint
written after step 1 and resumed for step 2 gives the uninterrupted run's weights bit for bit.
The CPU version of this check is tests/integration/test_learner.py (gloo, patch 12).

    RZ_GPU_CKPT=<tiny_moe HF dir> PYTHONPATH=. python -m pytest tests/gpu/test_distopt_gpu.py -q -s
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gpu_util import run_parallel_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")


def _run(ckpt: str, out: Path, *extra: str, distopt: bool = True) -> dict:
    return run_parallel_check(ckpt, out, "tiny_moe", nproc=2, tp=1, ep=2,
                              args=["--set", f"parallel.distributed_optimizer={'true' if distopt else 'false'}", *extra])


def test_distributed_optimizer_on_two_gpus(tmp_path):
    ckpt = os.environ.get("RZ_GPU_CKPT")
    if not ckpt:
        pytest.skip("RZ_GPU_CKPT (a tiny_moe HF checkpoint dir) not set")
    plain = _run(ckpt, tmp_path / "plain.pt", distopt=False)
    ck = tmp_path / "ck"
    full = _run(ckpt, tmp_path / "full.pt", "--save-after", "1", "--save-dir", str(ck))
    resumed = _run(ckpt, tmp_path / "resumed.pt", "--load", str(ck), "--steps", "1")
    assert full["optimizers"] == ["DistributedOptimizer", "DistributedOptimizer"], full["optimizers"]
    wd = max((full["weights"][k].float() - plain["weights"][k].float()).abs().max().item() for k in plain["weights"])
    resume_bitwise = all(torch.equal(resumed["weights"][k], full["weights"][k]) for k in full["weights"])
    res = {"max_abs_dweight_distopt_vs_plain_after_2_steps": wd, "resume_bitwise": resume_bitwise,
           "grad_norms": [m["grad_norm"] for m in full["metrics"]], "device": torch.cuda.get_device_name(0)}
    print("\n[distopt gpu] " + json.dumps(res))
    if os.environ.get("RZ_GPU_RESULTS"):
        Path(os.environ["RZ_GPU_RESULTS"], "distopt_gpu.json").write_text(json.dumps(res, indent=1) + "\n")
    assert wd < 1e-5
    assert resume_bitwise and torch.equal(resumed["logprobs_after"], full["logprobs_after"])
