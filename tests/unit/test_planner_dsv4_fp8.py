"""Planner with blockwise FP8 for DeepSeek-V4 (docs/tp.md "FP8"): the e4m3 copies it counts
(``fp8_weights``) are the elements of the model's FP8 linears (``kernels.models.dsv4.FP8_LINEARS``,
read from the model's own parameter table), the TP-split ones over t; the FP8 TP rules refuse a
rollout TP size in one line naming the key."""

from pathlib import Path

import pytest

from megatron_rz.launch.planner import (PlanError, check_rollout_tp, make_plan, rollout_fp8_cache_params,
                                        rollout_sharded_params)
from megatron_rz.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
SPLIT = ("attn.wq_b.weight", "attn.wo_a.weight", "attn.wo_b.weight")  # TP-split FP8 linears (+ routed experts)


def _fp8_elements(recipe, tp: int) -> float:
    """Per engine worker, from the V4 model's parameter table: FP8 linears split over tp or whole."""
    import torch

    from kernels.models import dsv4 as R
    from megatron_rz.learner.tiny_models import hf_config

    shapes = R.parameter_shapes(R.v4_config(hf_config(recipe.model, 1, 0)))
    n = 0.0
    for name, (shape, _) in shapes.items():
        rel = name.split(".", 2)[2] if name.startswith("layers.") else name
        if not R.FP8_LINEARS.match(rel):
            continue
        k = torch.Size(shape).numel()
        n += k / tp if rel in SPLIT or rel.startswith("ffn.experts.") else k
    return n


@pytest.mark.parametrize("name, tp, extra", [("tiny_dsv4", 1, []), ("tiny_dsv4", 2, ["model.o_lora_rank=512"]),
                                             ("tiny_dsv4", 4, ["model.o_lora_rank=512"])])
def test_fp8_copies_are_the_fp8_linears(name, tp, extra):
    over = ["model.fp8=blockwise", "model.o_lora_rank=128", *extra, f"rollout.tensor_parallel_size={tp}"]
    r = load_recipe(ROOT / "recipes" / f"{name}.yaml", over)
    plan = make_plan(r)
    want = _fp8_elements(r, tp)
    split = rollout_sharded_params(r.model) if tp > 1 else 0
    assert rollout_fp8_cache_params(r.model, tp, split) == want
    assert abs(plan.rollout_mem["fp8_weights"] - want * (1 + 4 / 128 ** 2) / GiB) < 1e-9


def test_flagship_v4_fp8_plan_and_tp_refusal():
    flash = ROOT / "recipes" / "deepseek_v4_flash.yaml"
    r = load_recipe(flash, ["model.fp8=blockwise", "cluster.rollout.gpu_memory_gb=2000"])
    plan = make_plan(r)  # TP=8; o_groups 8 x o_lora_rank 1024: wo_b's K = 8192, wq_b rows per rank 64 x 512 / 8
    tp = r.rollout.tensor_parallel_size
    assert tp == 8
    fp8 = plan.rollout_mem["fp8_weights"]
    assert fp8 == pytest.approx(_fp8_elements(r, tp) * (1 + 4 / 128 ** 2) / GiB)
    assert 0.45 < fp8 / plan.rollout_mem["weights"] < 0.5  # ~1 byte of 2 (bf16)
    print(f"\ndeepseek_v4_flash fp8 TP=8 per GPU: weights {plan.rollout_mem['weights']:.2f} + fp8 copies {fp8:.2f} GiB")
    # on H200s (139 GiB) the e4m3 copies next to the bf16 weights no longer fit with the 40 GiB cache
    with pytest.raises(PlanError, match=r"rollout engine needs 151\.2 GiB per GPU"):
        make_plan(load_recipe(flash, ["model.fp8=blockwise"]))
    # wo_b's K = 2 x 128: the 8 FP8 segment chains need K % 1024 == 0
    bad = load_recipe(ROOT / "recipes" / "tiny_dsv4.yaml", ["model.fp8=blockwise", "model.o_lora_rank=128",
                                                            "rollout.tensor_parallel_size=2"])
    with pytest.raises(PlanError) as e:
        check_rollout_tp(bad)
    msg = str(e.value)
    assert "\n" not in msg and "(the row-parallel FP8 K of wo_b) is not a multiple of 8 x 128 = 1024" in msg, msg
    assert "use rollout.tensor_parallel_size=1, or model.fp8=none" in msg and "mode=fast" not in msg, msg  # FP8 is aligned-only
