"""Layout planner: parameter counts, the shipped full-size layouts, and layouts it must refuse."""

from pathlib import Path

import pytest

from megatron_rz.launch.planner import PlanError, count_params, make_plan, rollout_sharded_params
from megatron_rz.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
FULL = ["r1_distill_qwen_1p5b", "qwen3_30b_a3b", "deepseek_v3_671b", "deepseek_v4_flash"]
# Published sizes: total and activated parameters per token (model cards / tech reports; V3's
# 671B excludes its 14B multi-token-prediction module).
PUBLISHED = {
    "r1_distill_qwen_1p5b": (1.78e9, 1.78e9),
    "qwen3_30b_a3b": (30.5e9, 3.3e9),
    "deepseek_v3_671b": (671e9, 37e9),
    "deepseek_v4_flash": (284e9, 13e9),
}


def _recipe(name, *overrides):
    return load_recipe(ROOT / "recipes" / f"{name}.yaml", list(overrides))


@pytest.mark.parametrize("name", FULL)
def test_parameter_counts_match_published_sizes(name):
    c = count_params(_recipe(name).model)
    total, active = PUBLISHED[name]
    assert abs(c.total - total) / total < 0.02, c.total
    # "activated" figures round and differ in whether embeddings count: a looser bound
    assert abs(c.active - active) / active < 0.07, c.active


def _hf_model(m):
    """The Hugging Face module of a ModelConfig, on the meta device (no memory)."""
    import torch
    import transformers as tf

    common = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_kv_heads,
                  tie_word_embeddings=m.tie_word_embeddings)
    with torch.device("meta"):
        if m.arch == "qwen2":
            return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, intermediate_size=m.dense_ffn_hidden_size))
        if m.arch == "qwen3_moe" and m.num_experts == 0:
            return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=m.head_dim,
                                                      intermediate_size=m.dense_ffn_hidden_size))
        if m.arch == "qwen3_moe":
            return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
                **common, head_dim=m.head_dim, moe_intermediate_size=m.moe_ffn_hidden_size,
                num_experts=m.num_experts, num_experts_per_tok=m.top_k))
        if m.arch == "deepseek_v3":
            return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
                **common, intermediate_size=m.dense_ffn_hidden_size, moe_intermediate_size=m.moe_ffn_hidden_size,
                n_routed_experts=m.num_experts, n_shared_experts=m.num_shared_experts, num_experts_per_tok=m.top_k,
                first_k_dense_replace=m.first_k_dense, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                v_head_dim=m.v_head_dim, n_group=m.router_num_groups, topk_group=m.router_group_topk))
        return tf.DeepseekV4ForCausalLM(tf.DeepseekV4Config(
            **common, head_dim=m.head_dim, q_lora_rank=m.q_lora_rank, moe_intermediate_size=m.moe_ffn_hidden_size,
            n_routed_experts=m.num_experts, n_shared_experts=m.num_shared_experts, num_experts_per_tok=m.top_k,
            o_groups=m.o_groups, o_lora_rank=m.o_lora_rank, hc_mult=m.hc_mult, index_n_heads=m.index_n_heads,
            index_head_dim=m.index_head_dim, sliding_window=m.sliding_window,
            compress_ratios=list(m.compress_ratios), qk_rope_head_dim=m.qk_rope_head_dim))


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("r1_distill_qwen_1p5b", ["model.num_layers=2"]),
        ("qwen3_30b_a3b", ["model.num_layers=2"]),
        ("deepseek_v3_671b", ["model.num_layers=4", "model.num_experts=16", "parallel.ep=16"]),
        # every V4 layer kind: sliding window only (0), compressed sparse (4), heavily compressed (128)
        ("deepseek_v4_flash", ["model.num_layers=3", "model.compress_ratios=[0, 4, 128]", "model.num_experts=8",
                               "parallel.ep=8"]),
    ],
)
def test_parameter_formula_is_exact_against_hugging_face(name, overrides):
    pytest.importorskip("transformers")
    m = _recipe(name, *overrides).model
    hf = sum(p.numel() for p in _hf_model(m).parameters())
    assert count_params(m).total == hf


@pytest.mark.parametrize("name", FULL)
def test_shipped_full_size_layouts_fit(name):
    r = _recipe(name)
    plan = make_plan(r)
    g = r.cluster.learner
    assert plan.learner_ranks == g.nodes * g.gpus_per_node
    assert plan.learner_total <= g.gpu_memory_gb
    assert plan.rollout_total <= r.cluster.rollout.gpu_memory_gb
    assert plan.rollout_seqs_fit >= 1


def test_tiny_recipe_on_cpu_nodes_is_planned_not_budgeted():
    plan = make_plan(load_recipe(ROOT / "recipes" / "tiny_moe.yaml"))
    assert plan.learner_gpus == 0 and plan.learner_budget is None
    assert plan.learner_ranks == plan.learner_ranks_per_node == 1


@pytest.mark.parametrize(
    "name, overrides, fragments",
    [
        # more ranks than GPUs
        ("qwen3_30b_a3b", ["parallel.dp=4"], ["tp*pp*dp = 4*1*4 = 16 ranks", "1 nodes x 8 GPUs = 8"]),
        # tensor parallelism across nodes
        ("deepseek_v3_671b", ["parallel.tp=16", "parallel.dp=8"], ["parallel.tp=16 must divide", "gpus_per_node=8"]),
        # rollout engines do not match the rollout GPUs
        ("qwen3_30b_a3b", ["rollout.num_engines=3"], ["3 * 1 = 3 GPUs", "1 nodes x 8 GPUs = 8"]),
        # every expert on every GPU: 30B x 18 bytes cannot fit 139 GiB
        ("qwen3_30b_a3b", ["parallel.ep=1"], ["learner needs", "GiB per GPU", "optimizer", "gpu_memory_gb=139"]),
        # DeepSeek-V4 (tp=1: 7.3B non-expert parameters on every GPU) without the distributed optimizer
        ("deepseek_v4_flash", ["parallel.distributed_optimizer=false"], ["learner needs", "GiB per GPU"]),
        # the aligned Qwen3-MoE class shards only at tp dividing the row-parallel K segments
        # (kernels.ROW_PARALLEL_K_SEGMENTS = 8) and its 4 KV heads
        ("qwen3_30b_a3b", ["rollout.tensor_parallel_size=16", "rollout.num_engines=1", "cluster.rollout.nodes=2"],
         ["rollout.tensor_parallel_size=16 does not divide the 8 row-parallel K segments",
          "model.num_kv_heads=4 is not divisible by rollout.tensor_parallel_size=16",
          "shards only at a tensor-parallel size dividing 8", "use rollout.tensor_parallel_size=1/2/4", "mode=fast"]),
        # rollout TP 16 (one engine over two nodes without pipeline stages) in mode=aligned: beyond what
        # the aligned DeepSeek-V3 class shards over (the recipe runs TP 8 x PP 2: test_planner_pp.py)
        ("deepseek_v3_671b", ["rollout.tensor_parallel_size=16", "rollout.pipeline_parallel_size=1"],
         ["rollout.tensor_parallel_size=16 does not divide the 8",
                                                "use rollout.tensor_parallel_size=1/2/4/8"]),
        # the aligned DeepSeek-V4 class shards (docs/tp.md), but not over 4 GPUs at this size
        ("deepseek_v4_flash", ["mode=aligned", "rollout.tensor_parallel_size=4", "rollout.num_engines=8"],
         ["rollout engine needs 182.6 GiB per GPU (weights 136.6 over tensor_parallel_size=4",
          "raise rollout.tensor_parallel_size (to 8)"]),
        # weights of 671B in bf16 over 8 GPUs per engine (stock vLLM, no pipeline stages)
        ("deepseek_v3_671b", ["mode=fast", "rollout.pipeline_parallel_size=1", "rollout.tensor_parallel_size=8",
                              "rollout.num_engines=4"],
         ["rollout engine needs", "tensor_parallel_size=8"]),
        # a KV cache too small for one sequence
        ("r1_distill_qwen_1p5b", ["rollout.kv_cache_gb=0.1"], ["rollout.kv_cache_gb=0.1 holds 0.",
                                                              "sequences of 16384 tokens"]),
        # expert parallelism on a dense model
        ("r1_distill_qwen_1p5b", ["parallel.ep=2"], ["dense model"]),
        # CPU nodes that cannot hold the ranks evenly
        ("r1_distill_qwen_1p5b", ["cluster.learner.gpus_per_node=0", "cluster.learner.nodes=3"],
         ["8 ranks cannot be spread"]),
    ],
)
def test_impossible_layouts_are_refused_with_numbers(name, overrides, fragments):
    r = _recipe(name, *overrides)
    with pytest.raises(PlanError) as e:
        make_plan(r)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, msg


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["cluster.time_limit=2h"], "not a SLURM time"),
        (["cluster.time_limit=00:05:00", "cluster.signal_warning_s=600"], "signal_warning_s=600 is not shorter"),
        (["cluster.signal_warning_s=70000"], "SLURM's --signal limit"),
        (["cluster.mounts=[/data:/data]"], "set cluster.container_image"),
        (["cluster.container_image=img.sqsh", "cluster.mounts=[/data]"], "not SRC:DST"),
        (["cluster.sbatch_extra=[--time=10]"], "sets --time, which rz submit writes itself"),
        (["cluster.sbatch_extra=[exclusive]"], "must be one sbatch option"),
        (["cluster.partition=gpu; rm -rf /"], "characters SLURM names never contain"),
        (["cluster.learner.gpus_per_node=8"], "gpu_memory_gb is needed with GPUs"),
        (["cluster.learner.nodes=0"], "nodes must be >= 1"),
        (["cluster.env={1BAD: x}"], "not a shell variable name"),
        (["cluster.learner.gpus_per_nodes=8"], "gpus_per_node"),  # unknown key: strict, with a suggestion
        (["model.arch=deepseek_v4"], "compress_ratios"),
    ],
)
def test_bad_cluster_settings_fail_at_load(overrides, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe(ROOT / "recipes" / "tiny_moe.yaml", overrides)
    assert fragment in str(e.value)


def test_aligned_rollout_sharding_in_the_plan():
    """Aligned Qwen3-MoE at TP 2 divides the rollout weights (all but embeddings/lm_head, norms and
    router) and the KV cache per GPU; an aligned replicated class (Qwen2) at TP > 1 does not
    (whole model per worker, a note)."""
    r = _recipe("qwen3_30b_a3b")
    one = make_plan(r)
    two = make_plan(_recipe("qwen3_30b_a3b", "rollout.tensor_parallel_size=2", "rollout.num_engines=4"))
    m = r.model
    replicated = (151936 * 2048 * 2  # untied embeddings + lm_head
                  + m.num_layers * (2 * 2048 + 2 * m.head_dim + m.num_experts * 2048)  # norms, q/k norms, router
                  + 2048)  # final norm
    sharded = count_params(m).total - replicated
    assert sharded == rollout_sharded_params(m)
    assert abs(one.rollout_mem["weights"] - count_params(m).total * 2 / 2**30) < 1e-6
    assert abs(two.rollout_mem["weights"] - (replicated + sharded / 2) * 2 / 2**30) < 1e-6
    assert two.rollout_seqs_fit > 1.9 * one.rollout_seqs_fit
    big = ["cluster.rollout.gpu_memory_gb=2000", "cluster.learner.gpu_memory_gb=2000"]
    q2 = ["rollout.tensor_parallel_size=2", "rollout.num_engines=4", "cluster.rollout.nodes=1",
          "cluster.rollout.gpus_per_node=8", *big]
    rep = make_plan(_recipe("r1_distill_qwen_1p5b", "mode=aligned", *q2))
    fast = make_plan(_recipe("r1_distill_qwen_1p5b", "mode=fast", *q2))
    assert abs(rep.rollout_mem["weights"] - 2 * fast.rollout_mem["weights"]) < 1e-6
    assert any("not sharded yet" in n for n in rep.notes)


@pytest.mark.parametrize("lag", [2, 8])
def test_r1_distill_is_dense_qwen2_and_plans_aligned(lag):
    """The paper's main run: DeepSeek-R1-Distill-Qwen-1.5B as a dense Qwen2 (q/k/v biases counted:
    (1536 + 1) * (12 + 2 * 2) * 128 per layer's q/k/v), aligned mode at lag 2 and 8."""
    r = _recipe("r1_distill_qwen_1p5b", f"schedule.max_lag={lag}")
    m = r.model
    assert (m.arch, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_dim) == \
        ("qwen2", 28, 1536, 12, 2, 128)
    assert (m.dense_ffn_hidden_size, m.vocab_size, m.tie_word_embeddings, m.rope_theta, m.num_experts) == \
        (8960, 151936, False, 10000.0, 0)
    assert r.mode == "aligned" and r.schedule.max_lag == lag
    c = count_params(m)
    # Qwen2.5-1.5B's published 1,543,714,304 (tied) plus R1-Distill's untied 151936 x 1536 lm_head
    assert c.total == 1_543_714_304 + 151936 * 1536 == 1_777_088_000
    plan = make_plan(r)
    assert plan.learner_total <= r.cluster.learner.gpu_memory_gb and plan.rollout_seqs_fit >= 1
