"""Starting from a pretrained Hugging Face checkpoint (recipe key ``model.pretrained``).

The tiny recipes make their base model (tokenizer + random init + SFT warm start); a real run starts
from a released checkpoint instead: a directory with config.json, *.safetensors and the tokenizer,
on a filesystem every node sees. Both engines load it natively (the learner through
megatron_rz.learner.hf_convert, reading only its own shard's tensors; vLLM by itself), so the recipe's
``model`` section must describe the same network: ``check_pretrained`` compares the architecture
class and every structural size with the checkpoint's config.json before anything starts, and says
which keys differ.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rz.recipe import Recipe, RecipeError

ARCH_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                "deepseek_v4": "DeepseekV4ForCausalLM", "deepseek_v41": "DeepseekV41ForCausalLM",
                "kimi_k3": "KimiLinearForCausalLM"}
# config attributes that fix the network's shapes or numerics (compared where both configs have
# them; read through transformers, which maps each release's key names, e.g. num_experts /
# num_local_experts, onto the same attribute)
STRUCTURAL = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
              "intermediate_size", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
              "routed_scaling_factor", "norm_topk_prob", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "tie_word_embeddings", "rms_norm_eps", "scoring_func",
              "use_sliding_window")


_MISSING = object()


def _get(cfg, key):
    try:
        return getattr(cfg, key)
    except AttributeError:
        return _MISSING


def _rope_theta(cfg):
    rp = _get(cfg, "rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        return rp["rope_theta"]
    v = _get(cfg, "rope_theta")
    return None if v is _MISSING else v


def check_pretrained(recipe: Recipe) -> Path:
    """The checkpoint directory of ``model.pretrained``, checked against the recipe; RecipeError else."""
    from megatron_rz.learner.tiny_models import hf_config

    raw = recipe.model.pretrained
    path = Path(raw).expanduser().resolve()
    fix = "set model.pretrained to a Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer)"
    if not path.is_dir():
        raise RecipeError(f"model.pretrained={raw!r}: no such directory ({path}); {fix}")
    if not (path / "config.json").is_file():
        raise RecipeError(f"model.pretrained={raw!r}: {path} has no config.json; {fix}")
    if not list(path.glob("*.safetensors")):
        raise RecipeError(f"model.pretrained={raw!r}: {path} has no *.safetensors weights; {fix}")
    have = json.loads((path / "config.json").read_text())
    want_cls = ARCH_CLASSES[recipe.model.arch]
    got_cls = (have.get("architectures") or ["?"])[0]
    if got_cls != want_cls:
        raise RecipeError(
            f"model.pretrained={raw!r} is a {got_cls} checkpoint but model.arch={recipe.model.arch} loads "
            f"{want_cls}; supported: {', '.join(f'{a} ({c})' for a, c in ARCH_CLASSES.items())}")
    from transformers import AutoConfig

    have_cfg = AutoConfig.from_pretrained(str(path))
    want_cfg = hf_config(recipe.model, 0, 0)
    diffs = []
    for key in STRUCTURAL:
        a, b = _get(have_cfg, key), _get(want_cfg, key)
        if a is not _MISSING and b is not _MISSING and a is not None and b is not None and a != b:
            diffs.append(f"{key}: checkpoint {a!r}, recipe gives {b!r}")
    ra, rb = _rope_theta(have_cfg), _rope_theta(want_cfg)
    if ra is not None and rb is not None and float(ra) != float(rb):
        diffs.append(f"rope_theta: checkpoint {ra!r}, recipe gives {rb!r}")
    if diffs:
        raise RecipeError(
            f"model.pretrained={raw!r} does not match the recipe's model section ({len(diffs)} key(s)):\n  - "
            + "\n  - ".join(diffs) + "\nmake the model section describe the checkpoint (see its config.json)")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise RecipeError(f"model.pretrained={raw!r}: {path} has no tokenizer files; {fix}")
    return path


def weights_hash(model_dir: str | Path) -> str:
    """sha256 (16 hex digits) of a checkpoint's tensors: names, dtypes, shapes and raw bytes, in name
    order, over every ``*.safetensors`` file of ``model_dir`` (file metadata and sharding excluded).
    Two base models with the same hash are the same weights bit for bit."""
    import hashlib

    import torch
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def main(argv: list[str]) -> int:
    """``python -m megatron_rz.learner.pretrained DIR...`` prints each checkpoint's weights hash;
    ``--recipe RECIPE [overrides...]``: those of the base model(s) in the recipe's run dir."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m megatron_rz.learner.pretrained",
                                 description="print the weights hash (sha256) of Hugging Face checkpoints")
    ap.add_argument("dirs", nargs="*", help="checkpoint directories")
    ap.add_argument("--recipe", nargs=argparse.REMAINDER, metavar="RECIPE [key=value ...]",
                    help="hash the base model(s) in this recipe's run directory instead")
    args = ap.parse_args(argv)
    if args.recipe:
        from megatron_rz.recipe import load_recipe

        run_dir = load_recipe(args.recipe[0], args.recipe[1:]).run_dir
        dirs = sorted(p for p in run_dir.glob("base_model*") if p.is_dir() and not p.name.startswith("."))
        if not dirs:
            print(f"no base model in {run_dir}")
            return 1
    else:
        dirs = [Path(d) for d in args.dirs]
        if not dirs:
            ap.error("name one or more checkpoint directories, or --recipe RECIPE")
        missing = [str(d) for d in dirs if not d.is_dir()]
        if missing:
            ap.error(f"not a directory: {', '.join(missing)}")
    for d in dirs:
        print(f"base model weights sha256 {weights_hash(d)}  {d}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
