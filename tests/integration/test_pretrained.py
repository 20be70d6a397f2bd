"""Starting from a pretrained Hugging Face checkpoint (model.pretrained) instead of the warm start.

* check_pretrained: a missing directory, a checkpoint of another architecture, and sizes that
  differ from the recipe's model section are refused with what differs and how to fix it;
* `rz train recipes/tiny_moe.yaml model.pretrained=DIR` trains from DIR (no warm start, no copy in
  the run directory), aligned mode bitwise every update, and hf_final carries DIR's config and
  tokenizer next to the trained weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rz.recipe import RecipeError, load_recipe

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_moe.yaml"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    from megatron_rz.tiny_models import make_random_checkpoint

    out = tmp_path_factory.mktemp("pretrained") / "qwen3_moe_tiny"
    make_random_checkpoint(load_recipe(str(RECIPE)), out, seed=7)
    return out


def test_mismatched_or_missing_checkpoints_are_refused(pretrained, tmp_path):
    from megatron_rz.pretrained import check_pretrained

    assert check_pretrained(load_recipe(str(RECIPE), [f"model.pretrained={pretrained}"])) == pretrained.resolve()
    with pytest.raises(RecipeError, match="no such directory"):
        check_pretrained(load_recipe(str(RECIPE), [f"model.pretrained={tmp_path / 'nope'}"]))
    with pytest.raises(RecipeError, match=r"(?s)hidden_size: checkpoint 128, recipe gives 64.*num_hidden_layers: checkpoint 2, "
                                          r"recipe gives 3"):
        check_pretrained(load_recipe(str(RECIPE), [f"model.pretrained={pretrained}", "model.hidden_size=64",
                                                   "model.num_layers=3"]))
    with pytest.raises(RecipeError, match="is a Qwen3MoeForCausalLM checkpoint but model.arch=deepseek_v3"):
        check_pretrained(load_recipe(str(ROOT / "recipes/tiny_dsv3.yaml"), [f"model.pretrained={pretrained}"]))
    # rz train says so before any engine starts
    proc = subprocess.run([sys.executable, "-m", "megatron_rz.cli", "train", str(RECIPE),
                           f"model.pretrained={pretrained}", "model.num_experts=4"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "num_experts: checkpoint 8, recipe gives 4" in proc.stderr, proc.stderr[-2000:]


def test_rz_train_from_pretrained(pretrained, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_rz.cli", "train", str(RECIPE), f"model.pretrained={pretrained}",
                           "schedule.steps=2", "schedule.eval_every=0", "task.eval_prompts=16",
                           "rollout.prompts_per_step=4", "logging.wandb=false", "logging.plots=false",
                           "logging.progress=false", f"logging.run_dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "warm start done" not in proc.stdout and not (run_dir / "base_model").exists()
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "max_abs_dlogp" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["frac_bitwise"] == 1.0 for r in rows), rows
    final = run_dir / "hf_final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    assert json.loads((final / "config.json").read_text()) == json.loads((pretrained / "config.json").read_text())
