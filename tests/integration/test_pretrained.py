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
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    out = tmp_path_factory.mktemp("pretrained") / "qwen3_moe_tiny"
    make_random_checkpoint(load_recipe(str(RECIPE)), out, seed=7)
    return out


def test_mismatched_or_missing_checkpoints_are_refused(pretrained, tmp_path):
    from megatron_rz.learner.pretrained import check_pretrained

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


# ------------------------------------------------------------------ dense Qwen2 in the release format

QWEN2 = ROOT / "recipes" / "tiny_qwen2.yaml"
# DeepSeek-R1-Distill-Qwen-1.5B's config.json, key for key, with the sizes shrunk to tiny_qwen2's
# (the release writes rope_theta at the top level, torch_dtype, use_mrope, sliding-window keys).
_RELEASE_KEYS = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 128, "initializer_range": 0.02, "intermediate_size": 256, "max_position_embeddings": 131072,
    "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 10000, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.44.0", "use_cache": True,
    "use_mrope": False, "use_sliding_window": False, "vocab_size": 64,
}


@pytest.fixture(scope="module")
def qwen2_release(tmp_path_factory) -> Path:
    """A Qwen2ForCausalLM written by transformers (random weights, q/k/v biases made non-zero),
    a locally trained tokenizer, and config.json in the release's key layout."""
    import torch
    import transformers

    from megatron_rz.rl.tasks import make_task
    from megatron_rz.learner.tiny_models import train_tokenizer

    out = tmp_path_factory.mktemp("pretrained") / "qwen2_release_format"
    recipe = load_recipe(str(QWEN2))
    tok = train_tokenizer(make_task(recipe.task), recipe.warm_start.tokenizer_vocab, out, 0)
    keys = dict(_RELEASE_KEYS, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(11)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config.from_dict(keys)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    (out / "config.json").write_text(json.dumps(keys, indent=2) + "\n")
    return out


def test_qwen2_release_format_loads_and_learner_matches_transformers(qwen2_release):
    """model.pretrained accepts it for model.arch=qwen2 (and refuses it for another arch / size); the
    aligned learner loads it (biases included): its logprobs are torch.equal to our reference and
    within 1e-5 of transformers' (measured max |d| 4.8e-7, fp32)."""
    import torch
    import transformers

    from kernels.models.qwen3_dsv3 import reference_logprobs
    from megatron_rz.learner.learner import Learner
    from megatron_rz.learner.pretrained import check_pretrained

    recipe = load_recipe(str(QWEN2), [f"model.pretrained={qwen2_release}"])
    assert check_pretrained(recipe) == qwen2_release.resolve()
    with pytest.raises(RecipeError, match="is a Qwen2ForCausalLM checkpoint but model.arch=qwen3_moe"):
        check_pretrained(load_recipe(str(RECIPE), [f"model.pretrained={qwen2_release}"]))
    with pytest.raises(RecipeError, match="intermediate_size: checkpoint 256, recipe gives 128"):
        check_pretrained(load_recipe(str(QWEN2), [f"model.pretrained={qwen2_release}",
                                                  "model.dense_ffn_hidden_size=128"]))
    learner = Learner(recipe.model, recipe.parallel, recipe.algo, str(qwen2_release), seed=0, mode="aligned")
    ids = torch.randint(2, 64, (3, 15), generator=torch.Generator().manual_seed(5))
    lp = learner.logprobs(ids)
    assert torch.equal(lp, reference_logprobs(str(qwen2_release), None, ids))
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(qwen2_release), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(input_ids=ids).logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    diff = (lp[:, 1:] - want).abs().max().item()
    print(f"\n[qwen2 release format] aligned learner vs transformers: max |dlogp| {diff:.2e}")
    assert diff < 1e-5
    exported = dict(learner.export_hf_weights())
    assert any(k.endswith("self_attn.q_proj.bias") for k in exported)
    from safetensors.torch import load_file

    saved = load_file(str(qwen2_release / "model.safetensors"))
    assert set(exported) == set(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)


def test_rz_train_tiny_qwen2_from_release_format(qwen2_release, tmp_path):
    """rz train recipes/tiny_qwen2.yaml from the release-format checkpoint: vLLM (aligned Qwen2
    class) and the learner load it, 2 updates, every sampled token's logprob bitwise equal."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_rz.cli", "train", str(QWEN2),
                           f"model.pretrained={qwen2_release}", "schedule.steps=2", "schedule.eval_every=0",
                           "task.eval_prompts=16", "rollout.prompts_per_step=4", "logging.wandb=false",
                           "logging.plots=false", "logging.progress=false", f"logging.run_dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "max_abs_dlogp" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["frac_bitwise"] == 1.0 for r in rows), rows
    assert all(r["max_abs_dlogp"] == 0.0 for r in rows), rows
    assert (run_dir / "hf_final" / "model.safetensors").is_file()
