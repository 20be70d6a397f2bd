"""Layout planner and the tensor-parallel aligned vLLM classes (Qwen3-MoE, DeepSeek-V3):
per-GPU weights and KV cache as the sharded classes hold them, and the refusals of a rollout
tensor-parallel size those classes' ``_tp_config`` would reject, at planning time in one line."""

import math
from pathlib import Path

import pytest

from megatron_rz.launch.planner import PlanError, check_rollout_tp, count_params, make_plan, rollout_sharded_params
from megatron_rz.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
BIG = ["cluster.rollout.gpu_memory_gb=2000", "cluster.learner.gpu_memory_gb=2000"]


def _recipe(name, *overrides):
    return load_recipe(ROOT / "recipes" / f"{name}.yaml", list(overrides))


def test_aligned_deepseek_v3_at_tp8_holds_an_eighth_of_the_sharded_parts():
    r = _recipe("deepseek_v3_671b", "mode=aligned", "rollout.tensor_parallel_size=8", "rollout.pipeline_parallel_size=1",
                "rollout.num_engines=4", *BIG)
    m, plan = r.model, make_plan(r)
    c = count_params(m)
    h = m.hidden_size
    # replicated on every worker: embeddings, lm_head, final norm, router, shared experts, and per
    # layer the MLA latent projections q_a_proj / kv_a_proj_with_mqa, their norms and the layer norms
    replicated = (c.embedding + c.output + c.final_norm + c.router + c.shared_experts
                  + m.num_layers * (h * m.q_lora_rank + m.q_lora_rank + h * (m.kv_lora_rank + m.qk_rope_head_dim)
                                    + m.kv_lora_rank + 2 * h))
    assert c.total - replicated == rollout_sharded_params(m)
    weights = plan.rollout_mem["weights"]
    assert abs(weights - (replicated + (c.total - replicated) / 8) * 2 / GiB) < 1e-6
    full = c.total * 2 / GiB
    assert full / 8 < weights < 1.07 * full / 8  # ~1/8: the replicated parts are < 1% of 671B
    assert 164 < weights < 166  # 165.1 GiB: more than an H200 (139 GiB) holds
    # expanded MLA cache, split by heads: K and V of 128/8 heads x (128 + 64) values, bf16, 61 layers
    per_token = 2 * (128 // 8) * (128 + 64) * 2 * 61
    assert abs(plan.rollout_seqs_fit - 40 * GiB / (16384 * per_token)) < 1e-6
    assert not any("not sharded yet" in n for n in plan.notes)


def test_aligned_deepseek_v3_at_tp8_does_not_fit_an_h200():
    r = _recipe("deepseek_v3_671b", "mode=aligned", "rollout.tensor_parallel_size=8", "rollout.pipeline_parallel_size=1",
                "rollout.num_engines=4")
    with pytest.raises(PlanError) as e:
        make_plan(r)
    msg = str(e.value)
    assert "rollout engine needs 211.1 GiB per GPU (weights 165.1 over tensor_parallel_size=8" in msg, msg
    assert "the weights and overhead alone exceed it" in msg and "mode=fast" in msg, msg


def test_fp8_aligned_shards_and_counts_fp8_copies():
    """model.fp8=blockwise shards like the unquantised model (docs/tp.md "FP8"); the e4m3 copies of the
    FP8 linears (1 byte + one fp32 scale per 128x128 block) are counted on top, 1/tp of the split
    ones per worker; a model whose row-parallel K is not a multiple of 1024 is refused in one line."""
    from megatron_rz.launch.planner import rollout_fp8_cache_params

    r = _recipe("qwen3_30b_a3b", "model.fp8=blockwise", "parallel.tp=1", "parallel.dp=8",
                "rollout.tensor_parallel_size=2", "rollout.num_engines=4", *BIG)
    m, plan = r.model, make_plan(r)
    c, split = count_params(m), rollout_sharded_params(m)
    assert abs(plan.rollout_mem["weights"] - (c.total - split + split / 2) * 2 / GiB) < 1e-6
    fp8 = plan.rollout_mem["fp8_weights"]
    assert abs(fp8 - (split / 2 + c.shared_experts) * (1 + 4 / 128 ** 2) / GiB) < 1e-6
    assert rollout_fp8_cache_params(m, 2, split) == split / 2  # Qwen3-MoE: no shared experts
    assert 0.45 * plan.rollout_mem["weights"] < fp8 < 0.5 * plan.rollout_mem["weights"]  # ~1 of 2 bytes
    assert not any("not sharded yet" in n for n in plan.notes)
    check_rollout_tp(_recipe("qwen3_30b_a3b", "model.fp8=blockwise", "parallel.tp=1", "parallel.dp=8",
                             "rollout.tensor_parallel_size=4"))
    with pytest.raises(PlanError) as e:  # tiny_moe: o_proj K = 4 x 32 = 128
        check_rollout_tp(_recipe("tiny_moe", "model.fp8=blockwise", "rollout.tensor_parallel_size=2"))
    msg = str(e.value)
    assert "\n" not in msg and "model.num_attention_heads * model.head_dim=128 (a row-parallel FP8 K)" in msg, msg
    assert "use rollout.tensor_parallel_size=1" in msg and "=1/2" not in msg, msg


def test_qwen3_kv_heads_refused_at_planning_time_in_one_line():
    """tiny_moe (2 KV heads) at rollout TP 4: refused by the planner, not by the vLLM workers after
    the warm start."""
    r = _recipe("tiny_moe", "rollout.tensor_parallel_size=4")
    with pytest.raises(PlanError) as e:
        check_rollout_tp(r)
    msg = str(e.value)
    assert "\n" not in msg
    assert "model.num_kv_heads=2 is not divisible by rollout.tensor_parallel_size=4" in msg, msg
    assert "use rollout.tensor_parallel_size=1/2, or mode=fast" in msg, msg
    with pytest.raises(PlanError) as e:
        make_plan(r)
    assert "model.num_kv_heads=2 is not divisible by rollout.tensor_parallel_size=4" in str(e.value)
    check_rollout_tp(_recipe("tiny_moe", "rollout.tensor_parallel_size=4", "model.num_kv_heads=4"))
    check_rollout_tp(_recipe("tiny_moe", "mode=fast", "rollout.tensor_parallel_size=4"))  # stock vLLM replicates


@pytest.mark.parametrize(
    "name, overrides, fragment",
    [
        ("tiny_moe", ["rollout.tensor_parallel_size=3", "model.num_attention_heads=6", "model.num_kv_heads=3"],
         "rollout.tensor_parallel_size=3 does not divide the 8 row-parallel K segments"),
        ("qwen3_30b_a3b", ["rollout.tensor_parallel_size=4", "rollout.num_engines=2", "model.num_experts=10",
                           "parallel.ep=2"], "model.num_experts=10 is not divisible by rollout.tensor_parallel_size=4"),
        ("deepseek_v3_671b", ["mode=aligned", "rollout.tensor_parallel_size=8", "rollout.num_engines=4",
                              "model.num_attention_heads=36", "model.num_kv_heads=36", "parallel.tp=4",
                              "parallel.dp=32", *BIG],
         "model.num_attention_heads=36 is not divisible by rollout.tensor_parallel_size=8"),
        ("deepseek_v3_671b", ["mode=aligned", "rollout.tensor_parallel_size=8", "rollout.num_engines=4",
                              "model.dense_ffn_hidden_size=18436", *BIG],
         "model.dense_ffn_hidden_size=18436 is not divisible by rollout.tensor_parallel_size=8"),
    ],
)
def test_sharded_tp_refusals_name_the_key(name, overrides, fragment):
    r = _recipe(name, *overrides)
    with pytest.raises(PlanError) as e:
        check_rollout_tp(r)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(PlanError) as e:
        make_plan(r)
    assert fragment in str(e.value), str(e.value)


def _v4_engine_split(r):
    """Elements the aligned V4 engine splits over its TP ranks, from the engine's own parameter table
    (kernels.models.dsv4.parameter_shapes; the names vllm_bridge/aligned/deepseek_v4.py shards)."""
    import re

    from kernels.models import dsv4
    from megatron_rz.learner.tiny_models import hf_config

    split = re.compile(r"^layers\.\d+\.(attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)|ffn\.experts\.)")
    shapes = dsv4.parameter_shapes(dsv4.v4_config(hf_config(r.model, 1, 0)))
    return sum(math.prod(s) for name, (s, _) in shapes.items() if split.match(name))


def test_aligned_deepseek_v4_flash_at_tp8_fits_an_h200():
    """The tensor-parallel aligned V4 class (docs/tp.md "DeepSeek-V4"): heads (wq_b, attn_sink), wo_a by
    rows, wo_b by K and routed experts split over 8, the rest replicated; the cache (one KV head)
    whole on every rank. 71.0 GiB of weights per GPU (575.6 GiB replicated), 117.0 GiB with 40 GiB of
    cache and the overhead: fits the 139 GiB of an H200."""
    r = _recipe("deepseek_v4_flash", "mode=aligned")
    m, plan = r.model, make_plan(r)
    c, split = count_params(m), rollout_sharded_params(m)
    assert split == _v4_engine_split(r)
    assert abs(plan.rollout_mem["weights"] - (c.total - split + split / 8) * 2 / GiB) < 1e-6
    assert 71.0 < plan.rollout_mem["weights"] < 71.1
    assert 117.0 < sum(plan.rollout_mem.values()) < 117.1 <= r.cluster.rollout.gpu_memory_gb
    # the compact cache, replicated over the 8 ranks (kernels/models/dsv4_cache.py; docs/architecture.md
    # "The DeepSeek-V4 cache"): per token the entries row of fp8 entries (stock's format), x4 layers
    # (584 + 132) / 4 = 179 bytes, x128 layers 584 / 128 -> 5 (20 x 179 + 23 x 5 = 3695 B = 1848 bf16
    # values, padded to 2048); per sequence a 128-token window of payload rows (20 x 3072 + 23 x 1536 =
    # 96768 values, padded to 98304 = 48 entries rows)
    assert abs(plan.rollout_seqs_fit - 40 * GiB / (16384 * 2048 * 2 + 128 * 98304 * 2)) < 1e-6
    assert int(plan.rollout_seqs_fit) == 465
    stock = make_plan(_recipe("deepseek_v4_flash", "mode=fast"))
    assert int(stock.rollout_seqs_fit) == 547  # 3755.25 B per token + 16.2 MiB per sequence
    assert plan.rollout_seqs_fit >= 0.8 * stock.rollout_seqs_fit
    assert not any("not sharded yet" in n for n in plan.notes)


def test_aligned_deepseek_v4_refusals_in_one_line():
    check_rollout_tp(_recipe("tiny_dsv4", "rollout.tensor_parallel_size=4"))  # 16 heads, 64 experts, K 128
    for overrides, key in [(["model.num_experts=6", "model.top_k=2"], "model.num_experts=6 is not divisible"),
                           (["model.o_groups=1", "model.o_lora_rank=63"], "model.o_groups * model.o_lora_rank=63"),
                           (["rollout.tensor_parallel_size=3"], "rollout.tensor_parallel_size=3 does not divide")]:
        ov = ["rollout.tensor_parallel_size=4", *overrides] if "tensor_parallel_size" not in overrides[0] else overrides
        with pytest.raises(PlanError) as e:
            check_rollout_tp(_recipe("tiny_dsv4", *ov))
        msg = str(e.value)
        assert "\n" not in msg and key in msg and "mode=fast" in msg, msg
