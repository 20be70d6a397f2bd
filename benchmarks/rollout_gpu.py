"""The aligned engine in CUDA vLLM against stock vLLM, on one GPU: checkpoints, parity, speed.

    python benchmarks/rollout_gpu.py ckpt  --config moe1b --out /root/ckpt/moe1b
    python benchmarks/rollout_gpu.py check --ckpt /root/ckpt/moe1b --out $OUT/check_moe1b.json
    python benchmarks/rollout_gpu.py bench --ckpt /root/ckpt/moe1b --out $OUT/bench_moe1b.json \
        --cells 256x64x128,32x64x128,1x64x128 --rounds 3
    python benchmarks/rollout_gpu.py profile --ckpt /root/ckpt/moe1b --out $OUT/profile.json --cells 1x64x64
    python benchmarks/rollout_gpu.py compare --parts $OUT/b.stock.json $OUT/b.aligned.json --out $OUT/b.json

``ckpt`` writes a Hugging Face checkpoint with random bf16 weights (no tokenizer: the engines run
with ``skip_tokenizer_init``) of one of ``CONFIGS``; the DeepSeek-V4 ones (``dsv4_*``) in DeepSeek's
own layout, their linears block-FP8 with scales as stock vLLM's V4 needs (``--form bf16``: the
dequantised weights instead; the aligned engine reads either, docs/gpu.md "Stock DeepSeek-V4").
``check`` runs the project's RolloutEngine (aligned: our model class, CUDA graphs for decode; stock:
vLLM's own class, CUDA graphs + compile) and measures, with ``torch.equal``: batch invariance (8
prompts of 256 tokens alone vs inside a batch of 64), decode == prefill (the generated tokens
re-scored by a prefill), learner parity (``reference_logprobs`` on the GPU, the kernels the Megatron
learner calls), and the same after an in-place weight update. ``bench`` times ``LLM.generate`` of
stock and aligned engines that live side by side in this process, alternating rounds, same
checkpoint, same prompts, ``ignore_eos``, and reports tok/s and aligned/stock per cell (batch x
prompt len x new tokens). Needs CUDA vLLM (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> config.json fields (Hugging Face names)
CONFIGS = {
    # ~1.0B Qwen3-MoE: 12 layers, 32 experts top-4 (the "~1B" cell)
    "moe1b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=128, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=768,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=32000),
    # Qwen3-30B-A3B shapes (hidden 2048, 32/4 heads, 128 experts top-8, vocab 151936), 4 layers
    "qwen3_30b_a3b_4l": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                             intermediate_size=6144, num_hidden_layers=4, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                             moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                             mlp_only_layers=[], vocab_size=151936),
    # DeepSeek-V3-shaped MLA + MoE (kv_lora 512, rope 64, nope 128, v 128; 1 dense + 3 MoE layers)
    "dsv3_4l": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=2048,
                    intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                    q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1024, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                    norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
                    vocab_size=32000),
    # DeepSeek-R1-Distill-Qwen-1.5B's real shapes: dense Qwen2, 28 layers, hidden 1536, 12 / 2 heads of
    # 128, MLP 8960, vocab 151936, q/k/v biases, untied (1.78B)
    "qwen2_1p5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536,
                       intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       vocab_size=151936, rope_theta=10000.0, use_sliding_window=False),
    # DeepSeek-V4-Flash's per-layer shapes (DeepSeek-V4-Flash-Base config; recipes/deepseek_v4_flash.yaml):
    # hidden 4096, 64 query heads over one shared 512-wide KV head (rope 64, q_lora 1024), grouped
    # output 8 x 1024, lightning indexer 64 x 128 keeping 512 entries, window 128, hyper-connections x4,
    # 256 routed experts of 2048 top-6 (sqrt-softplus, noaux_tc bias) + 1 shared, SwiGLU clamp 10,
    # vocab 129280; few layers, mixing compressed sparse x4 and heavily compressed x128 layers (the real
    # model: 20 x4 and 23 x128, the first 3 hash-routed). Each layer's 256 experts are 6.4B parameters:
    # dsv4_2l is 14.2B (15.3 GB on disk in the FP8 form; the aligned engine holds 28.5 GB of bf16),
    # dsv4_4l 27.4B (28.5 GB FP8; 54.8 GB bf16 in the aligned engine: on an 80 GB H100 give --mem-gb <= 8).
    "dsv4_2l": dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", compress_ratios=[4, 128],
                    num_hidden_layers=2, num_hash_layers=1),
    "dsv4_4l": dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", compress_ratios=[128, 4, 128, 4],
                    num_hidden_layers=4, num_hash_layers=1),
}
# what both DeepSeek-V4 configs share (DeepSeek's config.json names, the ones vLLM's V4 class reads)
DSV4_FLASH = dict(hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
                  q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, num_experts_per_tok=6,
                  n_shared_experts=1, moe_intermediate_size=2048, routed_scaling_factor=1.5, norm_topk_prob=True,
                  scoring_func="sqrtsoftplus", topk_method="noaux_tc", swiglu_limit=10.0, hidden_act="silu",
                  hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, index_n_heads=64, index_head_dim=128, index_topk=512,
                  sliding_window=128, rope_theta=10000.0, compress_rope_theta=160000.0, num_nextn_predict_layers=0,
                  vocab_size=129280)
for _c in CONFIGS.values():
    if _c["model_type"] == "deepseek_v4":
        for _k, _v in DSV4_FLASH.items():
            _c.setdefault(_k, _v)
COMMON = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False,
              torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, attention_bias=False)


def param_shapes(c: dict) -> dict:
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    s = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        a = p + "self_attn."
        if c["model_type"] == "qwen2":
            nh, nk = c["num_attention_heads"], c["num_key_value_heads"]
            D = H // nh
            s.update({a + "q_proj.weight": (nh * D, H), a + "q_proj.bias": (nh * D,),
                      a + "k_proj.weight": (nk * D, H), a + "k_proj.bias": (nk * D,),
                      a + "v_proj.weight": (nk * D, H), a + "v_proj.bias": (nk * D,), a + "o_proj.weight": (H, nh * D)})
            moe, shared = False, 0
        elif c["model_type"] == "qwen3_moe":
            D, nh, nk = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
            s.update({a + "q_proj.weight": (nh * D, H), a + "k_proj.weight": (nk * D, H),
                      a + "v_proj.weight": (nk * D, H), a + "o_proj.weight": (H, nh * D),
                      a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
            moe, E, I = True, c["num_experts"], c["moe_intermediate_size"]
            shared = 0
        else:
            nh, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            s.update({a + "q_a_proj.weight": (c["q_lora_rank"], H), a + "q_a_layernorm.weight": (c["q_lora_rank"],),
                      a + "q_b_proj.weight": (nh * qk, c["q_lora_rank"]),
                      a + "kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], H),
                      a + "kv_a_layernorm.weight": (c["kv_lora_rank"],),
                      a + "kv_b_proj.weight": (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                      a + "o_proj.weight": (H, nh * c["v_head_dim"])})
            moe, E, I = i >= c["first_k_dense_replace"], c["n_routed_experts"], c["moe_intermediate_size"]
            shared = c["n_shared_experts"]
        m = p + "mlp."
        if moe:
            s[m + "gate.weight"] = (E, H)
            if c["model_type"] == "deepseek_v3":
                s[m + "gate.e_score_correction_bias"] = (E,)
            for e in range(E):
                s.update({f"{m}experts.{e}.gate_proj.weight": (I, H), f"{m}experts.{e}.up_proj.weight": (I, H),
                          f"{m}experts.{e}.down_proj.weight": (H, I)})
            if shared:
                Is = I * shared
                s.update({m + "shared_experts.gate_proj.weight": (Is, H), m + "shared_experts.up_proj.weight": (Is, H),
                          m + "shared_experts.down_proj.weight": (H, Is)})
        else:
            Id = c["intermediate_size"]
            s.update({m + "gate_proj.weight": (Id, H), m + "up_proj.weight": (Id, H), m + "down_proj.weight": (H, Id)})
    return s


def make_ckpt(name: str, out: str, seed: int = 0, *, form: str = "fp8", overrides: dict | None = None,
              device: str | None = None) -> dict:
    """Random bf16 weights (std 0.02; norms 1; router bias 0) + config.json; returns the config.
    DeepSeek-V4 configs: :func:`make_v4_ckpt` (``form``; ``overrides``: config fields, e.g. shrunk dims)."""
    from safetensors.torch import save_file

    c = {**COMMON, **CONFIGS[name], **(overrides or {})}
    if c["model_type"] == "deepseek_v4":
        return make_v4_ckpt(c, out, seed, form=form, device=device)
    if c["model_type"] == "qwen2":
        c.pop("attention_bias")
    os.makedirs(out, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(seed)
    sd = {}
    for n, shape in param_shapes(c).items():
        if n.endswith("norm.weight") or "layernorm" in n:
            t = torch.ones(shape, device="cuda", dtype=torch.bfloat16)
        elif n.endswith("e_score_correction_bias"):
            t = torch.zeros(shape, device="cuda", dtype=torch.float32)
        else:
            t = (torch.randn(shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        sd[n] = t.cpu()
    names = sorted(sd)
    shard, files, size = {}, [], 0
    for n in names:  # ~2 GB shards
        shard[n] = sd[n]
        size += sd[n].numel() * sd[n].element_size()
        if size > 2e9 or n == names[-1]:
            f = f"model-{len(files):05d}.safetensors"
            save_file(shard, os.path.join(out, f))
            files.append((f, list(shard)))
            shard, size = {}, 0
    index = {"metadata": {}, "weight_map": {n: f for f, ns in files for n in ns}}
    json.dump(index, open(os.path.join(out, "model.safetensors.index.json"), "w"))
    json.dump(c, open(os.path.join(out, "config.json"), "w"), indent=1)
    json.dump({"bos_token_id": 0, "eos_token_id": 1}, open(os.path.join(out, "generation_config.json"), "w"))
    nparam = sum(t.numel() for t in sd.values())
    print(f"ckpt {name}: {nparam / 1e9:.3f}B params -> {out}", flush=True)
    return c


# The block-FP8 layout of DeepSeek's V4 checkpoints (config.json "quantization_config"; vLLM 0.26 reads
# it as its deepseek_v4_fp8 method, models/deepseek_v4/quant_config.py). expert_dtype "fp8" (as in
# DeepSeek-V4-Flash-Base): routed experts in block FP8 with float32 scales, not DeepSeek-V4-Flash's
# MXFP4 experts.
DSV4_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]}
FP8_BLOCK = 128


def quantize_pow2_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[N, K]`` -> ``(e4m3 [N, K], fp32 scales [ceil(N/128), ceil(K/128)])`` with each block's scale
    the smallest power of two >= amax / 448 (UE8M0-representable), so ``e4m3 * scale`` is exact in
    bf16: stock (FP8 GEMMs) and the aligned engine (dequantised bf16 weights) hold the same values."""
    N, K = w.shape
    B = FP8_BLOCK
    nb, kb = -(-N // B), -(-K // B)
    w32 = torch.nn.functional.pad(w.to(torch.float32), (0, kb * B - K, 0, nb * B - N))
    amax = w32.abs().view(nb, B, kb, B).amax(dim=(1, 3)).clamp(min=2.0 ** -100)
    m, e = torch.frexp(amax / 448.0)  # amax / 448 = m * 2**e, m in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e))
    q = (w32.view(nb, B, kb, B) / scale[:, None, :, None]).clamp(-448.0, 448.0)
    return q.view(nb * B, kb * B)[:N, :K].to(torch.float8_e4m3fn), scale


def v4_tensor_specs(c: dict) -> dict:
    """name -> (shape, dtype, fp8?) of a DeepSeek-V4 checkpoint of config ``c`` in DeepSeek's layout: the
    aligned reference's own names and shapes (kernels.models.dsv4.parameter_shapes); model-dtype
    linears of kernels.models.dsv4.FP8_LINEARS are the block-FP8 ones (weight + ".scale"), which are
    also the ones stock vLLM's V4 builds with its FP8 method (the compressors, the indexer's
    weights_proj, the router gate, embedding and head stay bf16)."""
    from kernels.models import dsv4 as R

    cv = R.v4_config(c)
    kinds = {"model": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}
    out = {}
    for name, (shape, kind) in R.parameter_shapes(cv).items():
        rel = name.split(".", 2)[2] if name.startswith("layers.") else name
        out[name] = (tuple(shape), kinds[kind], kind == "model" and bool(R.FP8_LINEARS.match(rel)))
    return out


def _v4_value(name: str, shape: tuple, dtype: torch.dtype, c: dict, g: torch.Generator, dev: str) -> torch.Tensor:
    """One random tensor: matrices N(0, 0.02); norm weights and hyper-connection scales 1; sinks, router
    biases and hyper-connection biases 0; the hash-routing table a random choice of top_k distinct
    experts per token id."""
    if dtype == torch.int64:  # layers.N.ffn.gate.tid2eid [vocab, top_k]
        r = torch.rand(shape[0], c["n_routed_experts"], generator=g, device=dev)
        return r.argsort(dim=1)[:, : shape[1]].contiguous()
    if name.endswith("norm.weight") or name.endswith("_scale"):
        return torch.ones(shape, dtype=dtype, device=dev)
    if name.endswith("attn_sink") or name.endswith("gate.bias") or name.endswith("_base"):
        return torch.zeros(shape, dtype=dtype, device=dev)
    return (torch.randn(shape, generator=g, device=dev) * 0.02).to(dtype)


def make_v4_ckpt(c: dict, out: str, seed: int = 0, *, form: str = "fp8", device: str | None = None,
                 shard_bytes: float = 2e9) -> dict:
    """A random DeepSeek-V4 checkpoint of config ``c`` (DeepSeek's config.json names) in DeepSeek's
    tensor layout, streamed to ~2 GB shards + index: ``form="fp8"`` writes the FP8 linears as e4m3
    ``X.weight`` + fp32 ``X.scale`` (power-of-two scales, :func:`quantize_pow2_blockwise`) and declares
    ``quantization_config`` / ``expert_dtype`` as DeepSeek's FP8 release does (what stock vLLM 0.26's V4
    needs); ``form="bf16"`` writes those weights dequantised (the same values, bitwise) and no
    quantisation. The same seed draws the same values in both forms."""
    from safetensors.torch import save_file

    if form not in ("fp8", "bf16"):
        raise ValueError(f"form={form!r}: expected 'fp8' or 'bf16'")
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    c = dict(c)
    if form == "fp8":
        c.update(quantization_config=dict(DSV4_QUANTIZATION), expert_dtype="fp8")
    else:
        c.pop("quantization_config", None)
    os.makedirs(out, exist_ok=True)
    g = torch.Generator(device=dev).manual_seed(seed)
    shard, weight_map, size, nfile, nparam, nbytes = {}, {}, 0, 0, 0, 0

    def flush():
        nonlocal shard, size, nfile
        if shard:
            f = f"model-{nfile:05d}.safetensors"
            save_file(shard, os.path.join(out, f), metadata={"format": "pt"})
            weight_map.update({n: f for n in shard})
            shard, size, nfile = {}, 0, nfile + 1

    def add(n, t):
        nonlocal size, nbytes
        shard[n] = t.cpu()
        size += t.numel() * t.element_size()
        nbytes += t.numel() * t.element_size()
        if size > shard_bytes:
            flush()

    for name, (shape, dtype, fp8) in v4_tensor_specs(c).items():
        t = _v4_value(name, shape, dtype, c, g, dev)
        nparam += t.numel()
        if fp8:
            q, s = quantize_pow2_blockwise(t)
            if form == "fp8":
                add(name, q)
                add(name[: -len(".weight")] + ".scale", s)
            else:
                from kernels.models.dsv4 import dequantize_block_fp8

                add(name, dequantize_block_fp8(q, s, torch.bfloat16))
        else:
            add(name, t)
    flush()
    json.dump({"metadata": {"total_size": nbytes}, "weight_map": weight_map},
              open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=1)
    json.dump(c, open(os.path.join(out, "config.json"), "w"), indent=1)
    json.dump({"bos_token_id": c.get("bos_token_id", 0), "eos_token_id": c.get("eos_token_id", 1)},
              open(os.path.join(out, "generation_config.json"), "w"))
    print(f"ckpt deepseek_v4 ({form}): {nparam / 1e9:.3f}B params, {nbytes / 1e9:.2f} GB in {nfile} files -> {out}",
          flush=True)
    return c


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def _engine(ckpt: str, aligned: bool, *, mem_gb: float, max_len: int, max_seqs: int = 256, eager: bool = False):
    from vllm_bridge.engine import RolloutEngine

    # RZ_BENCH_FP8=blockwise (engine kind aligned_fp8): the aligned class's own blockwise-FP8 linears
    fp8 = os.environ.get("RZ_BENCH_FP8") if aligned else None
    return RolloutEngine(ckpt, aligned=aligned, dtype="bfloat16", kv_cache_gb=mem_gb, max_model_len=max_len,
                         max_num_seqs=max_seqs, enforce_eager=eager, skip_tokenizer_init=True,
                         max_num_batched_tokens=8192, gpu_memory_utilization=0.4, fp8=fp8)


def check(ckpt: str, out: str, *, which=("aligned", "stock")) -> dict:
    """Parity figures for each engine (see the module docstring)."""
    from kernels.models import qwen3_dsv3 as ref

    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    V = cfg["vocab_size"]
    res: dict = {"ckpt": ckpt, "config": cfg.get("architectures"), "engines": {}}
    prompts = _prompts(64, 256, V, seed=1)
    sd = None
    for kind in which:
        t0 = time.perf_counter()
        eng = _engine(ckpt, kind == "aligned", mem_gb=8, max_len=1024)
        r: dict = {"startup_s": round(time.perf_counter() - t0, 1)}
        try:
            r["model_runner"] = eng.collective_rpc("rz_model_runner")[0]
            batch = eng.generate(prompts, 1, temperature=1.0, max_new_tokens=64, seed=7)
            alone = [eng.generate([prompts[i]], 1, temperature=1.0, max_new_tokens=64, seed=7 + i)[0] for i in range(8)]
            same_tok = [batch[i].response_ids == alone[i].response_ids for i in range(8)]
            eq = [same_tok[i] and torch.equal(torch.tensor(batch[i].logprobs), torch.tensor(alone[i].logprobs))
                  for i in range(8)]
            r["batch_invariance_equal"] = f"{sum(eq)}/8"
            r["batch_invariance_same_tokens"] = f"{sum(same_tok)}/8"
            r["batch_invariance_max_abs"] = max(
                float((torch.tensor(batch[i].logprobs) - torch.tensor(alone[i].logprobs)).abs().max())
                for i in range(8) if same_tok[i]) if any(same_tok) else None
            # decode == prefill: the generated responses re-scored by one prefill each
            seqs = [s.prompt_ids + s.response_ids for s in batch[:16]]
            scored = eng.score(seqs)
            dec = torch.tensor([s.logprobs for s in batch[:16]])
            pre = torch.tensor([row[256:] for row in scored])
            r["decode_eq_prefill_tokens"] = f"{int((dec == pre).sum())}/{dec.numel()}"
            r["decode_vs_prefill_max_abs"] = float((dec - pre).abs().max())
            # learner parity: the kernels' full-sequence forward on the GPU (what the learner calls)
            if sd is None:
                sd = {k: v.cuda() for k, v in ref.load_state_dict(ckpt).items()}
            ids = torch.tensor(seqs[:8], device="cuda")
            lp = ref.reference_logprobs(sd, cfg, ids, 1.0)[:, 256:].cpu()
            r["learner_eq_engine_tokens"] = f"{int((lp == dec[:8]).sum())}/{lp.numel()}"
            r["learner_vs_engine_max_abs"] = float((lp - dec[:8]).abs().max())
            # in-place weight update (every tensor scaled by 1.01 in bf16), then parity again
            new = {k: (v.float() * 1.01).to(v.dtype) for k, v in sd.items()}
            eng.update_weights(((k, v.cpu()) for k, v in new.items()), version=1)
            b2 = eng.generate(prompts[:8], 1, temperature=1.0, max_new_tokens=32, seed=11)
            lp2 = ref.reference_logprobs(new, cfg, torch.tensor([s.prompt_ids + s.response_ids for s in b2], device="cuda"),
                                         1.0)[:, 256:].cpu()
            d2 = torch.tensor([s.logprobs for s in b2])
            r["after_update_learner_eq_engine_tokens"] = f"{int((lp2 == d2).sum())}/{d2.numel()}"
            r["after_update_max_abs"] = float((lp2 - d2).abs().max())
            del new
        finally:
            eng.close()
            torch.cuda.empty_cache()
        print(kind, json.dumps(r), flush=True)
        res["engines"][kind] = r
    json.dump(res, open(out, "w"), indent=1)
    return res


# engine kinds of ``bench``: (aligned?, extra environment of its process)
ENGINE_KINDS = {
    "stock": (False, {}),  # vLLM's own class, CUDA graphs + torch.compile (its defaults)
    "stock_bi": (False, {"VLLM_BATCH_INVARIANT": "1"}),  # vLLM's own batch-invariant mode
    # stock on vLLM's V1 model runner, the one the aligned engine runs (for a dense model stock's
    # default is the V2 runner): separates the runner's host cost from the kernels' in a dense cell
    "stock_v1": (False, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "aligned": (True, {}),  # the project's aligned class (RolloutEngine(aligned=True))
    # the aligned class with the split-KV decode, the one-kernel MoE work list and the batched draw
    # off (the plans before them; same logprob bits, kernels.settings)
    "aligned_base": (True, {"RZ_DECODE_SPLIT": "0", "RZ_FUSED_WORK_LIST": "0", "RZ_BATCHED_DRAW": "0"}),
    # the aligned class with vLLM's per-request noise draw instead of the batched one
    "aligned_vdraw": (True, {"RZ_BATCHED_DRAW": "0"}),
    # the aligned class with the sampler's fused plans (two-launch log-probs, the draw kernel writing
    # the token's logprob and finiteness flag; same bits), and explicitly without them (the default)
    "aligned_fused": (True, {"RZ_FUSED_SAMPLER": "1"}),
    "aligned_unfused": (True, {"RZ_FUSED_SAMPLER": "0"}),
    # the aligned class with 16-row split-KV decode programs (kernels.settings.set_decode_rows: a
    # launch plan only where the GPU gives the 64-row tile's bits, which the GPU tests check)
    "aligned_r16": (True, {"RZ_DECODE_ROWS": "16"}),
    # the aligned class with the split-KV decode's fused merge (the last program folds the chunk
    # states: one attention launch per decode layer instead of two; kernels.settings.set_decode_fused_merge)
    "aligned_fm": (True, {"RZ_DECODE_FUSED_MERGE": "1"}),
    # the aligned class with narrow grouped-MoE tiles for small batches (more programs streaming the
    # few active experts' weights; kernels.settings.set_moe_narrow_tiles, a launch plan only)
    "aligned_narrow": (True, {"RZ_MOE_NARROW_TILES": "1"}),
    # ... with Qwen3's q/k norms in one launch and their RoPE in one (kernels.settings.set_qk_one_launch)
    "aligned_qk1": (True, {"RZ_QK_ONE_LAUNCH": "1"}),
    # ... with a few rows' routed experts computed without a work list (set_moe_direct_rows)
    "aligned_direct": (True, {"RZ_MOE_DIRECT_ROWS": "1"}),
    # ... with all three small-batch plans
    "aligned_small": (True, {"RZ_MOE_NARROW_TILES": "1", "RZ_MOE_DIRECT_ROWS": "1", "RZ_QK_ONE_LAUNCH": "1"}),
    # the aligned class on vLLM's V2 GPU model runner (stock's default for dense models, and so the
    # aligned engine's for them: vllm_bridge.engine.aligned_model_runner; the sampler patch's V2 half,
    # vllm_bridge.sampler_patch.apply_v2), and on the V1 runner (the aligned default before)
    "aligned_v2": (True, {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    "aligned_v1": (True, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    # the aligned class with its blockwise-FP8 linears (e4m3 weights quantised by the engine at load,
    # 1x128 activation groups): the FP8 GEMMs stock's DeepSeek-V4 runs, on the aligned side
    "aligned_fp8": (True, {"RZ_BENCH_FP8": "blockwise"}),
    # the aligned class with the GEMM's heuristic tile picks only (no measured per-GPU table:
    # kernels/triton/gemm_table.py); "aligned" uses RZ_GEMM_TABLE as the caller sets it (default
    # auto: the committed table of this GPU model, where there is one)
    "aligned_notable": (True, {"RZ_GEMM_TABLE": "off"}),
}


# the RL grid: short and long prompts, long generations, batch 1 to 256
DEFAULT_CELLS = "1x64x128,32x64x128,256x64x128,256x1024x128,64x512x512,128x256x1024,32x2048x1024"


def _median(xs: list) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def variant(batch: int, prompt: int, new: int, seeded: bool) -> str:
    """One timed variant of a cell as ``bench-one --only`` names it: ``BxPxN/on`` (seeded) or ``/off``."""
    return f"{batch}x{prompt}x{new}/{'on' if seeded else 'off'}"


def finished_variants(part: dict) -> list[str]:
    """The variants a ``bench_one`` result timed, in the order it timed them."""
    return [variant(c["batch"], c["prompt"], c["new"], c["seeded"]) for c in part.get("cells", [])]


def bench_one(ckpt: str, out: str, kind: str, cells: list[tuple[int, int, int]], rounds: int, seeded: list[bool],
              mem_gb: float = 20, budget_s: float = 0, only: Optional[list[str]] = None) -> dict:
    """One engine of ``kind``, alone in this process: every cell, seeded and/or unseeded, one untimed
    warm-up round then ``rounds`` timed rounds of ``LLM.generate`` (``ignore_eos``, ``logprobs=0``,
    temperature 1). Seeded = a per-request seed on every request (what rollouts use).

    ``out`` is rewritten after every cell, so a call cut off by its time limit keeps the cells it
    finished. ``budget_s`` > 0: a cell's second variant (seeded / unseeded) whose predicted time (its
    first variant's) would end past ``budget_s`` from the start is not begun, nor is any cell once
    the budget is spent; the skipped cells are listed under ``skipped``. (A first variant is never
    predicted: a per-token rate from another cell misjudges prefill-heavy and large-batch cells by
    10x or more.) ``only``: the variants (:func:`variant`) to time, the others are left out (``bench``
    gives the engines after the first one the variants the first one finished)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.machine_probe import probe

    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    max_len = max(p + n for _, p, n in cells) + 16
    t0 = time.perf_counter()
    eng = _engine(ckpt, ENGINE_KINDS[kind][0], mem_gb=mem_gb, max_len=max_len)
    startup = round(time.perf_counter() - t0, 1)
    # the machine's speed now (benchmarks/machine_probe.py), again after the cells; taken with the
    # engine up and idle (CUDA is not initialised here before vLLM starts its engine process)
    before = probe()
    res: dict = {"engine": kind, "ckpt": ckpt, "gpu": torch.cuda.get_device_name(),
                 "startup_s": startup, "env": ENGINE_KINDS[kind][1],
                 "gemm_table": os.environ.get("RZ_GEMM_TABLE", "auto"), "probes": [before], "cells": []}
    res["skipped"] = []
    print(f"{kind} engine up in {res['startup_s']} s", flush=True)
    try:
        for (B, P, N) in cells:
            if only is not None and not any(variant(B, P, N, sd) in only for sd in seeded):
                continue
            prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(B, P, cfg["vocab_size"], seed=B + P)]
            last = 0.0
            for sd in seeded:
                if only is not None and variant(B, P, N, sd) not in only:
                    continue
                forecast = last
                if budget_s and time.perf_counter() - t0 + forecast > budget_s:
                    res["skipped"].append({"batch": B, "prompt": P, "new": N, "seeded": sd,
                                           "forecast_s": round(forecast, 1)})
                    print(f"budget: skipping {B}x{P}x{N} seeded={sd} (forecast {forecast:.0f} s)", flush=True)
                    continue
                tc = time.perf_counter()
                sps = [SamplingParams(n=1, temperature=1.0, max_tokens=N, ignore_eos=True, logprobs=0,
                                      seed=(1000 + i) if sd else None, detokenize=False) for i in range(B)]
                eng.llm.generate(prompts, sps, use_tqdm=False)  # warm-up (Triton JIT, graph shapes)
                times = []
                for _ in range(rounds):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    outs = eng.llm.generate(prompts, sps, use_tqdm=False)
                    times.append(time.perf_counter() - t)
                    assert sum(len(o.outputs[0].token_ids) for o in outs) == B * N
                cell = {"batch": B, "prompt": P, "new": N, "seeded": sd, "rounds_s": [round(x, 4) for x in times],
                        "median_s": round(_median(times), 4), "min_s": round(min(times), 4),
                        "max_s": round(max(times), 4), "tok_s": round(B * N / _median(times), 1)}
                print(json.dumps(cell), flush=True)
                res["cells"].append(cell)
                last = time.perf_counter() - tc
                json.dump(res, open(out, "w"), indent=1)  # a cut-off call keeps its finished cells
        res["probes"].append(probe())
    finally:
        eng.close()
    json.dump(res, open(out, "w"), indent=1)
    return res


def _pooled(a: dict, b: dict) -> dict:
    """One cell measured in two engine processes (calls, or ``bench --processes``): every round of
    both, median and spread over all of them; each process's own median kept, in run order."""
    rs = list(a["rounds_s"]) + list(b["rounds_s"])
    med = _median(rs)
    per = list(a.get("process_medians_s", [a["median_s"]])) + [b["median_s"]]
    return {**a, "rounds_s": rs, "median_s": round(med, 4), "min_s": round(min(rs), 4), "max_s": round(max(rs), 4),
            "tok_s": round(a["batch"] * a["new"] / med, 1), "process_medians_s": per}


def compare(parts: list[dict]) -> dict:
    """Cells of several ``bench_one`` results side by side: each engine's median and spread,
    aligned / each other engine and each other aligned kind / stock (medians); the worst and best
    cell of each ratio."""
    by: dict = {}
    for p in parts:  # parts of one engine from several calls are pooled: their rounds, one cell
        cells = by.setdefault(p["engine"], {})
        for c in p["cells"]:
            k = (c["batch"], c["prompt"], c["new"], c["seeded"])
            cells[k] = _pooled(cells[k], c) if k in cells else {**c, "process_medians_s": [c["median_s"]]}
    keys = sorted(set().union(*[set(v) for v in by.values()]))
    # aligned / every other engine, and every other aligned kind (aligned_v2, aligned_notable, ...)
    # / stock: what a user compares each engine with
    pairs = [("aligned", e) for e in by if e != "aligned" and "aligned" in by]
    pairs += [(e, "stock") for e in by if e not in ("aligned", "stock") and e.startswith("aligned") and "stock" in by]
    rows = []
    for k in keys:
        row = {"batch": k[0], "prompt": k[1], "new": k[2], "seeded": k[3]}
        for e, cells in by.items():
            if k in cells:
                c = cells[k]
                row[e] = {x: c[x] for x in ("median_s", "min_s", "max_s", "rounds_s", "tok_s", "process_medians_s")}
        for num, den in pairs:
            if num in row and den in row:
                row[f"{num}_over_{den}"] = round(row[num]["median_s"] / row[den]["median_s"], 3)
                # the same ratio per pair of processes (the i-th of each engine; bench --processes
                # alternates the engines' order): how far one process pair alone could mislead
                pn, pd = row[num]["process_medians_s"], row[den]["process_medians_s"]
                if min(len(pn), len(pd)) > 1:
                    row[f"{num}_over_{den}_per_process"] = [round(x / y, 3) for x, y in zip(pn, pd)]
        rows.append(row)
    summary = {}
    for num, den in pairs:
        name = f"{num}_over_{den}"
        r = [x for x in rows if name in x]
        if r:
            worst = max(r, key=lambda x: x[name])
            best = min(r, key=lambda x: x[name])
            cell = lambda x: f"{x['batch']}x{x['prompt']}x{x['new']}{' seeded' if x['seeded'] else ''}"  # noqa: E731
            summary[name] = {"worst": worst[name], "worst_cell": cell(worst), "best": best[name],
                             "best_cell": cell(best), "cells": len(r)}
            per = [v for x in r for v in x.get(f"{name}_per_process", [])]
            if per:  # the spread of the ratio over process pairs, every cell
                summary[name]["per_process_range"] = [min(per), max(per)]
    # the machine's own speed before and after each engine (machine_probe): a ratio is read only
    # where it stayed put
    from benchmarks.machine_probe import spread

    summary["machine"] = spread([q for p in parts for q in p.get("probes", [])])
    engines: dict = {}
    for p in parts:
        e = engines.setdefault(p["engine"], {"startup_s": [], "env": p["env"], "probes": [], "calls": 0})
        e["startup_s"].append(p["startup_s"])
        e["probes"] += p.get("probes", [])
        e["calls"] += 1
    return {"engines": engines,
            "gpu": parts[0].get("gpu"), "ckpt": parts[0].get("ckpt"), "summary": summary, "cells": rows}


def markdown(res: dict) -> str:
    """A :func:`compare` result as the table docs/gpu.md shows: one row per cell (seeded and unseeded
    apart), each engine's median and (min-max) seconds over all its rounds, the rounds' count, and
    aligned / every other engine; then each ratio's worst and best cell."""
    engines = [e for e in ("stock", "stock_bi", "aligned") if e in res["engines"]]
    engines += [e for e in res["engines"] if e not in engines]
    ratios = [k for k in res["summary"] if k.endswith(tuple(f"_over_{e}" for e in engines))]
    head = ["batch x prompt x new", "seeded"] + [f"{e} s" for e in engines] + [r.replace("_over_", " / ") for r in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in res["cells"]:
        cols = [f"{row['batch']} x {row['prompt']} x {row['new']}", "yes" if row["seeded"] else "no"]
        for e in engines:
            c = row.get(e)
            procs = len(c.get("process_medians_s", [])) if c else 0
            cols.append(f"{c['median_s']:.3f} ({c['min_s']:.3f}-{c['max_s']:.3f}, n={len(c['rounds_s'])}"
                        f"{f', {procs} processes' if procs > 1 else ''})" if c else "-")
        cols += [(f"{row[r]:.2f}" + (" ({:.2f}-{:.2f})".format(min(row[r + '_per_process']), max(row[r + '_per_process']))
                                      if r + "_per_process" in row else "")) if r in row else "-" for r in ratios]
        lines.append("| " + " | ".join(cols) + " |")
    lines.append("")
    for r in ratios:
        x = res["summary"][r]
        spread = (f"; over process pairs {x['per_process_range'][0]:.2f}-{x['per_process_range'][1]:.2f}"
                  if "per_process_range" in x else "")
        lines.append(f"- {r.replace('_over_', ' / ')}: worst {x['worst']:.2f} ({x['worst_cell']}), "
                     f"best {x['best']:.2f} ({x['best_cell']}), {x['cells']} cells{spread}")
    return "\n".join(lines) + "\n"


def bench_one_command(kind: str, ckpt: str, part: str, cells: list[tuple[int, int, int]], rounds: int,
                      mem_gb: float, seeded: tuple, budget_s: float, only: Optional[list[str]]) -> list[str]:
    """The ``bench-one`` command line ``bench`` runs for one engine (``only``: its ``--only`` list;
    an empty list times nothing)."""
    cmd = [sys.executable, os.path.abspath(__file__), "bench-one", "--engine", kind, "--ckpt", ckpt, "--out", part,
           "--cells", ",".join("x".join(map(str, c)) for c in cells), "--rounds", str(rounds),
           "--mem-gb", str(mem_gb), "--seeded", ",".join("on" if x else "off" for x in seeded),
           "--budget-s", str(budget_s)]
    if only is not None:
        cmd += ["--only", ",".join(only)]
    return cmd


def part_path(base: str, kind: str, process: int) -> str:
    """Where ``bench`` writes one engine process's result: ``BASE.KIND.json`` for an engine's first
    process, ``BASE.KIND.pN.json`` for its N-th repeat (``--processes``)."""
    return f"{base}.{kind}.json" if process == 0 else f"{base}.{kind}.p{process}.json"


def process_order(engines: tuple, processes: int) -> list[tuple[int, str]]:
    """The order ``bench`` starts engine processes in: every engine once per repeat, the order
    reversed on every other repeat (stock, aligned, aligned, stock, ...), so that a machine that
    drifts during the call, or the slot after another engine's exit, weighs on every engine alike."""
    return [(r, k) for r in range(processes) for k in (engines if r % 2 == 0 else tuple(reversed(engines)))]


def bench(ckpt: str, out: str, cells: list[tuple[int, int, int]], rounds: int, mem_gb: float = 20,
          engines: tuple = ("stock", "aligned"), seeded: tuple = (True,), budget_s: float = 0,
          processes: int = 1) -> dict:
    """Each engine in its own fresh process, one after the other (never two engines on the GPU at
    a time), then :func:`compare`. Writes ``out`` and each engine process's part beside it. The
    engines after the first one that ran time only the variants it finished (``--only``), so a
    budget or a cut-off that stops the first engine early still leaves every finished cell with a
    ratio instead of cells that only one engine has.

    ``processes`` > 1 starts each engine that many times (:func:`process_order`): one engine process
    can sit 5-10% off another of the same engine (measured on an H100: the same aligned engine at
    1 x 64 x 128, 0.247 s in one process and 0.267 s in the next), so a ratio of a few percent needs
    several processes per engine. Their rounds are pooled per cell (:func:`compare`), and the ratio
    of each pair of processes is reported beside the pooled one."""
    import subprocess

    parts = []
    base = os.path.splitext(out)[0]
    order = process_order(tuple(engines), processes)
    taken = [x for x in (part_path(base, k, r) for r, k in order) if os.path.exists(x)]
    if taken:  # the engines' parts of an earlier run (main checks --out itself) are never overwritten, nor read back
        raise SystemExit(f"rollout_gpu: {taken[0]} exists (an earlier run's results); give another --out")
    for r, kind in order:
        part = part_path(base, kind, r)
        env = {**os.environ, **ENGINE_KINDS[kind][1]}
        cmd = bench_one_command(kind, ckpt, part, cells, rounds, mem_gb, seeded, budget_s,
                                finished_variants(parts[0]) if parts else None)
        r = subprocess.run(cmd, env=env)
        if r.returncode != 0 or not os.path.exists(part):
            print(f"bench: engine {kind} failed (exit {r.returncode}); continuing", flush=True)
            if os.path.exists(part):  # cut off after some cells: keep them
                parts.append(json.load(open(part)))
            continue
        parts.append(json.load(open(part)))
    if not parts:
        raise SystemExit("bench: no engine ran")
    res = compare(parts)
    res["command"] = " ".join(sys.argv)
    json.dump(res, open(out, "w"), indent=1)
    for row in res["cells"]:
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    print("summary", json.dumps(res["summary"]), flush=True)
    if not res["summary"]["machine"]["stable"]:
        print(f"bench: the machine's speed moved during the run ({json.dumps(res['summary']['machine'])}): "
              "do not read the ratios as a measurement; run again", flush=True)
    return res


def profile(ckpt: str, out: str, cells: list[tuple[int, int, int]], kind: str = "aligned", seeded: bool = True,
            max_len: int = 0) -> dict:
    """Where the time goes: one engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), per cell:
    * the unprofiled wall of the cell and of the same prompts with half the new tokens, whose
      difference over the extra tokens is the marginal decode step;
    * one generate under torch.profiler: the top CUDA kernels (graph replays included, as CUPTI
      reports them) and the wall vs summed kernel time (the rest is host work or gaps);
    * one generate under cProfile: the host functions by own and cumulative time (scheduling,
      input preparation, sampling, Python launch overhead)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    aligned, env = ENGINE_KINDS[kind]
    os.environ.update(env)
    from kernels import settings

    settings.set_decode_split(os.environ.get("RZ_DECODE_SPLIT", "1") != "0")
    settings.set_fused_work_list(os.environ.get("RZ_FUSED_WORK_LIST", "1") != "0")
    settings.set_batched_draw(os.environ.get("RZ_BATCHED_DRAW", "1") != "0")
    settings.set_decode_rows(int(os.environ.get("RZ_DECODE_ROWS", "64")))
    settings.set_moe_narrow_tiles(os.environ.get("RZ_MOE_NARROW_TILES", "0") == "1")
    settings.set_qk_one_launch(os.environ.get("RZ_QK_ONE_LAUNCH", "0") == "1")
    settings.set_moe_direct_rows(os.environ.get("RZ_MOE_DIRECT_ROWS", "0") == "1")
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    # max_len: the engine's max_model_len, which sets the block table's width and so the split-KV
    # decode plan; give the bench grid's (--max-len 3088 for DEFAULT_CELLS) to profile what it runs
    eng = _engine(ckpt, aligned, mem_gb=16, max_len=max_len or max(p + n for _, p, n in cells) + 16)
    res: dict = {"ckpt": ckpt, "engine": kind, "env": env, "cells": []}
    lines = []
    replays = [0]  # CUDA graph replays (the in-process engine's decode steps, when it replays them)
    replay = torch.cuda.CUDAGraph.replay

    def counted(self, *a, **k):
        replays[0] += 1
        return replay(self, *a, **k)

    torch.cuda.CUDAGraph.replay = counted

    def save():
        json.dump(res, open(out, "w"), indent=1)
        open(os.path.splitext(out)[0] + ".txt", "w").write("\n".join(lines) + "\n")

    try:
        for (B, P, N) in cells:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(B, P, cfg["vocab_size"], seed=B + P)]

            def sp(n):
                return [SamplingParams(n=1, temperature=1.0, max_tokens=n, ignore_eos=True, logprobs=0,
                                       seed=(1000 + i) if seeded else None, detokenize=False) for i in range(B)]

            def timed(n):
                torch.cuda.synchronize()
                t = time.perf_counter()
                eng.llm.generate(prompts, sp(n), use_tqdm=False)
                torch.cuda.synchronize()
                return time.perf_counter() - t

            timed(N)  # warm-up
            replays[0] = 0
            walls = {n: sorted(timed(n) for _ in range(3))[1] for n in (N // 2, N)}
            replays_per_step = replays[0] / (3 * (N // 2) + 3 * N)  # ~1: every decode step replays a graph
            step_ms = (walls[N] - walls[N // 2]) / (N - N // 2) * 1e3
            with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                eng.llm.generate(prompts, sp(N), use_tqdm=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            ev = [e for e in prof.key_averages() if e.device_time_total > 0 and str(e.device_type).endswith("CUDA")]
            ev.sort(key=lambda e: -e.device_time_total)
            gpu_total = sum(e.device_time_total for e in ev) / 1e6
            n_kernels = sum(e.count for e in ev)
            top = [{"name": e.key[:90], "calls": e.count, "ms": round(e.device_time_total / 1e3, 2),
                    "share": round(e.device_time_total / 1e6 / max(gpu_total, 1e-9), 3)} for e in ev[:25]]
            pr = cProfile.Profile()
            pr.enable()
            eng.llm.generate(prompts, sp(N), use_tqdm=False)
            torch.cuda.synchronize()
            pr.disable()
            host = {}
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(30)
                host[key] = [ln.replace(str(ROOT) + os.sep, "") for ln in buf.getvalue().splitlines() if ln.strip()][-31:]
            cell = {"batch": B, "prompt": P, "new": N, "wall_s": round(walls[N], 4), "wall_half_s": round(walls[N // 2], 4),
                    "decode_step_ms": round(step_ms, 3), "profiled_wall_s": round(wall, 4),
                    "kernel_s": round(gpu_total, 4), "kernel_launches": n_kernels,
                    "graph_replays_per_decode_step": round(replays_per_step, 3), "top": top, "host": host}
            res["cells"].append(cell)
            lines.append(f"== {kind} {B}x{P}x{N}{' seeded' if seeded else ' unseeded'}: wall {walls[N]:.3f} s (half the new tokens {walls[N // 2]:.3f} s: "
                         f"decode step {step_ms:.2f} ms); profiled wall {wall:.3f} s, kernels {gpu_total:.3f} s in "
                         f"{n_kernels} launches; {replays_per_step:.2f} CUDA graph replays per decode step")
            lines += [f"  {x['ms']:9.2f} ms {x['share']:6.1%} {x['calls']:6d}  {x['name']}" for x in top]
            lines.append("  -- host, by own time (cProfile) --")
            lines += ["  " + ln for ln in host["tottime"]]
            lines.append("  -- host, by cumulative time --")
            lines += ["  " + ln for ln in host["cumulative"]]
            print("\n".join(lines), flush=True)
            save()
    finally:
        torch.cuda.CUDAGraph.replay = replay
        save()
        eng.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ckpt")
    a.add_argument("--config", choices=sorted(CONFIGS), required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--form", default="fp8", choices=("fp8", "bf16"),
                   help="DeepSeek-V4 configs: block-FP8 linears with scales (stock needs it) or bf16")
    b = sub.add_parser("check")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--engines", default="aligned,stock")
    for name in ("bench", "bench-one"):
        c = sub.add_parser(name)
        c.add_argument("--ckpt", required=True)
        c.add_argument("--out", required=True)
        c.add_argument("--cells", default=DEFAULT_CELLS)
        c.add_argument("--rounds", type=int, default=5)
        c.add_argument("--mem-gb", type=float, default=20)
        c.add_argument("--seeded", default="on", help="on, off or on,off: per-request seeds")
        c.add_argument("--budget-s", type=float, default=0,
                       help="per engine: cells forecast to end past this many seconds after its start are skipped")
        if name == "bench":
            c.add_argument("--engines", default="stock,aligned", help=f"comma list of {sorted(ENGINE_KINDS)}")
            c.add_argument("--processes", type=int, default=1,
                           help="start each engine this many times, the order reversed every other time; "
                                "rounds pooled per cell, each process pair's ratio reported beside")
        else:
            c.add_argument("--engine", choices=sorted(ENGINE_KINDS), required=True)
            c.add_argument("--only", default=None,
                           help="comma list of variants BxPxN/on|off to time (the rest of --cells / --seeded left out)")
    e = sub.add_parser("compare", help="bench-one results of separate calls side by side (as bench writes)")
    e.add_argument("--parts", nargs="+", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--md", default="", help="also write the table as markdown here (rollout_gpu.markdown)")
    d = sub.add_parser("profile")
    d.add_argument("--ckpt", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--cells", default="64x512x256")
    d.add_argument("--engine", default="aligned", choices=sorted(ENGINE_KINDS))
    d.add_argument("--seeded", default="on", choices=("on", "off"), help="per-request seeds")
    d.add_argument("--max-len", type=int, default=0,
                   help="the engine's max_model_len (default: the cells' longest + 16; the bench uses its grid's)")
    args = ap.parse_args(argv)
    taken = os.path.join(args.out, "config.json") if args.cmd == "ckpt" else args.out
    if os.path.exists(taken):  # never overwrite an earlier run's results or checkpoint
        print(f"rollout_gpu: --out {args.out} already holds results; give another --out", file=sys.stderr)
        return 2
    cells = [tuple(int(x) for x in c.split("x")) for c in getattr(args, "cells", "").split(",") if c]
    if args.cmd == "ckpt":
        make_ckpt(args.config, args.out, form=args.form)
    elif args.cmd == "check":
        check(args.ckpt, args.out, which=tuple(args.engines.split(",")))
    elif args.cmd == "compare":
        res = compare([json.load(open(p)) for p in args.parts])
        res["command"] = " ".join(sys.argv)
        json.dump(res, open(args.out, "w"), indent=1)
        if args.md:
            if os.path.exists(args.md):
                print(f"rollout_gpu: --md {args.md} already exists; give another path", file=sys.stderr)
                return 2
            open(args.md, "w").write(markdown(res))
        for row in res["cells"]:
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
        print("summary", json.dumps(res["summary"]), flush=True)
    elif args.cmd == "profile":
        profile(args.ckpt, args.out, cells, args.engine, args.seeded == "on", args.max_len)
    else:
        seeded = [{"on": True, "off": False}[x] for x in args.seeded.split(",")]
        if args.cmd == "bench-one":
            only = None if args.only is None else [v for v in args.only.split(",") if v]
            named = {variant(*c, sd) for c in cells for sd in seeded}
            bad = [v for v in (only or []) if v not in named]
            if bad:
                print(f"rollout_gpu: --only {bad[0]!r} is not one of --cells x --seeded "
                      f"(BxPxN/on or /off, e.g. {sorted(named)[0]})", file=sys.stderr)
                return 2
            bench_one(args.ckpt, args.out, args.engine, cells, args.rounds, seeded, args.mem_gb, args.budget_s, only)
        else:
            bad = [e for e in args.engines.split(",") if e not in ENGINE_KINDS]
            if bad:
                print(f"rollout_gpu: --engines {bad[0]!r} unknown; choose from {sorted(ENGINE_KINDS)}", file=sys.stderr)
                return 2
            if args.processes < 1:
                print(f"rollout_gpu: --processes {args.processes} must be 1 or more", file=sys.stderr)
                return 2
            bench(args.ckpt, args.out, cells, args.rounds, args.mem_gb, tuple(args.engines.split(",")), tuple(seeded),
                  args.budget_s, args.processes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
