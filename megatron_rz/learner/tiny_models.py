"""Tiny models made locally: a tokenizer trained on the task, a Hugging Face config from the recipe,
random weights, and a short supervised warm start so RL has signal to improve.

The result is a plain Hugging Face checkpoint (config.json + model.safetensors + tokenizer files)
that vLLM loads like any model and the learner converts into Megatron layout. It stands in for the
pretrained base model a real run would start from (there is no model hub here).
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import torch

from kernels.families import family, load
from megatron_rz.fingerprint import base_model_hash
from megatron_rz.recipe import ModelConfig, Recipe, RecipeError
from megatron_rz.rl.tasks import Task, make_task, prompt_text

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(task: Task, vocab_size: int, out_dir: Path, seed: int = 0):
    """Byte-pair tokenizer trained on task text; digits are always split one per token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Punctuation("isolated")]
    )
    tok.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False)
    tok.train_from_iterator(task.corpus(random.Random(seed), 5000), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, more than vocab {vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None)
    fast.save_pretrained(out_dir)
    return fast


def hf_config(m: ModelConfig, eos_id: int, pad_id: int):
    """The Hugging Face config for the recipe's architecture (a class both vLLM and the learner know):
    the family's ``tiny_config`` maker (kernels.families)."""
    name = family(m.arch).tiny_config
    if not name:
        raise ValueError(f"model.arch={m.arch} has no transformers config class: its tiny model is made by "
                         f"{family(m.arch).tiny_model}")
    return load(name)(m, eos_id, pad_id)


def _base_config(m: ModelConfig, eos_id: int, pad_id: int) -> dict:
    return dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        dtype=m.dtype,
    )


def _moe_config(m: ModelConfig, eos_id: int, pad_id: int) -> dict:
    return dict(_base_config(m, eos_id, pad_id), num_experts_per_tok=m.top_k,
                moe_intermediate_size=m.moe_ffn_hidden_size, norm_topk_prob=m.norm_topk_prob)


def qwen2_config(m: ModelConfig, eos_id: int, pad_id: int):
    from transformers import Qwen2Config

    # dense; q/k/v biases are implied by the class; head_dim = hidden / heads
    return Qwen2Config(**_base_config(m, eos_id, pad_id), intermediate_size=m.dense_ffn_hidden_size,
                       use_sliding_window=False)


def qwen3_moe_config(m: ModelConfig, eos_id: int, pad_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
            **_moe_config(m, eos_id, pad_id),
            head_dim=m.head_dim,
            num_experts=m.num_experts,
            intermediate_size=m.dense_ffn_hidden_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )


def deepseek_v3_config(m: ModelConfig, eos_id: int, pad_id: int):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        **_moe_config(m, eos_id, pad_id),
        intermediate_size=m.dense_ffn_hidden_size,
        n_routed_experts=m.num_experts,
        n_shared_experts=m.num_shared_experts,
        routed_scaling_factor=m.routed_scaling_factor,
        n_group=m.router_num_groups,
        topk_group=m.router_group_topk,
        first_k_dense_replace=m.first_k_dense,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=True,
    )
    # vLLM reads these two; without them it silently falls back to softmax routing with no bias.
    cfg.topk_method = "noaux_tc"
    cfg.scoring_func = m.router_score
    return cfg


def deepseek_v4_config(m: ModelConfig, eos_id: int, pad_id: int):
    """transformers' DeepseekV4Config, plus the original DeepSeek config names vLLM reads.

    transformers folds `compress_ratios`, `num_hash_layers` and `qk_rope_head_dim` into its own
    `layer_types` / `mlp_layer_types` / `partial_rotary_factor` (and accepts them back as legacy
    keys); vLLM 0.32's DeepseekV4ForCausalLM reads only the original names, and needs
    `topk_method="noaux_tc"` for its score-routed layers. save_hf_checkpoint writes config.json
    with the original names only (see there).
    """
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        q_lora_rank=m.q_lora_rank,
        qk_rope_head_dim=m.qk_rope_head_dim,
        o_groups=m.o_groups,
        o_lora_rank=m.o_lora_rank,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        compress_rope_theta=m.compress_rope_theta,
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        n_routed_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        n_shared_experts=m.num_shared_experts,
        moe_intermediate_size=m.moe_ffn_hidden_size,
        scoring_func=m.router_score,
        norm_topk_prob=m.norm_topk_prob,
        routed_scaling_factor=m.routed_scaling_factor,
        swiglu_limit=m.swiglu_limit,
        compress_ratios=list(m.compress_ratios),
        num_hash_layers=m.num_hash_layers,
        hc_mult=m.hc_mult,
        sliding_window=m.sliding_window,
        index_n_heads=m.index_n_heads,
        index_head_dim=m.index_head_dim,
        index_topk=m.index_topk,
        num_nextn_predict_layers=0,  # no multi-token-prediction head in a tiny model
        dtype=m.dtype,
    )
    cfg.compress_ratios = list(m.compress_ratios)
    cfg.num_hash_layers = m.num_hash_layers
    cfg.topk_method = "noaux_tc"
    return cfg


def random_hash_table(vocab_size: int, top_k: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """A hash-routing table tid2eid [vocab, top_k]: each token id goes to top_k distinct experts."""
    scores = torch.rand(vocab_size, num_experts, generator=generator)
    return scores.argsort(dim=1)[:, :top_k].contiguous()


# DeepSeek-V4 checkpoints are written with the ORIGINAL DeepSeek tensor names (embed.weight,
# head.weight, norm.weight, hc_head_fn, layers.N.attn.wq_a.weight, layers.N.hc_attn_fn,
# layers.N.ffn.gate.tid2eid / .bias, layers.N.ffn.experts.E.w1.weight, ...), i.e. the layout of the
# released DeepSeek-V4 checkpoints. That is the one layout both readers accept: vLLM 0.32's
# DeepseekV4ForCausalLM maps exactly these names (hf_to_vllm_mapper, stacked w1/w3, wq_a/wkv), and
# transformers 5.19 renames them on load (conversion_mapping "deepseek_v4"). transformers' own
# save_pretrained writes a hybrid (model.embed_tokens.weight, model.hc_head.hc_fn, model.layers.*)
# that vLLM cannot load, so the state dict is converted here: transformers' reverse conversion
# (revert_weight_conversion: experts split per expert, attn/ffn/hc renames) and then the renames it
# gets wrong or leaves out: the "model." prefix, embed_tokens, hc_head.hc_*, and the attention's
# kv_norm (transformers maps both `attn.kv_norm` and `compressor.norm` onto `kv_norm`, so its
# reverse turns both into `norm`; only the compressor's is `norm` in DeepSeek's layout).
_DSV4_TOP_RENAMES = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_DSV4_ATTN_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")


def deepseek_v4_original_state_dict(model) -> dict[str, torch.Tensor]:
    """A transformers DeepseekV4ForCausalLM's weights under the original DeepSeek names."""
    from transformers.core_model_loading import revert_weight_conversion

    out = {}
    for name, t in revert_weight_conversion(model, model.state_dict()).items():
        name = name.removeprefix("model.")
        name = _DSV4_ATTN_NORM.sub(r"\1.kv_norm.weight", _DSV4_TOP_RENAMES.get(name, name))
        out[name] = t.detach().contiguous()
    return out


def save_hf_checkpoint(model, out_dir: Path, arch: str) -> None:
    """Write config.json + model.safetensors for vLLM and from_pretrained: the family's ``tiny_save``
    (kernels.families; see the note above for deepseek_v4's names; the transformers families use
    save_pretrained's names)."""
    load(family(arch).tiny_save)(model, out_dir)


def save_pretrained(model, out_dir: Path) -> None:
    model.save_pretrained(out_dir, safe_serialization=True)


def save_config_dict_checkpoint(model, out_dir: Path) -> None:
    """config.json from ``model.hf_config`` + model.safetensors of its state dict (DeepSeek-V4.1)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    (out_dir / "config.json").write_text(json.dumps(model.hf_config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})


def save_deepseek_v4_checkpoint(model, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()
    # config.json as DeepSeek ships it: vLLM's own DeepseekV4Config validates `layer_types` /
    # `mlp_layer_types` against the generic PreTrainedConfig values and refuses transformers'
    # ("hash_moe", "compressed_sparse_attention"), so only the original keys (compress_ratios,
    # num_hash_layers) go to disk; transformers rebuilds its lists from them on load.
    cfg = model.config.to_dict()
    for key in ("layer_types", "mlp_layer_types"):
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(deepseek_v4_original_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def make_random_checkpoint(recipe: Recipe, out_dir: Path, seed: int = 0):
    """Tokenizer + randomly initialised HF model saved to out_dir. Returns (model, tokenizer)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = make_task(recipe.task)
    tok = train_tokenizer(task, recipe.warm_start.tokenizer_vocab, out_dir, seed)
    model = load(family(recipe.model.arch).tiny_model)(recipe, tok, seed)
    save_hf_checkpoint(model, out_dir, recipe.model.arch)
    return model, tok


def random_transformers_model(recipe: Recipe, tok, seed: int = 0):
    """The family's transformers class (kernels.families ``hf_class``) from ``hf_config``, random init."""
    import transformers

    f = family(recipe.model.arch)
    cfg = hf_config(recipe.model, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, f.hf_class)(cfg).to(torch.float32)
    # transformers initialises the noaux_tc bias to zeros (DeepSeek-V3 and V4); keep it, it is
    # learned by load balancing.
    if f.hash_routing:
        # transformers initialises the hash-routing tables to zeros ("real values come from the
        # checkpoint"): every token would go to expert 0 six times. Draw a fixed random table.
        gen = torch.Generator().manual_seed(seed)
        m = recipe.model
        for name, buf in model.named_buffers():
            if name.endswith(".gate.tid2eid"):
                buf.copy_(random_hash_table(m.vocab_size, m.top_k, m.num_experts, gen))
    return model


def random_deepseek_v41_model(recipe: Recipe, tok, seed: int = 0):
    return TinyDeepseekV41(deepseek_v41_config_dict(tok, **deepseek_v41_overrides(recipe.model)), tok, seed)


def random_kimi_k3_model(recipe: Recipe, tok, seed: int = 0):
    return TinyKimiK3(kimi_k3_config_dict(recipe.model, tok), seed)


def _sft_batch(tok, problems, answers=None, task=None):
    """Right-padded prompt+answer+eos sequences with a loss mask on the answer and eos (prompts as
    the rollout tokenizes them: ``task``'s rendering, e.g. a chat template, where it has one)."""
    seqs, masks = [], []
    for i, p in enumerate(problems):
        prompt = tok.encode(p.prompt if task is None else prompt_text(task, tok, p), add_special_tokens=False)
        answer = tok.encode(answers[i] if answers else p.answer, add_special_tokens=False) + [tok.eos_token_id]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def warm_start(recipe: Recipe, out_dir: Path, seed: int = 0, progress: bool = True) -> dict:
    """Make the tiny checkpoint and train it briefly on the task (next-token loss on answers)."""
    from tqdm import tqdm

    model, tok = make_random_checkpoint(recipe, out_dir, seed)
    task = make_task(recipe.task)
    ws = recipe.warm_start
    rng = random.Random(seed + 1)
    device = torch.device(ws.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RecipeError("warm_start.device=cuda but no CUDA device is visible: set warm_start.device=cpu")
    model.to(device).train()
    # (fused: one kernel per step for the whole model on the GPU; the CPU keeps torch's default)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0, fused=device.type == "cuda" or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, ws.steps))))
    # bf16 autocast on the GPU (fp32 master weights and optimizer state)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses = []
    # A tiny model's ops are too small to share between threads; with 2+ intra-op threads any
    # other busy process on a 2-core box makes OpenMP spin-waits thrash (measured 50x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bar = tqdm(range(ws.steps), desc="warm start (SFT)", disable=not progress, leave=False)
    distractor = getattr(task, "distractor", None) if ws.distractor_rate > 0 else None
    for _ in bar:
        problems = task.sample(rng, ws.batch_size)
        answers = [p.answer for p in problems]
        if distractor is not None:
            for i, p in enumerate(problems):
                wrong = distractor(p)
                if wrong is not None and rng.random() < ws.distractor_rate:
                    answers[i] = wrong
        ids, mask = (t.to(device) for t in _sft_batch(tok, problems, answers, task))
        with autocast:
            logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())
        if len(losses) % 20 == 0 or len(losses) == ws.steps:  # one host sync per 20 steps
            bar.set_postfix(loss=f"{losses[-1].item():.3f}")
    losses = [float(v) for v in losses[-10:]]
    torch.set_num_threads(threads)
    model.to("cpu").eval()
    save_hf_checkpoint(model.to(getattr(torch, recipe.model.dtype)), out_dir, recipe.model.arch)
    info = {"sft_steps": ws.steps, "sft_final_loss": sum(losses[-10:]) / max(1, len(losses[-10:]))}
    info["base_hash"] = base_model_hash(recipe, seed)  # what made it: reused only by recipes of this hash
    (Path(out_dir) / "warm_start.json").write_text(json.dumps(info, indent=2))
    return info


# --------------------------------------------------------------------------------------------------
# DeepSeek-V4.1 (no transformers class: config.json keys as DeepSeek ships them, weights drawn from
# kernels.models.dsv41.parameter_shapes under the original names)
# --------------------------------------------------------------------------------------------------

TINY_DSV41 = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=4, compress_ratios=[0, 0, 0, 0], num_hash_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
    o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    sliding_window=16, index_n_heads=16, index_head_dim=16, index_topk=3, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, routed_scaling_factor=1.5,
    swiglu_limit=10.0, tie_word_embeddings=False, num_nextn_predict_layers=0,
    # V4.1: engram on layers 1 and 3 (2- and 3-grams, 2 heads each), no compressed layers
    engram_layer_ids=[1, 3], engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=16,
    engram_vocab_size=64, kv_source_layer_ids=[], index_source_layer_ids=[],
)


def deepseek_v41_config_dict(tokenizer, **overrides) -> dict:
    """config.json of a tiny DeepSeek-V4.1 (``TINY_DSV41`` + overrides). The engram's compressed vocab
    size and pad id come from ``tokenizer``; the table sizes are the rows the hash buckets need."""
    from kernels.models import dsv41

    cfg = dict(TINY_DSV41, **overrides)
    _, cvocab = dsv41.compressed_token_map(tokenizer)
    cfg.update(engram_compressed_vocab_size=cvocab, pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
               engram_pad_token_id=tokenizer.pad_token_id, architectures=["DeepseekV41ForCausalLM"],
               # compressed layers (ratios 1 / 2): transformers' DeepseekV4Config refuses them and drops
               # compress_ratios; V4.1 ships as deepseek_v41 (vLLM's DeepseekV41Config)
               model_type="deepseek_v41" if any(cfg.get("compress_ratios") or ()) else "deepseek_v4")
    primes = dsv41.engram_primes(len(cfg["engram_layer_ids"]), cfg["engram_max_ngram_size"], cfg["engram_n_heads"],
                                 cfg["engram_vocab_size"])
    cfg["engram_num_embeddings"] = [sum(sum(p) for p in per) for per in primes]
    return cfg


def random_dsv41_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random original-named fp32 weights for a V4.1 config (hash tables: distinct experts per token)."""
    from kernels.models import dsv41

    c = dsv41.v41_config(cfg)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (shape, kind) in dsv41.parameter_shapes(c).items():
        if kind == "int64":
            sd[name] = random_hash_table(c.vocab_size, c.top_k, c.num_experts, g)
        elif name.endswith(("norm.weight", "q_weight", "k_weight")):
            sd[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[name] = torch.randn(shape, generator=g) * (0.3 if len(shape) < 2 else 0.15)
    return sd


def make_tiny_dsv41_checkpoint(out_dir: Path, seed: int = 0, task_cfg=None, **overrides) -> dict:
    """Tokenizer (trained on the task) + config.json + random model.safetensors; returns the config."""
    from safetensors.torch import save_file

    from megatron_rz.recipe import TaskConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = overrides.get("vocab_size", TINY_DSV41["vocab_size"])
    tok = train_tokenizer(make_task(task_cfg or TaskConfig()), vocab, out_dir, seed)
    cfg = deepseek_v41_config_dict(tok, **overrides)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(random_dsv41_state_dict(cfg, seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return cfg


def deepseek_v41_overrides(m: ModelConfig) -> dict:
    """The recipe's model section as V4.1 config.json keys (engram on layer 1 and the last layer)."""
    return dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, q_lora_rank=m.q_lora_rank, o_groups=m.o_groups, o_lora_rank=m.o_lora_rank,
        n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, n_shared_experts=m.num_shared_experts,
        moe_intermediate_size=m.moe_ffn_hidden_size, scoring_func=m.router_score,
        routed_scaling_factor=m.routed_scaling_factor, swiglu_limit=m.swiglu_limit,
        compress_ratios=list(m.compress_ratios), num_hash_layers=m.num_hash_layers, hc_mult=m.hc_mult,
        sliding_window=m.sliding_window, index_n_heads=m.index_n_heads, index_head_dim=m.index_head_dim,
        index_topk=m.index_topk, max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta, compress_rope_theta=m.compress_rope_theta, tie_word_embeddings=m.tie_word_embeddings,
        engram_layer_ids=sorted({1, m.num_layers - 1}) if m.num_layers > 1 else [],
        # V4.1 compressed layers: the first layer of each run of one ratio owns the compressor and
        # the indexer; the rest of the run shares them
        kv_source_layer_ids=v41_sources(m.compress_ratios), index_source_layer_ids=v41_sources(m.compress_ratios),
    )


def v41_sources(ratios) -> list[int]:
    """The compressed layers that start a run of equal ``ratios`` (the tiny models' sources)."""
    r = [int(x) for x in ratios]
    return [i for i, x in enumerate(r) if x and (i == 0 or r[i - 1] != x)]


class TinyDeepseekV41(torch.nn.Module):
    """A trainable V4.1 over :mod:`kernels.models.dsv41` (original names), for the warm start:
    ``model(input_ids=ids).logits``; ``hf_config`` is its config.json."""

    def __init__(self, cfg: dict, tokenizer, seed: int = 0) -> None:
        from types import SimpleNamespace

        from kernels.models import dsv41

        super().__init__()
        self.hf_config = cfg
        self.c = dsv41.v41_config(cfg)
        self.token_map = dsv41.token_map_of(tokenizer, self.c)
        sd = random_dsv41_state_dict(cfg, seed)
        dsv41.build_parameter_tree(self, self.c, lambda name, shape, kind: sd[name].clone() if kind == "int64"
                                   else torch.nn.Parameter(sd[name].clone()))
        self._ns = SimpleNamespace

    def forward(self, input_ids: torch.Tensor):
        from kernels.models import dsv4, dsv41

        logits = dsv41.forward_logits(self.c, lambda n: dsv4.lookup(self, n), input_ids.long().cpu(), self.token_map)
        return self._ns(logits=logits)


# --------------------------------------------------------------------------------------------------
# Kimi-Linear / Kimi-K3 (no trainable transformers K3: config.json in the Kimi checkpoint schema vLLM
# reads, model_type kimi_linear; weights under the Kimi names, kernels.models.kimi_k3.parameter_shapes)
# --------------------------------------------------------------------------------------------------

# The K3 options of the tiny model (every one the aligned classes implement): SiTU, latent MoE with
# its norm, block attention residuals, q-LoRA MLA with the sigmoid output gate, KDA with the full-rank
# output gate and the lower-bounded ("safe") forget gate. MLA on every second layer (1-indexed even).
TINY_KIMI_K3 = dict(
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=8.0, routed_expert_hidden_size=24,
    latent_moe_use_norm=True, attn_res_block_size=2, mla_use_output_gate=True, mla_use_nope=True,
    short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True, moe_layer_freq=1,
)


def kimi_k3_config_dict(m: ModelConfig, tokenizer, **overrides) -> dict:
    """config.json of a tiny Kimi-K3 from the recipe's model section (+ ``TINY_KIMI_K3``): KDA with
    ``num_attention_heads`` heads of ``head_dim``; MLA with the deepseek_v3 keys (q_lora_rank,
    kv_lora_rank, qk_nope/rope_head_dim, v_head_dim); MoE from layer ``first_k_dense`` on."""
    k3 = dict(TINY_KIMI_K3, **overrides)
    n = m.num_layers
    full = [i for i in range(1, n + 1) if i % 2 == 0]
    lac = {"kda_layers": [i for i in range(1, n + 1) if i not in full], "full_attn_layers": full,
           "num_heads": m.num_attention_heads, "head_dim": m.head_dim,
           "short_conv_kernel_size": k3.pop("short_conv_kernel_size"), "gate_lower_bound": k3.pop("gate_lower_bound"),
           "use_full_rank_gate": k3.pop("use_full_rank_gate")}
    cfg = dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], torch_dtype=m.dtype,
        hidden_size=m.hidden_size, num_hidden_layers=n, vocab_size=m.vocab_size, rms_norm_eps=m.rms_norm_eps,
        max_position_embeddings=m.max_position_embeddings, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_attention_heads,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        intermediate_size=m.dense_ffn_hidden_size, moe_intermediate_size=m.moe_ffn_hidden_size,
        num_experts=m.num_experts, num_experts_per_token=m.top_k, num_shared_experts=m.num_shared_experts,
        moe_router_activation_func=m.router_score, use_grouped_topk=m.router_num_groups > 1,
        num_expert_group=m.router_num_groups, topk_group=m.router_group_topk, moe_renormalize=m.norm_topk_prob,
        routed_scaling_factor=m.routed_scaling_factor, first_k_dense_replace=m.first_k_dense,
        tie_word_embeddings=m.tie_word_embeddings, linear_attn_config=lac, **k3,
    )
    return cfg


def random_kimi_k3_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the Kimi names (``kernels.models.kimi_k3.parameter_shapes``): linears
    ``N(0, 1 / fan_in)``, norms ``1 + 0.1 N``, KDA conv ``0.5 N``, ``A_log = log U(1, 16)``, the
    noaux_tc bias zeros (as transformers initialises it)."""
    from kernels.models import kimi_k3 as kk

    c = kk.kimi_config(cfg)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (shape, kind) in kk.parameter_shapes(c, cfg["linear_attn_config"]["use_full_rank_gate"]).items():
        if kind == "fp32_buffer":
            sd[name] = torch.zeros(shape)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            sd[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("conv1d.weight"):
            sd[name] = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("A_log"):
            sd[name] = torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
        elif name.endswith("dt_bias") or name == "model.embed_tokens.weight":
            sd[name] = torch.randn(shape, generator=g)
        else:
            sd[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return sd


class TinyKimiK3(torch.nn.Module):
    """A trainable Kimi-K3 over :mod:`kernels.models.kimi_k3` (Kimi names), for the warm start:
    ``model(input_ids=ids).logits``; ``hf_config`` is its config.json."""

    def __init__(self, cfg: dict, seed: int = 0) -> None:
        from kernels.models import dsv4
        from kernels.models import kimi_k3 as kk

        super().__init__()
        self.hf_config = cfg
        self.c = kk.kimi_config(cfg)
        sd = random_kimi_k3_state_dict(cfg, seed)
        shapes = kk.parameter_shapes(self.c, cfg["linear_attn_config"]["use_full_rank_gate"])
        dsv4.add_parameter_tree(self, shapes, lambda name, shape, kind: sd[name].clone() if kind == "fp32_buffer"
                                else torch.nn.Parameter(sd[name].clone()))

    def forward(self, input_ids: torch.Tensor):
        from types import SimpleNamespace

        from kernels.models import kimi_k3 as kk

        w = dict(self.named_parameters())
        w.update(self.named_buffers())
        return SimpleNamespace(logits=kk.forward(w, self.c, input_ids.long().cpu())[0])


def save_kimi_k3_checkpoint(model: TinyKimiK3, out_dir: Path) -> None:
    """config.json (with the weights' dtype) + model.safetensors under the Kimi names."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    cfg = dict(model.hf_config, torch_dtype=str(sd["model.embed_tokens.weight"].dtype).removeprefix("torch."))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
