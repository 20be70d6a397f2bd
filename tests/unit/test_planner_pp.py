"""Pipeline-parallel rollout engines (rollout.pipeline_parallel_size; docs/tp.md "Pipeline parallel"):
the planner's stage partition (vLLM's), per-stage weights and KV cache, GPUs per engine = TP x PP,
its refusals, the recipe key's validation, and what rz submit renders for an engine of two nodes.
The engine itself: tests/integration/test_aligned_vllm_pp.py."""

from pathlib import Path

import pytest

from megatron_rz.launch.planner import (PlanError, count_params, make_plan, pp_stage_layers,
                                        rollout_sharded_params, stage_params)
from megatron_rz.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def _recipe(name, *overrides):
    return load_recipe(ROOT / "recipes" / f"{name}.yaml", list(overrides))


@pytest.mark.parametrize("n, pp", [(61, 2), (4, 2), (7, 3), (10, 4), (5, 5), (62, 8), (9, 1)])
def test_stage_partition_is_vllms(n, pp):
    stages = pp_stage_layers(n, pp)
    assert stages[0][0] == 0 and stages[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(stages, stages[1:])) and all(e > s for s, e in stages)
    vllm_utils = pytest.importorskip("vllm.distributed.utils")
    assert stages == [vllm_utils.get_pp_indices(n, r, pp) for r in range(pp)]


@pytest.mark.parametrize("name", ["deepseek_v3_671b", "qwen3_30b_a3b", "r1_distill_qwen_1p5b"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_parameters_add_up_to_the_model(name, pp):
    m = _recipe(name).model
    stages = pp_stage_layers(m.num_layers, pp)
    assert sum(stage_params(m, s, e, pp) for s, e in stages) == count_params(m).total
    if m.arch != "qwen2":
        assert sum(rollout_sharded_params(m, range(s, e)) for s, e in stages) == rollout_sharded_params(m)


def test_deepseek_v3_671b_aligned_tp8_pp2_fits_an_h200():
    """The recipe as it ships: mode=aligned, 2 engines of TP 8 x PP 2 on 4 nodes of 8 H200."""
    r = _recipe("deepseek_v3_671b")
    assert (r.mode, r.rollout.tensor_parallel_size, r.rollout.pipeline_parallel_size) == ("aligned", 8, 2)
    m, plan = r.model, make_plan(r)
    assert plan.rollout_gpus == r.rollout.num_engines * 8 * 2 == 32
    assert pp_stage_layers(61, 2) == [(0, 31), (31, 61)]
    def per_gpu(s, e):  # replicated parts of the stage whole, its sharded parts over 8
        split = rollout_sharded_params(m, range(s, e))
        return ((stage_params(m, s, e, 2) - split) + split / 8) * 2 / GiB

    w0, w1 = per_gpu(0, 31), per_gpu(31, 61)
    assert plan.rollout_mem["weights"] == pytest.approx(max(w0, w1), abs=1e-9)
    whole = _recipe("deepseek_v3_671b", "rollout.pipeline_parallel_size=1", "rollout.num_engines=4",
                    "cluster.rollout.gpu_memory_gb=2000")
    w_pp1 = make_plan(whole).rollout_mem["weights"]  # 165.1 GiB: the TP=8 engine without stages
    assert w0 + w1 == pytest.approx(w_pp1, abs=1e-6)  # every parameter in exactly one stage
    assert 164 < w_pp1 < 166 and 84 < plan.rollout_mem["weights"] < 86
    # KV: a stage caches its layers only: 31 of 61 layers of the expanded per-head MLA cache
    per_token = 2 * (128 // 8) * (128 + 64) * 2 * 31
    assert plan.rollout_seqs_fit == pytest.approx(40 * GiB / (16384 * per_token))
    assert plan.rollout_total < 139 and plan.rollout_budget == 139
    assert any("layers 0-30" in n and "layers 31-60" in n for n in plan.notes)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        # GPUs per engine = TP x PP
        (["rollout.num_engines=4"], "rollout.num_engines * tensor_parallel_size * pipeline_parallel_size = "
                                    "4 * 8 * 2 = 64 GPUs"),
        # more stages than layers
        (["model.num_layers=4", "model.first_k_dense=1", "rollout.tensor_parallel_size=2",
          "rollout.pipeline_parallel_size=8"], "rollout.pipeline_parallel_size=8 exceeds model.num_layers=4"),
        # TP must stay inside a node when the stages span nodes
        (["mode=fast", "rollout.tensor_parallel_size=16", "rollout.num_engines=1"],
         "rollout.tensor_parallel_size=16 must divide cluster.rollout.gpus_per_node=8 with "
         "rollout.pipeline_parallel_size=2"),
        # too little memory even with stages: the fix names the key
        (["rollout.kv_cache_gb=100"], "raise rollout.pipeline_parallel_size (now 2"),
    ],
)
def test_pp_refusals_name_the_key(overrides, fragment):
    r = _recipe("deepseek_v3_671b", *overrides)
    with pytest.raises(PlanError) as e:
        make_plan(r)
    assert fragment in str(e.value), str(e.value)


def test_aligned_classes_without_stages_refuse_pp():
    r = _recipe("deepseek_v4_flash", "mode=aligned", "rollout.pipeline_parallel_size=2",
                "rollout.tensor_parallel_size=4", "cluster.rollout.gpu_memory_gb=2000")
    with pytest.raises(PlanError) as e:
        make_plan(r)
    msg = str(e.value)
    assert "rollout.pipeline_parallel_size=2: the aligned deepseek_v4 vLLM class has no pipeline stages" in msg, msg


@pytest.mark.parametrize("value", ["0", "-1"])
def test_recipe_key_is_validated(value):
    with pytest.raises((RecipeError, ValueError)) as e:
        _recipe("tiny_dsv3", f"rollout.pipeline_parallel_size={value}")
    msg = str(e.value)
    assert "rollout.pipeline_parallel_size" in msg and ">= 1" in msg and "\n" not in msg.strip(), msg


def test_engine_args_and_submit_for_an_engine_of_two_nodes():
    from megatron_rz.launch.submit import render, rollout_tasks

    assert "pipeline_parallel_size" not in _recipe("tiny_dsv3").engine_kwargs()  # PP=1: unchanged
    r = _recipe("deepseek_v3_671b")
    kw = r.engine_kwargs()
    assert kw["tensor_parallel_size"] == 8 and kw["pipeline_parallel_size"] == 2 and kw["aligned"]
    assert rollout_tasks(r) == {"tasks_per_node": 1, "engine_nodes": 2, "hosts": 2, "procs": 4}
    script = render(r, workdir=ROOT).script
    assert '"pipeline_parallel_size": 2' in script and "--nnodes 2 --node-rank \"$RANK\"" in script
    assert "--aligned" in script and "tensor_parallel_size=8 x pipeline_parallel_size=2" in script


def test_serve_command_passes_pipeline_parallel_size(tmp_path):
    pytest.importorskip("vllm")
    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from vllm_bridge.serve import serve_command

    ckpt = tmp_path / "ckpt"
    make_random_checkpoint(_recipe("tiny_dsv3", "model.num_layers=4"), ckpt)
    key = tmp_path / "key"
    key.write_text("k\n")
    key.chmod(0o600)
    argv, _ = serve_command(str(ckpt), port=1, key_file=str(key), nnodes=2, node_rank=0, master_addr="h",
                            master_port=5, engine_args={"max_model_len": 64, "tensor_parallel_size": 8,
                                                        "pipeline_parallel_size": 2})
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8" and argv[argv.index("--nnodes") + 1] == "2"
