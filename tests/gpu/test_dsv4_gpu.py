"""DeepSeek-V4 on the GPU: the aligned V4 class in CUDA vLLM (eager; its per-token payload cache
read through cuda_attention's history hook) against the Megatron V4 learner on the same GPU,
`rz check` in bf16: every sampled token's logprob bitwise, alone and batched."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_util import have_cuda_vllm, need_cuda

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("recipe", ["tiny_dsv4"])
def test_rz_check_aligned_dsv4_bf16_on_the_gpu_is_bitwise(recipe, tmp_path):
    need_cuda()
    if not have_cuda_vllm():
        pytest.skip("needs CUDA vLLM (docs/gpu.md)")
    cmd = [sys.executable, "-m", "megatron_rz.cli", "check", str(ROOT / "recipes" / f"{recipe}.yaml"),
           f"logging.run_dir={tmp_path}", "mode=aligned", "model.dtype=bfloat16", "warm_start.device=cuda",
           "warm_start.steps=100", "rollout.max_new_tokens=8", "logging.progress=false", "logging.wandb=false",
           "--prompts", "8", "--samples", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["all_bitwise_equal"] is True
    for name, s in report["scenarios"].items():
        assert s["tokens"] > 0 and s["frac_bitwise"] == 1.0, name
