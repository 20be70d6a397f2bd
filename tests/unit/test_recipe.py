"""Recipe validation: every shipped recipe loads, bad input fails before any engine starts."""

from pathlib import Path

import pytest

from megatron_rz.recipe import Recipe, RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    r = load_recipe(path)
    assert isinstance(r, Recipe)
    assert r.name == path.stem


def test_override_types_and_nesting():
    r = load_recipe(None, ["algo.lr=3e-5", "rollout.samples_per_prompt=4", "logging.wandb=false", "task.ops=[+, -]"])
    assert r.algo.lr == 3e-5 and isinstance(r.algo.lr, float)
    assert r.rollout.samples_per_prompt == 4
    assert r.logging.wandb is False
    assert r.task.ops == ["+", "-"]


def test_unknown_override_key_names_key_and_suggests_fix():
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["algo.learning_rate=1e-4"])
    msg = str(e.value)
    assert "algo.learning_rate" in msg and "lr" in msg.split("has no")[1]


def test_unknown_yaml_key_names_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rollout:\n  temperture: 0.7\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert "rollout.temperture" in str(e.value) and "temperature" in str(e.value)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model.top_k=9"], "top_k=9 exceeds num_experts=8"),
        (["parallel.ep=3"], "ep*etp=3 must divide tp*dp=1"),
        (["parallel.ep=2"], "must divide tp*dp"),
        (["parallel.tp=2", "model.num_kv_heads=1", "model.num_attention_heads=2"], "parallel.tp=2 must divide"),
        (["rollout.temperature=0"], "temperature must be > 0"),
        (["rollout.samples_per_prompt=1"], "group-mean baseline"),
        (["model.head_dim=16"], "head_dim=16"),
        (["parallel.pp=2"], "pp"),
        (["model.arch=deepseek_v3", "model.kv_lora_rank=256"], "kv_lora_rank=512"),
        (["model.arch=llama"], "model.arch"),
    ],
)
def test_impossible_values_fail_with_the_key(overrides, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, overrides)
    assert fragment in str(e.value)


def test_missing_recipe_file():
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("recipes/does_not_exist.yaml")


def test_malformed_override():
    with pytest.raises(RecipeError, match="key.path=value"):
        load_recipe(None, ["algo.lr"])


def test_cli_reports_recipe_errors_without_traceback(capsys):
    from megatron_rz.cli import main

    assert main(["validate", str(ROOT / "recipes" / "tiny_moe.yaml"), "algo.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'algo.lrr'" in err and "Traceback" not in err


def test_rollout_dtype_differing_from_model_needs_fast_mode():
    with pytest.raises(RecipeError, match="rollout.dtype=bfloat16 differs from model.dtype=float32"):
        load_recipe(ROOT / "recipes" / "tiny_moe.yaml", ["rollout.dtype=bfloat16"])
    r = load_recipe(ROOT / "recipes" / "tiny_moe.yaml", ["rollout.dtype=bfloat16", "mode=fast"])
    assert r.rollout.dtype == "bfloat16" and r.model.dtype == "float32"
