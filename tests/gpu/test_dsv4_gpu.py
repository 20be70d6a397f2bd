"""DeepSeek-V4 on the GPU: the aligned V4 class in CUDA vLLM (eager), its compact cache
(vllm_bridge/aligned/dsv4_cache.py: a window of payload rows + the compressed entries, two cache
layers of the CUDA backend), against the Megatron V4 learner on the same GPU. Every comparison is
``torch.equal``.

* `rz check` on recipes/tiny_dsv4.yaml in bf16 (the learner in its own process): every sampled
  token's logprob bitwise, alone and batched.
* One engine per entries format (module fixture ``v4``: stock's fp8 entries, the default, and
  ``rz_kv_entries=model``) on helpers.V4_SMALL in bf16 (every layer kind: compressed sparse x4 with an
  indexer top-3, heavily compressed x128, sliding window 16), 64 prompts of 3 to 200 tokens through
  chunked prefill (192-token steps), 24 new tokens each, so that prefill and decode start and end on
  both sides of the x4 / x128 pooling windows and of the 16-token window:
  - the engine allocated the two compact caches (no payload cache), their blocks whole x128 windows;
  - every sampled token's logprob and every prompt logprob of the finished sequences (a prefill) equal
    the learner's over the whole sequence;
  - batch invariance: each of 8 prompts generated alone gives the tokens and logprobs it got in the
    batch of 64;
  - decode == prefill: the logprobs reported while decoding equal a prefill-only scoring of the same
    sequences.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_util import have_cuda_vllm, need_cuda
from helpers import V4_SMALL, redraw, v4_draw

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
# the engines start after the learner has used CUDA in this process: their processes must not fork it
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

SMALL_BF16 = [*V4_SMALL, "model.dtype=bfloat16", "rollout.dtype=bfloat16"]
_g = torch.Generator().manual_seed(17)
LENGTHS = [3, 6, 14, 17, 124, 130, 200, 31] + torch.randint(2, 201, (56,), generator=_g).tolist()
PROMPTS = [torch.randint(2, 96, (n,), generator=torch.Generator().manual_seed(900 + i)).tolist()
           for i, n in enumerate(LENGTHS)]
ALONE = range(8)  # the prompts also generated alone
MAX_NEW = 24
SEED = 7  # prompt i samples with seed SEED + i (RolloutEngine.generate)


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


def _draw_bf16(name, v, g):
    """helpers.v4_draw, stored in bf16 (what the engine and the learner both load)."""
    x = v4_draw(name, v, g)
    return x.to(torch.bfloat16) if x.is_floating_point() else x


@pytest.fixture(scope="module")
def small_ckpts(tmp_path_factory):
    """V4_SMALL in bf16, one random checkpoint: {"fp8": its dir, "model": a copy declaring
    rz_kv_entries=model}, and the recipe."""
    need_cuda()
    if not have_cuda_vllm():
        pytest.skip("needs CUDA vLLM (docs/gpu.md)")
    from kernels.models import dsv4 as R
    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from megatron_rz.recipe import load_recipe

    recipe = load_recipe(str(ROOT / "recipes" / "tiny_dsv4.yaml"), SMALL_BF16)
    root = tmp_path_factory.mktemp("dsv4_gpu")
    d = root / "fp8"
    make_random_checkpoint(recipe, d, seed=0)
    redraw(d, 7, _draw_bf16)
    plain = root / "model"
    shutil.copytree(d, plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**cfg, R.KV_ENTRIES_KEY: "model"}))
    return {"recipe": recipe, "fp8": d, "model": plain}


@pytest.fixture(scope="module", params=["fp8", "model"])
def v4(request, small_ckpts):
    """One CUDA engine per entries format and its batch of 64 (prompt i: seed SEED + i)."""
    from vllm_bridge.engine import RolloutEngine

    d = small_ckpts[request.param]
    eng = RolloutEngine(d, aligned=True, dtype="bfloat16", kv_cache_gb=1.0, max_model_len=256, max_num_seqs=64,
                        skip_tokenizer_init=True, max_num_batched_tokens=192, gpu_memory_utilization=0.5)
    try:
        batch = eng.generate(PROMPTS, 1, temperature=1.0, max_new_tokens=MAX_NEW, seed=SEED, ignore_eos=True)
        assert all(len(s.response_ids) == MAX_NEW for s in batch)
        yield {"eng": eng, "batch": batch, "ckpt": d, "recipe": small_ckpts["recipe"], "entries": request.param}
    finally:
        eng.close()
        torch.cuda.empty_cache()


def test_cuda_engine_runs_the_compact_cache(v4):
    from kernels.models import dsv4 as R
    from vllm_bridge.aligned.dsv4_cache import ENTRIES, WINDOW, layout_of

    c = R.v4_config(str(v4["ckpt"]))
    assert c.kv_entries == v4["entries"]
    (layers,) = v4["eng"].llm.collective_rpc("rz_kv_cache_layers")
    lay = layout_of(c, torch.bfloat16)
    assert set(layers) == {WINDOW, ENTRIES}  # no per-layer payload cache
    win, ent = layers[WINDOW], layers[ENTRIES]
    assert win["spec"] == "SlidingWindowSpec" and win["sliding_window"] == lay.window_tokens
    assert ent["spec"] == "FullAttentionSpec"
    # blocks of whole x128 windows (an entry never straddles two blocks: prefix caching stays on)
    assert win["block_size"] % 128 == 0 and ent["block_size"] % 128 == 0, (win, ent)
    assert win["bytes_per_token"] == lay.window_row * 2 and ent["bytes_per_token"] == lay.entries_row * 2


def _learner(v4):
    from megatron_rz.learner.learner import Learner

    r = v4["recipe"]
    return Learner(r.model, r.parallel, r.algo, hf_dir=str(v4["ckpt"]), train=False, mode="aligned")


def test_cuda_engine_equals_the_learner(v4):
    """Sampled tokens (decode) and the finished sequences' prompt logprobs (prefill) against the
    Megatron learner's full-sequence forward on the same GPU, one sequence at a time."""
    eng, batch = v4["eng"], v4["batch"]
    seqs = [s.prompt_ids + s.response_ids for s in batch]
    scored = eng.score(seqs)
    learner = _learner(v4)
    try:
        dec_eq = pre_eq = dec_n = pre_n = 0
        worst = 0.0
        for s, seq, row in zip(batch, seqs, scored):
            want = learner.logprobs(torch.tensor([seq]))[0]
            P = len(s.prompt_ids)
            got = torch.tensor(s.logprobs)
            pre = torch.tensor(row[1:])
            dec_eq += int((got == want[P:]).sum())
            pre_eq += int((pre == want[1:]).sum())
            dec_n, pre_n = dec_n + got.numel(), pre_n + pre.numel()
            worst = max(worst, float((got - want[P:]).abs().max()), float((pre - want[1:]).abs().max()))
    finally:
        del learner
        torch.cuda.empty_cache()
    assert dec_n == len(PROMPTS) * MAX_NEW
    assert (dec_eq, pre_eq) == (dec_n, pre_n), f"decode {dec_eq}/{dec_n}, prefill {pre_eq}/{pre_n}, max |d| {worst:.3g}"


def test_prompt_alone_equals_prompt_in_a_batch_of_64(v4):
    eng, batch = v4["eng"], v4["batch"]
    for i in ALONE:
        (alone,) = eng.generate([PROMPTS[i]], 1, temperature=1.0, max_new_tokens=MAX_NEW, seed=SEED + i,
                                 ignore_eos=True)
        assert alone.response_ids == batch[i].response_ids, LENGTHS[i]
        assert torch.equal(torch.tensor(alone.logprobs), torch.tensor(batch[i].logprobs)), LENGTHS[i]


def test_decode_equals_prefill(v4):
    eng, batch = v4["eng"], v4["batch"]
    scored = eng.score([s.prompt_ids + s.response_ids for s in batch])
    for s, row in zip(batch, scored):
        dec = torch.tensor(s.logprobs)
        pre = torch.tensor(row[len(s.prompt_ids):])
        assert torch.equal(dec, pre), (len(s.prompt_ids), float((dec - pre).abs().max()))
