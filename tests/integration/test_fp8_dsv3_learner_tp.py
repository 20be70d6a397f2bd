"""Blockwise FP8 DeepSeek-V3 *learner* at tensor parallel > 1 (docs/tp.md "FP8").

How Megatron-Core 0.16 splits MLA, and the FP8 form each projection gets in the aligned learner:

* q_proj (no q_lora_rank) / q_b (linear_q_up_proj), kv_b (linear_kv_up_proj): column-parallel, heads
  split; each rank quantises its shard (rows per rank multiples of 128, else refused);
* q_a (linear_q_down_proj): column-parallel in Megatron, but computed whole on every rank from the
  all-gathered shards (the engine replicates it), so any q_lora_rank is exact;
* kv_a (linear_kv_down_proj): replicated, quantised whole;
* o_proj (linear_proj): row-parallel, the 8-segment FP8 contract (K = heads x v_head_dim % 1024 == 0);
* dense gate / up column, dense down row-parallel (8 segments);
* shared expert: TP-split parameters in Megatron, computed whole on every rank from the all-gathered
  shards with the single FP8 chain (the engine replicates it; its TP=1 bits are unchanged);
* routed experts: whole per rank (etp = 1), the single chain.

The learner at parallel.tp=2 (2 gloo ranks; tp=4 too with RZ_TEST_FP8_TP4=1) on a DeepSeek-V3 widened
to 8 heads x v_head_dim 128 (o_proj K = 1024), qk_nope 64 and a dense layer of 1024: logprobs before
and after a train step == the FP8 reference on the same weights (torch.equal), and == the TP=1
learner before the step; after the step the weights agree with the TP=1 learner's to reduction-order
rounding. Two variants: q_proj (q_lora_rank none), and q_lora_rank=128 (q_a at 64 rows per rank: a
per-rank shard would not be exact). Refusals are one line naming the key.

Run: .venv/bin/python -m pytest tests/integration/test_fp8_dsv3_learner_tp.py -q -s
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/tiny_dsv3.yaml"
WIDE = ["model.fp8=blockwise", "model.num_attention_heads=8", "model.num_kv_heads=8", "model.v_head_dim=128",
        "model.qk_nope_head_dim=64", "model.dense_ffn_hidden_size=1024"]
VARIANTS = {"q_proj": [], "q_lora128": ["model.q_lora_rank=128"]}
# learner TP=4 (~15-30 s per variant on the 2-CPU box): opt in, as test_aligned_vllm_tp_fp8.py's TP=4
TPS = (2, 4) if os.environ.get("RZ_TEST_FP8_TP4") == "1" else (2,)
REPORT: dict = {}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from megatron_rz.recipe import load_recipe

    out = {}
    for name, ov in VARIANTS.items():
        d = tmp_path_factory.mktemp(f"dsv3_fp8_{name}")
        make_random_checkpoint(load_recipe(str(RECIPE), WIDE + ov), d)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def tp1(ckpts):
    """The TP=1 FP8 learner on each checkpoint, one train step (in this process)."""
    from megatron_rz.learner.parallel_check import run_check

    return {name: run_check(str(d), 1, 1, WIDE + VARIANTS[name], world_size=1, steps=1, mode="aligned",
                            recipe_path=str(RECIPE)) for name, d in ckpts.items()}


def _cfg(d: Path) -> dict:
    return dict(json.loads((d / "config.json").read_text()), rz_fp8="blockwise")


@pytest.fixture(scope="module")
def tp_runs(ckpts, tmp_path_factory):
    """Per TP size, both variants' learners (one train step each) from ONE torchrun of tp ranks
    (helpers.parallel_checks: the ranks' start-up paid once, not once per variant)."""
    from helpers import parallel_checks

    out = {}
    for tp in TPS:
        t0 = time.perf_counter()
        jobs = [dict(hf_dir=str(ckpts[name]), tp=tp, ep=1, overrides=WIDE + VARIANTS[name], steps=1, mode="aligned",
                     recipe_path=str(RECIPE)) for name in VARIANTS]
        for name, res in zip(VARIANTS, parallel_checks(jobs, tmp_path_factory.mktemp(f"tp{tp}"), nproc=tp, timeout=800)):
            out[(name, tp)] = res
        REPORT[f"tp={tp} torchrun_s (both variants)"] = round(time.perf_counter() - t0, 1)
    return out


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp8_dsv3_learner_tp_equals_reference_and_tp1(ckpts, tp1, tp_runs, variant, tp):
    from kernels.models.qwen3_dsv3 import reference_logprobs
    from megatron_rz.learner.parallel_check import fixed_batch

    d = ckpts[variant]
    res = tp_runs[(variant, tp)]
    assert res["layout"]["tp"] == tp and res["layout"]["mode"] == "aligned"
    ids, mask, _ = fixed_batch(64)
    m = mask.bool()
    before = reference_logprobs(str(d), _cfg(d), ids)
    after = reference_logprobs(res["weights"], _cfg(d), ids)
    assert torch.equal(res["logprobs_before"][m], before[m])
    assert torch.equal(res["logprobs_after"][m], after[m])
    assert not torch.equal(after[m], before[m])  # the step moved the FP8 logprobs
    base = tp1[variant]
    assert torch.equal(base["logprobs_before"][m], before[m])
    assert torch.equal(res["logprobs_before"][m], base["logprobs_before"][m])
    n = int(m.sum())
    REPORT[f"{variant} tp={tp} == FP8 reference (before, after) and == TP=1 (before)"] = f"{n}/{n}"
    # after the step: TP=1 and TP=t gradients differ by reduction order only (the column-parallel
    # input-gradient all-reduce, the gathered shared expert / q_a weight gradients summed over the
    # ranks' tokens), so the Adam step agrees except on a few near-zero-gradient elements
    gn = [r["metrics"][0]["grad_norm"] for r in (base, res)]
    assert abs(gn[0] - gn[1]) / gn[0] < 1e-5, gn
    off, total, worst = 0, 0, 0.0
    for k, w1 in base["weights"].items():
        diff = (res["weights"][k].float() - w1.float()).abs()
        if ".shared_experts." in k or ".q_a_proj." in k:  # computed whole from gathered shards
            # (a wrong gathered-weight gradient, e.g. one rank's tokens only, moves thousands by ~2 lr)
            assert int((diff > 1e-6).sum()) <= max(2, 1e-3 * diff.numel()) and diff.max().item() < 5e-5, k
        off += int((diff > 1e-6).sum())
        total += diff.numel()
        worst = max(worst, diff.max().item())
    assert off <= 1e-4 * total and worst < 5e-5, (off, total, worst)
    lp_same = int((res["logprobs_after"][m] == base["logprobs_after"][m]).sum())
    REPORT[f"{variant} tp={tp} after a step vs TP=1"] = (
        f"grad_norm rel {abs(gn[0] - gn[1]) / gn[0]:.1e}; {off}/{total} weights off by > 1e-6 (max {worst:.1e}); "
        f"logprobs bitwise {lp_same}/{n}")


def test_fp8_dsv3_learner_tp_refusals():
    from megatron_rz.learner.aligned_spec import check_aligned_supported
    from megatron_rz.recipe import ParallelConfig, load_recipe

    def refused(sets, tp, match):
        r = load_recipe(str(RECIPE), sets)
        with pytest.raises(NotImplementedError, match=match) as e:
            check_aligned_supported(r.model, ParallelConfig(tp=tp))
        assert "\n" not in str(e.value) and "parallel.tp=1" in str(e.value)
        with pytest.raises(Exception, match=match):  # the recipe refuses it at load time too
            load_recipe(str(RECIPE), sets + [f"parallel.tp={tp}"])

    # the tiny recipe: o_proj K = 2 x 32
    refused(["model.fp8=blockwise"], 2, r"model\.num_attention_heads \* model\.v_head_dim = 64 \(a row-parallel K\)")
    # q_proj rows 8 x (32 + 64) = 768: 192 per rank at tp=4
    wide32 = [s for s in WIDE if "qk_nope" not in s]
    refused(wide32, 4, r"model\.num_attention_heads \* \(model\.qk_nope_head_dim \+ model\.qk_rope_head_dim\) = 768: "
                       r"its 192 rows per rank")
    # a dense layer of 1536: K not a multiple of 1024
    refused([s for s in WIDE if "dense" not in s] + ["model.dense_ffn_hidden_size=1536"], 2,
            r"model\.dense_ffn_hidden_size = 1536 \(a row-parallel K\)")
    # supported: the widened model at tp=2 and 4; q_lora_rank is free (q_a computed whole), as are
    # the shared expert's shapes (moe_ffn_hidden_size 64)
    for sets, tp in ((WIDE, 2), (WIDE, 4), (WIDE + ["model.q_lora_rank=128"], 4)):
        r = load_recipe(str(RECIPE), sets + [f"parallel.tp={tp}"])
        check_aligned_supported(r.model, r.parallel)


def test_zz_report():
    if REPORT:
        print("\n[dsv3 fp8 learner tp report] " + json.dumps(REPORT, indent=1, default=str))
