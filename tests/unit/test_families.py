"""The model-family registry (kernels/families.py): the one place that knows families by name.

* Every entry's names resolve to real objects (aligned vLLM class, reference numerics, learner
  module, tiny-model makers), so an entry cannot point at code that is not there.
* The recipe's ``model.arch`` choices are the registry's names.
* A Hugging Face config finds its family from its model_type or class name.
* Outside the registry, code does not branch on ``arch`` strings (a count over the packages).
* Each family's recipe rules (data in its entry) are what the recipe enforces.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from kernels.families import FAMILIES, NAMES, family, hf_family, load
from megatron_rz.recipe import ModelConfig, load_recipe

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "megatron_rz", "vllm_bridge")
ARCH_BRANCH = re.compile(r"arch\s*(==|!=|\bin\b|\bnot in\b)")
MAX_BRANCHES = 10  # outside the registry


def test_recipe_arch_choices_are_the_registry():
    assert get_args(ModelConfig.model_fields["arch"].annotation) == NAMES
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.name)
def test_every_name_of_an_entry_resolves(f):
    import vllm_bridge.aligned  # noqa: F401  (registers the aligned classes with vLLM)

    assert getattr(load(f.aligned_module), f.aligned_class).__name__ == f.aligned_class
    assert load(f.reference).__name__ == f.reference
    if f.learner is not None:
        mod = load(f.learner)
        for fn in ("build_model",):
            assert callable(getattr(mod, fn)), f"{f.learner}.{fn}"
    for name in (f.tiny_model, f.tiny_save) + ((f.tiny_config,) if f.tiny_config else ()):
        assert callable(load(name)), name


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.name)
def test_a_hf_config_finds_its_family(f):
    assert hf_family(f.hf_model_types[0], [f.hf_class]) is f
    assert hf_family("no_such_type", [f.aligned_class]) is f
    assert hf_family("no_such_type", ["NoSuchForCausalLM"]) is None


def test_unknown_arch_is_one_line_naming_the_choices():
    with pytest.raises(ValueError, match=r"model.arch='llama': unknown model family; use one of qwen3_moe"):
        family("llama")


def test_nothing_outside_the_registry_branches_on_arch():
    hits = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "kernels" / "families.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if ARCH_BRANCH.search(code):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert len(hits) <= MAX_BRANCHES, "arch branches outside kernels/families.py:\n" + "\n".join(hits)


def _model(arch: str, **over):
    """A valid tiny ModelConfig of ``arch`` (its recipes/tiny_* recipe), with ``over`` applied."""
    recipe = {"qwen3_moe": "tiny_moe", "qwen2": "tiny_qwen2", "deepseek_v3": "tiny_dsv3", "deepseek_v4": "tiny_dsv4",
              "deepseek_v41": "tiny_dsv41", "kimi_k3": "tiny_kimi_k3"}[arch]
    m = load_recipe(ROOT / "recipes" / f"{recipe}.yaml").model.model_dump()
    m.update(over)
    return m


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.name)
def test_each_family_rule_is_enforced(f):
    ModelConfig(**_model(f.name))  # the family's tiny recipe passes its own rules
    bad = []
    if not f.moe:
        bad.append(({"num_experts": 4, "top_k": 2}, "is dense"))
    heads = _model(f.name)["num_attention_heads"]
    if f.head_dim_from_hidden:
        bad.append(({"head_dim": 2 * _model(f.name)["head_dim"]}, "has head_dim = hidden_size / num_attention_heads"))
    if f.cpu_head_dims:
        bad.append(({"head_dim": 48, "hidden_size": 48 * heads}, "vLLM's CPU attention supports head_dim"))
    for key, value in f.vllm_cpu_sizes:
        bad.append(({key: value * 2}, rf"needs .*model\.{key}={value}"))
    if f.compress_ratios:
        bad.append(({"compress_ratios": [3] * _model(f.name)["num_layers"]}, "needs model.compress_ratios"))
    if f.hash_routing:
        bad.append(({"num_hash_layers": 99}, "model.num_hash_layers=99 must be in"))
    if f.fp8_refusal:
        bad.append(({"fp8": "blockwise"}, re.escape(f.fp8_refusal[:40])))
    if set(("softmax", "sigmoid", "sqrtsoftplus")) - set(f.router_scores):
        bad.append(({"router_score": "sqrtsoftplus"}, re.escape(f.router_refusal[:40])))
    if f.fp8_o_lora_block:
        bad.append(({"fp8": "blockwise", "o_lora_rank": 100}, "needs model.o_lora_rank a multiple of 128"))
    if not (f.moe and f.cpu_head_dims and f.compress_ratios):
        assert bad, f"{f.name}: no rule of its entry is tested"
    for over, msg in bad:
        with pytest.raises(ValueError, match=msg):
            ModelConfig(**_model(f.name, **over))
