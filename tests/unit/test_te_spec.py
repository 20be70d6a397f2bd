"""Transformer Engine for the fast learner, on a CPU host without TE (megatron_rz/learner/te_spec.py):
the recipe key runtime.te, which layer spec a learner builds, the refusal of runtime.te=on where TE
cannot run, and the local <-> TE parameter-name map of each GPTModel family.

The name map is checked against the full parameter list of tiny local-spec models built here, and
against the names Megatron's TE layer spec registers, derived independently below from the sources
(megatron-core 0.16.1, Transformer Engine 2.20.2) since TE cannot be imported on this host."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rz.learner import te_spec
from megatron_rz.recipe import RecipeError, load_recipe
from refusal import assert_refused

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ the recipe key


def test_runtime_te_default_values_and_yaml_booleans(tmp_path):
    assert load_recipe(None).runtime.te == "auto"
    for v in ("auto", "on", "off"):
        assert load_recipe(None, [f"runtime.te={v}"]).runtime.te == v
    p = tmp_path / "r.yaml"
    p.write_text("runtime:\n  te: off\n")  # YAML 1.1 reads a bare off as false
    assert load_recipe(p).runtime.te == "off"
    p.write_text("runtime:\n  te: on\n")
    assert load_recipe(p).runtime.te == "on"


@pytest.mark.parametrize("value", ["maybe", "1", "te", "[on]"])
def test_runtime_te_bad_value_is_one_clear_line(value):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, [f"runtime.te={value}"])
    msg = str(e.value)
    assert "\n" not in msg and "runtime.te=" in msg and "'auto', 'on' or 'off'" in msg


def test_runtime_te_on_for_a_family_with_its_own_learner_is_refused():
    with pytest.raises(RecipeError) as e:
        load_recipe(ROOT / "recipes" / "tiny_dsv4.yaml", ["mode=fast", "runtime.te=on"])
    assert "runtime.te=on" in str(e.value) and "own learner" in str(e.value)
    # aligned mode builds its own layers whatever runtime.te says
    assert load_recipe(ROOT / "recipes" / "tiny_dsv4.yaml", ["mode=aligned", "runtime.te=on"]).runtime.te == "on"


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RZ_DEBUG", raising=False)
    return tmp_path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
@pytest.mark.parametrize("cmd", [["train"], ["check"], ["bench", "step"]])
def test_runtime_te_on_without_te_is_refused_before_anything_starts(workdir, capsys, cmd):
    tiny = str(ROOT / "recipes" / "tiny_moe.yaml")
    mode = "mode=aligned" if cmd[0] == "bench" else "mode=fast"  # bench step runs a fast leg in any mode
    assert_refused(workdir, capsys, [*cmd, tiny, mode, "runtime.te=on", "logging.run_dir=run"],
                   ["runtime.te=on", "Transformer Engine cannot run here", "no CUDA device", "runtime.te=auto"])


# ------------------------------------------------------------------ which spec


def _ok():
    return None


def _missing():
    return "transformer_engine.pytorch does not import: ModuleNotFoundError"


def test_resolve_spec():
    r = te_spec.resolve_spec
    for te in ("auto", "on", "off"):
        assert r("aligned", te, "qwen3_moe", _missing) == "aligned"  # aligned mode: always its own layers
        assert r("fast", te, "deepseek_v4", _missing) == "aligned"  # own learner (the aligned one)
    assert r("fast", "off", "qwen3_moe", _ok) == "local"
    assert r("fast", "auto", "qwen3_moe", _ok) == "te"
    assert r("fast", "auto", "deepseek_v3", _missing) == "local"
    assert r("fast", "on", "qwen2", _ok) == "te"
    with pytest.raises(ValueError) as e:
        r("fast", "on", "qwen2", _missing)
    assert "runtime.te=on" in str(e.value) and "ModuleNotFoundError" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError):
        r("fast", "yes", "qwen2", _ok)


def test_te_unavailable_here_says_why():
    if torch.cuda.is_available():
        pytest.skip("CPU host check")
    assert "no CUDA device" in te_spec.te_unavailable()
    assert te_spec.resolve_spec("fast", "auto", "qwen3_moe") == "local"


def test_checkpoint_refusal():
    ok = te_spec.checkpoint_refusal
    for saved, now in (("aligned", "local"), ("local", "aligned"), (None, "local"), (None, "aligned"), ("te", "te")):
        assert ok(saved, now) is None, (saved, now)
    for saved, now in (("te", "local"), ("te", "aligned"), ("local", "te"), (None, "te")):
        why = ok(saved, now)
        assert why and "runtime.te" in why and "\n" not in why


# ------------------------------------------------------------------ names


def _te_expected_names(m) -> set[str]:
    """The parameter names of megatron-core 0.16.1's Transformer Engine GPT model for model config
    ``m`` (TP = EP = 1), written from the sources, not from te_spec:

    - layer structure: megatron/core/models/gpt/gpt_layer_specs.py,
      get_gpt_layer_with_transformer_engine_spec: GQA layers have no input_layernorm (IdentityOp, the
      TransformerLayerSubmodules default) and self_attention.linear_qkv = TELayerNormColumnParallelLinear;
      q/k norms TENorm when qk_layernorm; linear_proj TERowParallelLinear. MLA layers: input_layernorm
      TENorm, linear_q_proj TEColumnParallelLinear (no q_lora_rank) or linear_q_down_proj TELinear +
      linear_q_up_proj TELayerNormColumnParallelLinear (qk_layernorm), linear_kv_down_proj TELinear,
      linear_kv_up_proj TELayerNormColumnParallelLinear, q_layernorm / kv_layernorm IdentityOp.
      pre_mlp_layernorm TENorm for MoE layers, IdentityOp for dense ones, whose
      get_mlp_module_spec_for_backend MLP has linear_fc1 = TELayerNormColumnParallelLinear
      (TESpecProvider.fuse_layernorm_and_linear) and linear_fc2 TERowParallelLinear.
    - MoE: models/gpt/moe_module_specs.py: experts from TESpecProvider.grouped_mlp_modules
      (extensions/transformer_engine_spec_provider.py), TEGroupedMLP with linear_fc1 / linear_fc2
      TE{Column,Row}ParallelGroupedLinear under moe_grouped_gemm; shared_experts SharedExpertMLP with
      TEColumnParallelLinear / TERowParallelLinear; router TopKRouter (weight; expert_bias is a buffer).
    - registered parameters (transformer_engine/pytorch/module/): LayerNormLinear registers
      layer_norm_weight (layer_norm_bias only for LayerNorm, not RMSNorm), weight, bias only with
      bias=True (layernorm_linear.py); Linear registers weight (+ bias) (linear.py); GroupedLinear
      registers weight0..weight{n-1} (grouped_linear.py, single_grouped_weight off, megatron's default);
      TENorm builds te.pytorch.RMSNorm, whose op registers weight (ops/basic/rmsnorm.py).
    - the model: embedding.word_embeddings.weight, decoder.final_layernorm (TENorm) weight,
      output_layer.weight unless tied (megatron/core/models/gpt/gpt_model.py)."""
    from kernels.families import family

    f = family(m.arch)
    names = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if not m.tie_word_embeddings:
        names.add("output_layer.weight")
    for i in range(m.num_layers):
        p = f"decoder.layers.{i}."
        dense = not m.num_experts or i < m.first_k_dense
        if f.gqa:
            names |= {p + "self_attention.linear_qkv.layer_norm_weight", p + "self_attention.linear_qkv.weight",
                      p + "self_attention.linear_proj.weight"}
            if f.qkv_bias:
                names.add(p + "self_attention.linear_qkv.bias")
            if f.qk_norm:
                names |= {p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"}
        else:
            names |= {p + "input_layernorm.weight", p + "self_attention.linear_kv_down_proj.weight",
                      p + "self_attention.linear_kv_up_proj.layer_norm_weight",
                      p + "self_attention.linear_kv_up_proj.weight", p + "self_attention.linear_proj.weight"}
            if m.q_lora_rank:
                names |= {p + "self_attention.linear_q_down_proj.weight",
                          p + "self_attention.linear_q_up_proj.layer_norm_weight",
                          p + "self_attention.linear_q_up_proj.weight"}
            else:
                names.add(p + "self_attention.linear_q_proj.weight")
        if dense:
            names |= {p + "mlp.linear_fc1.layer_norm_weight", p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"}
        else:
            names |= {p + "pre_mlp_layernorm.weight", p + "mlp.router.weight"}
            for e in range(m.num_experts):
                names |= {p + f"mlp.experts.linear_fc1.weight{e}", p + f"mlp.experts.linear_fc2.weight{e}"}
            if m.num_shared_experts:
                names |= {p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight"}
    return names


FAMILY_RECIPES = {  # id -> (recipe, overrides): Qwen2 dense, Qwen3-MoE (qk-norm), DeepSeek-V3 MLA + MoE + shared
    "qwen2": ("tiny_qwen2.yaml", []),
    "qwen3_moe": ("tiny_moe.yaml", []),
    "deepseek_v3": ("tiny_dsv3.yaml", []),  # q_lora_rank null: q_proj, no q norm
    "deepseek_v3_q_lora": ("tiny_dsv3.yaml", ["model.q_lora_rank=64"]),
}


@pytest.fixture(scope="module")
def local_models():
    """{id: (recipe, local-spec GPTModel)} of the tiny recipes, built on the CPU (fast mode, te off)."""
    from megatron_rz.learner.model import build_gpt_model, init_parallel

    out = {}
    for key, (path, over) in FAMILY_RECIPES.items():
        r = load_recipe(ROOT / "recipes" / path, over)
        init_parallel(r.parallel, seed=0)
        model = build_gpt_model(r.model, r.parallel, mode="fast")
        assert model.rz_learner_spec == "local"
        out[key] = (r, model)
    return out


@pytest.mark.parametrize("key", list(FAMILY_RECIPES))
def test_local_te_local_is_the_identity_and_names_are_megatrons_te_names(local_models, key):
    r, model = local_models[key]
    m = r.model
    local = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n.endswith("expert_bias")]
    te = [te_spec.local_to_te(n, m) for n in local]
    assert [te_spec.te_to_local(n, m) for n in te] == local  # local -> TE -> local: the identity
    assert len(set(te)) == len(te)  # one-to-one
    params = {te_spec.local_to_te(n, m) for n, _ in model.named_parameters()}
    assert params == _te_expected_names(m)
    # the expected TE names map back onto the local model's names (TE -> local -> TE: the identity)
    assert {te_spec.local_to_te(te_spec.te_to_local(n, m), m) for n in params} == params
    assert {te_spec.te_to_local(n, m) for n in params} == {n for n, _ in model.named_parameters()}
    # a prefix before decoder.layers (DDP's module.) is kept
    assert te_spec.te_to_local("module." + te[-1], m) == "module." + local[-1]


def test_names_of_a_family_without_a_layer_spec_are_refused():
    m = load_recipe(ROOT / "recipes" / "tiny_dsv4.yaml").model
    with pytest.raises(ValueError):
        te_spec.local_to_te("decoder.layers.0.input_layernorm.weight", m)


class _Named(torch.nn.Module):
    """A module tree whose named_parameters() / named_buffers() are the given dotted names."""

    def __init__(self, params: dict, buffers: dict):
        super().__init__()
        for table, register in ((params, "register_parameter"), (buffers, "register_buffer")):
            for name, t in table.items():
                mod = self
                *path, leaf = name.split(".")
                for part in path:
                    if not hasattr(mod, part):
                        mod.add_module(part, torch.nn.Module())
                    mod = getattr(mod, part)
                getattr(mod, register)(leaf, torch.nn.Parameter(t.clone()) if register == "register_parameter"
                                       else t.clone())


@pytest.mark.parametrize("key", list(FAMILY_RECIPES))
def test_hf_conversion_and_export_of_te_names(local_models, key):
    """hf_convert on a model named as the TE spec names it: the same Hugging Face tensors in and out
    as the local model's, each landing in the TE-named parameter of the same tensor."""
    from megatron_rz.learner import hf_convert

    r, model = local_models[key]
    m = r.model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    hf = dict(hf_convert.export_hf_weights(model, m))
    te_model = _Named({te_spec.local_to_te(n, m): torch.zeros_like(p) for n, p in model.named_parameters()},
                      {n: torch.zeros_like(b) for n, b in model.named_buffers() if n.endswith("expert_bias")})
    te_model.rz_learner_spec = "te"
    hf_convert.load_hf_into_megatron(te_model, hf, m)
    te_params = dict(te_model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(te_params[te_spec.local_to_te(n, m)], p), n
    back = dict(hf_convert.export_hf_weights(te_model, m))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    pieces = {name: part for name, part, _, _ in hf_convert.local_hf_pieces(te_model, m)}
    assert pieces.keys() == hf.keys() and all(torch.equal(pieces[k], hf[k]) for k in hf)


def test_optimizer_is_torch_adam_whatever_is_installed():
    """megatron_patches 2d: megatron-core's optimizer module names are the no-TE ones."""
    from megatron.core import optimizer as mc_optim
    from megatron.core.optimizer import distrib_optimizer as mc_distopt

    from megatron_rz.learner import megatron_patches

    megatron_patches.apply()
    assert mc_optim.USING_PYTORCH_OPTIMIZER and mc_optim.Adam is torch.optim.AdamW
    assert mc_distopt.HAVE_APEX_OR_TE is False and mc_distopt.Adam is torch.optim.Adam
