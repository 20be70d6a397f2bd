"""The model families: one entry per recipe ``model.arch``, the one place that knows them by name.

Every package asks this registry (``family(arch)``) for a family's traits and names instead of
comparing ``arch`` strings: the Hugging Face class and model_type its checkpoints carry, the aligned
vLLM class (a ``module:Class`` string, so nothing here imports vLLM), the reference numerics module,
the learner module of a family that is not Megatron's GPTModel, the tiny-model maker, and the recipe
and planner rules that are data. Code that genuinely differs per family stays in the family's own
modules, reached through the names here (``load``). This module imports nothing of the project, so
``kernels``, ``megatron_rz`` and ``vllm_bridge`` may all import it. How to add a family:
docs/alignment.md "Adding a model family".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["Family", "FAMILIES", "NAMES", "family", "hf_family", "load"]

# vLLM-CPU's attention kernels support these head sizes (the GQA families' recipe rule)
_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)

_TINY = "megatron_rz.learner.tiny_models"


@dataclass(frozen=True)
class Family:
    """One model family. Fields are traits (what the family's model is) or names (where its code is)."""

    name: str  # recipe model.arch
    # ---- Hugging Face side
    hf_class: str  # config.json architectures[0] of its checkpoints (what the tiny-model maker writes)
    hf_model_types: tuple[str, ...]  # config.json model_type values (first: the usual one)
    hf_class_substrings: tuple[str, ...] = ()  # an `architectures` entry containing one of these is this family
    # ---- the two engines
    aligned_class: str = ""  # vLLM ModelRegistry name of the aligned class
    aligned_module: str = ""  # the module holding it (vllm_bridge.aligned.*)
    reference: str = ""  # reference numerics module (kernels.models.*)
    learner: str | None = None  # own learner module (build_model / load_weights / export_weights); None: GPTModel
    # ---- traits
    attention: str = "gqa"  # "gqa" | "mla" | "dsv4" (shared-KV sparse) | "kda" (KDA + MLA hybrid)
    moe: bool = True  # routed experts (False: dense, num_experts=0)
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3)
    qkv_bias: bool = False  # q/k/v projection biases (Qwen2)
    router: str = "softmax"  # the reference's router: "softmax" top-k, "sigmoid" (noaux_tc), ...
    shared_experts: bool = False
    hyper_connections: bool = False  # DeepSeek-V4 hc_mult residual streams
    hash_routing: bool = False  # the first num_hash_layers MoE layers route by a token-id table
    engram: bool = False  # DeepSeek-V4.1 engram (the aligned cache also holds 3 token-id digits)
    shared_compressors: bool = False  # V4.1: each run of one compress ratio shares its compressor / indexer
    # ---- what each engine implements
    aligned_tp_sharded: bool = False  # the aligned vLLM class shards over tensor parallelism
    aligned_pp: bool = False  # the aligned vLLM class has pipeline stages (_model.py's layer loop)
    learner_fp8_tp: bool = False  # learner blockwise FP8 at parallel.tp > 1
    reshard_pieces: bool = False  # the learner lists its per-rank HF pieces (rollout.weight_transport=reshard)
    # ---- recipe rules (data)
    cpu_head_dims: tuple[int, ...] = ()  # model.head_dim must be one of these (vLLM-CPU attention)
    head_dim_from_hidden: bool = False  # model.head_dim = hidden_size / num_attention_heads
    vllm_cpu_sizes: tuple[tuple[str, int], ...] = ()  # model.<key> = value that vLLM-CPU needs
    grouped_router: bool = False  # router_num_groups must divide num_experts, group_topk <= groups
    compress_ratios: tuple[int, ...] = ()  # per-layer model.compress_ratios values allowed (one per layer)
    compress_ratios_note: str = ""  # appended to the compress_ratios error
    fp8_refusal: str = ""  # model.fp8=blockwise refused with this line
    fp8_o_lora_block: bool = False  # model.fp8=blockwise needs o_lora_rank % 128 == 0
    router_scores: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus")  # model.router_score allowed
    router_refusal: str = ""  # the line when model.router_score is not among router_scores
    # row-parallel attention-output K: products of model fields (the K ROW_PARALLEL_K_SEGMENTS divides)
    attn_out_ks: tuple[tuple[str, ...], ...] = (("num_attention_heads", "head_dim"),)
    # ---- tiny model (megatron_rz.learner.tiny_models): "module:function" names
    tiny_config: str = ""  # (ModelConfig, eos_id, pad_id) -> transformers config ("" : no transformers class)
    tiny_model: str = f"{_TINY}:random_transformers_model"  # (recipe, tokenizer, seed) -> model
    tiny_save: str = f"{_TINY}:save_pretrained"  # (model, out_dir) -> None

    @property
    def gqa(self) -> bool:
        return self.attention == "gqa"

    @property
    def mla(self) -> bool:
        """DeepSeek-V3 multi-latent attention (Megatron's MLA; the reference's expanded MLA)."""
        return self.attention == "mla"

    @property
    def dsv4(self) -> bool:
        return self.attention == "dsv4"

    @property
    def aligned_path(self) -> str:
        """``module:Class`` of the aligned vLLM class (vLLM's lazy ModelRegistry.register_model)."""
        return f"{self.aligned_module}:{self.aligned_class}"


_V4_FP8 = dict(fp8_o_lora_block=True)
_KIMI_REFUSAL = ("model.arch=kimi_k3 routes with model.router_score sigmoid or softmax and has no FP8 "
                 "path yet (model.fp8=none)")

FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen3_moe", hf_class="Qwen3MoeForCausalLM", hf_model_types=("qwen3_moe",), hf_class_substrings=("Qwen3Moe",),
        aligned_class="RZAlignedQwen3MoeForCausalLM", aligned_module="vllm_bridge.aligned.qwen3_moe",
        reference="kernels.models.qwen3_dsv3", attention="gqa", qk_norm=True, router="softmax",
        aligned_tp_sharded=True, aligned_pp=True, learner_fp8_tp=True, reshard_pieces=True, cpu_head_dims=_CPU_HEAD_DIMS,
        tiny_config=f"{_TINY}:qwen3_moe_config"),
    Family(
        "qwen2", hf_class="Qwen2ForCausalLM", hf_model_types=("qwen2",),
        aligned_class="RZAlignedQwen2ForCausalLM", aligned_module="vllm_bridge.aligned.qwen2",
        reference="kernels.models.qwen3_dsv3", attention="gqa", moe=False, qkv_bias=True,
        aligned_pp=True, reshard_pieces=True, cpu_head_dims=_CPU_HEAD_DIMS, head_dim_from_hidden=True,
        fp8_refusal=("model.fp8=blockwise is implemented for qwen3_moe and deepseek_v3 (the learner's FP8 fused "
                     "q/k/v linear has no bias yet); set model.fp8=none for qwen2"),
        tiny_config=f"{_TINY}:qwen2_config"),
    Family(
        "deepseek_v3", hf_class="DeepseekV3ForCausalLM", hf_model_types=("deepseek_v3",),
        hf_class_substrings=("DeepseekV3",),
        aligned_class="RZAlignedDeepseekV3ForCausalLM", aligned_module="vllm_bridge.aligned.deepseek_v3",
        reference="kernels.models.qwen3_dsv3", attention="mla", router="sigmoid", shared_experts=True,
        aligned_tp_sharded=True, aligned_pp=True, learner_fp8_tp=True, reshard_pieces=True,
        vllm_cpu_sizes=(("kv_lora_rank", 512), ("qk_rope_head_dim", 64)), grouped_router=True,
        attn_out_ks=(("num_attention_heads", "v_head_dim"),), tiny_config=f"{_TINY}:deepseek_v3_config"),
    Family(
        "deepseek_v4", hf_class="DeepseekV4ForCausalLM", hf_model_types=("deepseek_v4",),
        aligned_class="RZAlignedDeepseekV4ForCausalLM", aligned_module="vllm_bridge.aligned.deepseek_v4",
        reference="kernels.models.dsv4", learner="megatron_rz.learner.deepseek_v4", attention="dsv4",
        router="sqrtsoftplus", shared_experts=True, hyper_connections=True, hash_routing=True,
        aligned_tp_sharded=True, compress_ratios=(0, 4, 128), **_V4_FP8,
        attn_out_ks=(("o_groups", "o_lora_rank"),), tiny_config=f"{_TINY}:deepseek_v4_config",
        tiny_save=f"{_TINY}:save_deepseek_v4_checkpoint"),
    Family(
        "deepseek_v41", hf_class="DeepseekV41ForCausalLM", hf_model_types=("deepseek_v41", "deepseek_v4"),
        aligned_class="RZAlignedDeepseekV41ForCausalLM", aligned_module="vllm_bridge.aligned.deepseek_v41",
        reference="kernels.models.dsv41", learner="megatron_rz.learner.deepseek_v4", attention="dsv4",
        router="sqrtsoftplus", shared_experts=True, hyper_connections=True, hash_routing=True, engram=True,
        shared_compressors=True, aligned_tp_sharded=True, compress_ratios=(0, 1, 2),
        compress_ratios_note="; the tiny models' kv / index sources: the first layer of each run of one ratio",
        **_V4_FP8, attn_out_ks=(("o_groups", "o_lora_rank"),),
        tiny_model=f"{_TINY}:random_deepseek_v41_model", tiny_save=f"{_TINY}:save_config_dict_checkpoint"),
    Family(
        "kimi_k3", hf_class="KimiLinearForCausalLM", hf_model_types=("kimi_linear",),
        aligned_class="RZAlignedKimiK3ForCausalLM", aligned_module="vllm_bridge.aligned.kimi_k3",
        reference="kernels.models.kimi_k3", learner="megatron_rz.learner.kimi_k3", attention="kda",
        router="sigmoid", shared_experts=True, fp8_refusal=_KIMI_REFUSAL, router_scores=("softmax", "sigmoid"),
        router_refusal=_KIMI_REFUSAL,
        attn_out_ks=(("num_attention_heads", "v_head_dim"), ("num_attention_heads", "head_dim")),
        tiny_model=f"{_TINY}:random_kimi_k3_model", tiny_save=f"{_TINY}:save_kimi_k3_checkpoint"),
)

NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
_BY_NAME = {f.name: f for f in FAMILIES}


def family(arch: str) -> Family:
    """The registry entry of recipe ``model.arch`` ``arch``."""
    try:
        return _BY_NAME[arch]
    except KeyError:
        raise ValueError(f"model.arch={arch!r}: unknown model family; use one of {', '.join(NAMES)}") from None


def hf_family(model_type: str, architectures, among: tuple[Family, ...] = FAMILIES) -> Family | None:
    """The first family of ``among`` a Hugging Face config belongs to: its model_type, or an
    ``architectures`` entry naming its HF or aligned class (or containing one of its class substrings)."""
    for f in among:
        if model_type in f.hf_model_types or any(
                a in (f.hf_class, f.aligned_class) or any(s in a for s in f.hf_class_substrings)
                for a in architectures):
            return f
    return None


def load(path: str) -> Any:
    """The object a ``module:attr`` name of an entry points to (imported on first use), or the module."""
    module, _, attr = path.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod
