"""The learner's model: Megatron-Core's own GPTModel built from a recipe's ModelConfig.

Layer specs are megatron-core's local (non Transformer-Engine) specs with two substitutions that
keep the forward identical to the Hugging Face reference and make it run on CPU:
- `RMSNorm`: the Hugging Face formula (float32 statistics, weight applied after casting back).
  megatron-core's own WrappedTorchNorm refuses sequence parallelism, which MoE with TP needs.
- `CoreAttention`: plain causal softmax attention (float32 softmax), with GQA and a separate value
  head size (MLA). megatron-core's DotProductAttention does not take the k_channels/v_channels the
  MLA spec passes, and builds its causal mask on CUDA.

MoE uses SequentialMLP experts (no grouped GEMM) and the all-gather token dispatcher (works over
gloo; the all-to-all dispatcher needs CUDA streams). Routing is configured to match Hugging Face:
- Qwen3-MoE (softmax, norm_topk_prob): top-k over logits, then softmax over the k chosen logits
  (the same numbers as softmax over all experts, top-k, renormalise).
- DeepSeek-V3 (noaux_tc): sigmoid scores; scores + e_score_correction_bias only choose the experts
  (grouped top-k: groups ranked by their top-2 score sum); weights are the unbiased scores of the
  chosen experts, normalised, times routed_scaling_factor.
Auxiliary losses are off (coefficient 0, load-balancing type "none") and so is dropout. The
DeepSeek expert bias is kept fixed during RL (update rate 0): it is a load-balancing statistic of
pre-training and changing it would change which experts the rollout engine picks.

Fast mode with Transformer Engine (``te=True``; recipe runtime.te, megatron_rz.learner.te_spec):
megatron-core's own ``get_gpt_layer_with_transformer_engine_spec`` unchanged (TE linears with the
input / pre-MLP RMSNorm fused in, TE RMSNorm for the MoE pre-MLP and Qwen3 q/k norms, TE attention,
MLA's q / kv norms fused into the up projections, experts as TE grouped-GEMM linears) and a TE
RMSNorm as the final norm: the layers a Megatron user on Hopper runs. The TransformerConfig is the
local one's but for moe_grouped_gemm (routing, all-gather dispatcher and the unfused RoPE / permute
stay). Parameter names differ from the local spec's: te_spec.local_to_te / te_to_local.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import replace

import torch
import torch.nn.functional as F

from kernels.families import family
from megatron_rz.learner import megatron_patches, te_spec
from megatron_rz.recipe import ModelConfig, ParallelConfig


# ------------------------------------------------------------------ process groups


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeout_kwargs(parallel: ParallelConfig) -> dict:
    """parallel.collective_timeout_s: how long a learner collective waits for the other ranks before
    it raises (a dead or hung rank becomes an error, not a hang). None: torch's defaults (gloo 30 min,
    NCCL 10 min). Megatron's subgroups take whole minutes (rounded up)."""
    from datetime import timedelta

    s = parallel.collective_timeout_s
    return {"timeout": timedelta(seconds=float(s))} if s else {}


def init_parallel(parallel: ParallelConfig, seed: int = 0) -> None:
    """Start torch.distributed and Megatron's parallel state for `parallel`.

    Backend: gloo on a CPU host; NCCL when CUDA is available, each process on GPU LOCAL_RANK
    (torch.cuda.set_device before the process group starts). Works under torchrun
    (RANK/WORLD_SIZE/MASTER_* from the environment) and as a plain single process (world size 1 on
    a free loopback port). Calling it again with the same layout only re-seeds; a different layout
    tears Megatron's groups down and builds them again.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    megatron_patches.apply()
    if not dist.is_initialized():
        # GPU: NCCL, one GPU per process (LOCAL_RANK). CPU: gloo (unchanged).
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:  # under torchrun
            dist.init_process_group(backend, init_method="env://", **_timeout_kwargs(parallel))
        else:
            # A lone process: its own loopback port, passed explicitly. Nothing goes into
            # os.environ, so child processes (tests, rz subcommands) never inherit a bound port.
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world != parallel.world_size:
        raise ValueError(
            f"parallel layout tp*pp*dp={parallel.world_size} does not match the {world} started processes; "
            f"set parallel.dp={world // (parallel.tp * parallel.pp)}"
        )
    layout = (parallel.tp, parallel.pp, parallel.ep, parallel.etp)
    if ps.model_parallel_is_initialized():
        current = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        if current != layout:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
            **({"distributed_timeout_minutes": max(1, math.ceil(parallel.collective_timeout_s / 60))}
               if parallel.collective_timeout_s else {}),
        )
    # Per-region seeding (model-parallel, expert-parallel and data-parallel RNG states): CUDA
    # generators on a GPU, the CPU generator through megatron_patches on a CPU host.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ------------------------------------------------------------------ modules substituted into the spec


class RMSNorm(torch.nn.Module):
    """RMSNorm computed like Hugging Face's (Qwen3/DeepSeek-V3): float32 statistics, then
    weight * normalised.to(input dtype). Weight grads are partial sums under sequence parallelism;
    the `sequence_parallel` attribute makes finalize_model_grads all-reduce them across TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class CoreAttention(torch.nn.Module):
    """Causal attention on [s, b, heads, dim] tensors; float32 softmax like HF eager attention."""

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.config = config
        k = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_):
        assert packed_seq_params is None, "packed sequences are not supported by CoreAttention"
        sq, b, nh, _d = query.shape
        sk, _, nkv, _ = key.shape
        if nkv != nh:  # grouped-query attention: each kv head serves nh // nkv query heads
            key = key.repeat_interleave(nh // nkv, dim=2)
            value = value.repeat_interleave(nh // nkv, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, h, s, d]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(diagonal=sk - sq + 1)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # [b, h, s, dv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * v.shape[-1])


# ------------------------------------------------------------------ config and specs


def transformer_config(m: ModelConfig, parallel: ParallelConfig, te: bool = False):
    """The Megatron TransformerConfig (MLATransformerConfig for deepseek_v3) for the recipe; te=True:
    for the Transformer Engine layer spec (grouped-GEMM experts), otherwise the same."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if m.router_score == "sigmoid" and not m.norm_topk_prob and m.top_k > 1:
        raise ValueError("megatron-core always renormalises sigmoid top-k weights; set model.norm_topk_prob=true")
    if (
        m.router_num_groups > 1
        and m.router_group_topk < m.router_num_groups
        and m.top_k // m.router_group_topk != 2
    ):
        raise ValueError(
            "megatron-core ranks expert groups by their top-(top_k // router_group_topk) scores while "
            "Hugging Face DeepSeek-V3 uses the top-2: pick model.top_k = 2 * model.router_group_topk"
        )
    if m.vocab_size % parallel.tp:
        raise ValueError(f"model.vocab_size={m.vocab_size} must be a multiple of parallel.tp={parallel.tp}")
    dtype = getattr(torch, m.dtype)
    moe_pattern = [0] * m.first_k_dense + [1] * (m.num_layers - m.first_k_dense)
    kw = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_kv_heads,
        kv_channels=m.head_dim,
        ffn_hidden_size=m.dense_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family(m.arch).qkv_bias,  # Qwen2: q/k/v biases (linear_qkv.bias), no other bias
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        sequence_parallel=parallel.tp > 1,  # required by MoE + TP
        use_cpu_initialization=True,
        perform_initialization=True,  # random init also sets the TP attributes (partition_dim, ...)
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        calculate_per_token_loss=True,  # the learner scales losses itself: DDP sums, never averages
        rotary_interleaved=False,
        # MoE
        num_moe_experts=m.num_experts,
        moe_layer_freq=moe_pattern,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_topk=m.top_k,
        moe_grouped_gemm=te,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_input_jitter_eps=None,
        moe_router_dtype="fp32",
        moe_router_score_function=m.router_score,
        moe_router_pre_softmax=(m.router_score == "softmax" and not m.norm_topk_prob),
        moe_router_enable_expert_bias=m.router_expert_bias,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=m.router_num_groups if m.router_num_groups > 1 else None,
        moe_router_group_topk=m.router_group_topk if m.router_num_groups > 1 else None,
        moe_router_topk_scaling_factor=m.routed_scaling_factor if m.router_score == "sigmoid" else None,
        moe_shared_expert_intermediate_size=(
            m.num_shared_experts * m.moe_ffn_hidden_size if m.num_shared_experts else None
        ),
        moe_shared_expert_overlap=False,
        moe_permute_fusion=False,
    )
    if not m.num_experts:  # a dense model (qwen2): no MoE settings at all (Megatron refuses them)
        kw = {k: v for k, v in kw.items() if not k.startswith(("moe_", "num_moe_experts"))}
    f = family(m.arch)
    if f.gqa:
        return TransformerConfig(**kw, qk_layernorm=f.qk_norm)
    return MLATransformerConfig(
        **kw,
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="rope",
        rotary_base=m.rope_theta,
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
    )


def _layer_spec(m: ModelConfig, moe: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    f = family(m.arch)
    spec = get_gpt_layer_local_spec(
        num_experts=(m.num_experts or None) if moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=f.qk_norm,
        multi_latent_attention=f.mla,
        normalization="RMSNorm",
    )
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    attn.core_attention = CoreAttention
    if f.qk_norm:
        attn.q_layernorm = RMSNorm
        attn.k_layernorm = RMSNorm
    elif f.mla:
        from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear

        attn.kv_layernorm = RMSNorm
        attn.q_layernorm = RMSNorm if m.q_lora_rank else IdentityOp
        # kv down-projection replicated on every TP rank (megatron-core's plain `Linear`, the
        # local counterpart of TE's "duplicated" linear). With the local spec's
        # ColumnParallelLinear, MLA all-gathers the output over TP and each rank keeps the full
        # shared k_rope; the gather's backward only takes the rank's own slice, so the k_rope
        # gradient of the other ranks' heads is lost (TP=2 trained differently from TP=1). With a
        # replicated linear MLA takes its other branch: k_rope is gathered along the sequence
        # and its backward reduce-scatter sums all heads' gradients; the weight's partial grads
        # are all-reduced over TP through its `sequence_parallel` attribute.
        attn.linear_kv_down_proj = ReplicatedLinear
    return spec


def _te_layer_spec(m: ModelConfig, moe: bool):
    """megatron-core's Transformer Engine layer spec for one layer (fast mode, te=True)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    f = family(m.arch)
    experts = (m.num_experts or None) if moe else None
    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=experts,
        moe_grouped_gemm=experts is not None,  # TEGroupedMLP: one grouped GEMM per projection
        # Qwen3: TE RMSNorm q/k norms; MLA: q_a / kv_a norms fused into the q / kv up projections
        qk_layernorm=f.qk_norm or f.mla,
        multi_latent_attention=f.mla,
    )


def build_gpt_model(model_cfg: ModelConfig, parallel: ParallelConfig, mode: str = "fast", te: bool = False):
    """Megatron GPTModel for the recipe (call init_parallel first). Weights are uninitialised
    placeholders until hf_convert.load_hf_into_megatron fills them.

    mode="fast": the modules above (Megatron's stock numerics). mode="aligned": the same model and
    parameters, every forward op through `kernels` (megatron_rz.learner.aligned_spec), bitwise equal to
    kernels.models.qwen3_dsv3 for any batching / TP (1, 2) / EP (1, 2). RoPE is then applied
    inside the aligned attention modules (float64 tables), so GPTModel gets no position embedding.
    te=True (mode="fast" only): megatron-core's Transformer Engine spec (_te_layer_spec; parameter
    names of te_spec). The model's ``rz_learner_spec`` says which spec it was built from."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if mode not in ("fast", "aligned"):
        raise ValueError(f"build_gpt_model: mode must be 'fast' or 'aligned', not {mode!r}")
    if te and mode != "fast":
        raise ValueError("build_gpt_model: te=True builds the fast learner's Transformer Engine layers; mode=aligned "
                         "builds its own")
    megatron_patches.apply()
    m = model_cfg
    config = transformer_config(m, parallel, te=te)
    layer_specs = [_layer_spec(m, moe=i >= m.first_k_dense) for i in range(m.num_layers)]
    final_norm = RMSNorm
    pos_emb = "rope" if family(m.arch).gqa else "none"
    if te:
        from megatron.core.extensions.transformer_engine import TENorm

        layer_specs = [_te_layer_spec(m, moe=i >= m.first_k_dense) for i in range(m.num_layers)]
        final_norm = TENorm
    if mode == "aligned":
        from megatron_rz.learner import aligned_spec

        aligned_spec.check_aligned_supported(m, parallel)
        layer_specs = [aligned_spec.aligned_layer_spec(s, m, RMSNorm, CoreAttention) for s in layer_specs]
        final_norm = aligned_spec.AlignedRMSNorm
        pos_emb = "none"
    block = TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=final_norm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        position_embedding_type=pos_emb,
        rotary_percent=1.0,
        rotary_base=int(m.rope_theta),
    )
    # Routed-expert weights are replicated over the expert-data-parallel group, which under
    # sequence parallelism includes the TP ranks when expert TP < TP (each TP rank routes its own
    # slice of the tokens). megatron-core marks expert weights `allreduce=False` (reduced over the
    # expert-DP group by DDP) only when ep > 1; with ep == 1 they are reduced over the dense DP
    # group, which lacks those TP ranks, and their grads stay partial. Mark them always.
    spec = "aligned" if mode == "aligned" else "te" if te else "local"
    for name, param in model.named_parameters():
        if ".experts.local_experts." in te_spec.to_local(name, m, spec):  # routed experts, either spec
            setattr(param, "allreduce", False)
    model = model.to(getattr(torch, m.dtype))
    if torch.cuda.is_available():
        # Built on the CPU (use_cpu_initialization), then moved to this rank's GPU before Megatron's
        # DDP allocates its grad buffers there (torch.cuda.current_device(), set by init_parallel).
        model = model.cuda(torch.cuda.current_device())
    if mode == "aligned":
        from megatron_rz.learner import aligned_spec

        aligned_spec.alignify_model(model, RMSNorm, CoreAttention)
    model.rz_learner_spec = spec
    return model
