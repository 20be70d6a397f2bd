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
from pathlib import Path

import torch

from megatron_rz.recipe import ModelConfig, Recipe
from megatron_rz.tasks import Task, make_task

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
    """The Hugging Face config for the recipe's architecture (a class both vLLM and the learner know)."""
    common = dict(
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
        num_experts_per_tok=m.top_k,
        moe_intermediate_size=m.moe_ffn_hidden_size,
        norm_topk_prob=m.norm_topk_prob,
        dtype=m.dtype,
    )
    if m.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            head_dim=m.head_dim,
            num_experts=m.num_experts,
            intermediate_size=m.dense_ffn_hidden_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        **common,
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


def _hf_model_class(arch: str):
    from transformers import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM

    return {"qwen3_moe": Qwen3MoeForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}[arch]


def make_random_checkpoint(recipe: Recipe, out_dir: Path, seed: int = 0):
    """Tokenizer + randomly initialised HF model saved to out_dir. Returns (model, tokenizer)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = make_task(recipe.task)
    tok = train_tokenizer(task, recipe.warm_start.tokenizer_vocab, out_dir, seed)
    cfg = hf_config(recipe.model, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    model = _hf_model_class(recipe.model.arch)(cfg).to(torch.float32)
    if recipe.model.arch == "deepseek_v3":
        # transformers initialises the noaux_tc bias to zeros; keep it, it is learned by load balancing.
        pass
    model.save_pretrained(out_dir, safe_serialization=True)
    return model, tok


def _sft_batch(tok, problems, answers=None):
    """Right-padded prompt+answer+eos sequences with a loss mask on the answer and eos."""
    seqs, masks = [], []
    for i, p in enumerate(problems):
        prompt = tok.encode(p.prompt, add_special_tokens=False)
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
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, ws.steps))))
    model.train()
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
        ids, mask = _sft_batch(tok, problems, answers)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    torch.set_num_threads(threads)
    model.eval()
    model.to(getattr(torch, recipe.model.dtype)).save_pretrained(out_dir, safe_serialization=True)
    info = {"sft_steps": ws.steps, "sft_final_loss": sum(losses[-10:]) / max(1, len(losses[-10:]))}
    (Path(out_dir) / "warm_start.json").write_text(json.dumps(info, indent=2))
    return info
