"""Layout planner: does the recipe's parallel layout fit the cluster section's nodes and GPUs?

`make_plan(recipe)` checks the GPU counts against the layouts and estimates per-GPU memory for the
learner (weights, gradients, Adam state, activations, logits) and for the rollout engines
(weights, KV cache); a layout that cannot run raises PlanError listing every problem with its
numbers. Nothing here imports torch, Megatron or vLLM: it runs on a login node in milliseconds.

Parameter counts follow the Hugging Face modules of each architecture (Qwen3-MoE / Qwen3 dense,
DeepSeek-V3, DeepSeek-V4) exactly; tests compare them with meta-device instantiations.

Memory model, per GPU (b = bytes per element of model.dtype: 2 bf16, 4 fp32; 1 GiB = 2^30 bytes):
  learner, parameters on one rank: N = non-expert / (tp * pp) + routed experts / (ep * etp * pp)
    weights    N * b
    gradients  N * 4                  (fp32 main_grad: the learner uses grad_reduce_in_fp32)
    optimizer  N * (12 if b == 2 else 8)   (fp32 master copy when b == 2, Adam m and v in fp32);
               with parallel.distributed_optimizer, divided by the data-parallel size of each part
               (non-expert: dp; experts: tp * dp / (ep * etp))
    activations  T = algo.micro_batch_size * seq_len tokens, split over tp (sequence parallel):
               recompute none: (layers / pp) * pp in flight * T * a * b / tp
               recompute full: (layers / pp) * pp * T * h * b / tp + T * a * b / tp (one layer redone)
               a = elements kept per token and layer: 4h (residual stream, norms; x hc_mult for V4's
                   hyper-connections) + attention (q, k, v, core output; MLA/V4 also the low-rank
                   projections) + MLP (3 * ffn) or MoE (router logits + top_k * (h + 3 * moe_ffn) +
                   shared * 3 * moe_ffn)
    logits     T * vocab / tp * 4 * 2   (fp32 logits and their gradient for the logprob loss)
    + plan.overhead_gb (CUDA context, NCCL buffers, fragmentation)
  rollout, one engine over rollout.tensor_parallel_size GPUs (engine_tp):
    weights    mode=fast (stock vLLM, everything sharded): total params * b / engine_tp
               mode=aligned, TP-sharded classes (Qwen3-MoE / Qwen3 dense, DeepSeek-V3 (blockwise
               FP8 included; vllm_bridge/aligned/_model.py) and DeepSeek-V4 / V4.1 (deepseek_v4.py)):
               (replicated + sharded / engine_tp) * b, sharded = q/k/v/o (Qwen3) or q_b_proj (q_proj)
               / kv_b_proj / o_proj (DeepSeek-V3 MLA) or wq_b / attn_sink / wo_a / wo_b (V4), dense
               MLPs and routed experts; replicated = embeddings, lm_head, norms, router, shared
               experts, DeepSeek-V3's latent projections q_a_proj / kv_a_proj_with_mqa, V4's wq_a,
               shared KV head (wkv), compressors, indexer, hyper-connections (and V4.1's engram);
               mode=aligned otherwise (Qwen2): the whole model on every TP worker (engine_tp
               counts as 1)
    fp8_weights  model.fp8=blockwise (aligned): the FP8 linears' e4m3 copies next to the model-dtype
               parameters, (1 + 4 / 128^2) bytes per element (scale per 128x128 block), the TP-split
               ones / engine_tp, shared experts and MLA's latent projections whole (V4 / V4.1:
               kernels.models.dsv4.FP8_LINEARS; wq_b / wo_a / wo_b / routed experts split, wq_a / wkv /
               indexer wq_b / shared experts whole)
    KV cache   rollout.kv_cache_gb (vLLM kv_cache_memory_bytes, per GPU); it must hold one
               sequence of seq_len tokens, per token and GPU:
                 GQA   2 * ceil(kv_heads / engine_tp) * head_dim * b * layers (engine_tp 1 if replicated)
                 MLA   fast: (kv_lora_rank + rope) * b * layers (vLLM's latent cache, on each TP rank);
                       aligned: the expanded per-head cache, V zero-padded to the K head size,
                       2 * (heads / engine_tp) * (qk_nope + qk_rope) * b * layers
                 V4    kernels.models.dsv4_cache (the same on every TP rank: one KV head):
                       fast: stock vLLM 0.26's pages (fp8 entries of 584 B per ratio tokens, 132 B
                       indexer keys per 4 tokens) + per sequence its sliding windows and fp32
                       compressor states; aligned: the compressed entries in stock's fp8 format
                       (kernels/kv_fp8.py) striped over their tokens + per sequence a window of
                       payload rows
                       (docs/architecture.md "The DeepSeek-V4 cache"); V4.1 aligned: one payload
                       row per token and layer (key + compressor / indexer rows, padded to a
                       multiple of 256) in the model dtype
    + plan.overhead_gb
  An aligned TP-sharded engine needs rollout.tensor_parallel_size dividing
  kernels.ROW_PARALLEL_K_SEGMENTS (8) and every split count divisible by it (attention heads, Qwen3's
  KV heads, routed experts, dense intermediate size; the row-parallel K of o_proj / down_proj (V4:
  wo_b, o_groups x o_lora_rank) by 8;
  with blockwise FP8 that K by 8 x 128 and every column shard's rows per rank by 128),
  the checks of the class's ``_tp_config``: rollout_tp_errors() names the key and the fix.
CPU-only components (gpus_per_node: 0) are planned and printed, not checked against a budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kernels.families import FAMILIES, family
from megatron_rz.recipe import ModelConfig, Recipe, RecipeError

GiB = float(1 << 30)


class PlanError(RecipeError):
    """A layout that cannot run on the cluster section's nodes, with the numbers."""


# ============================================================================ parameter counts


@dataclass
class ParamCounts:
    embedding: int = 0
    output: int = 0
    attention: int = 0  # all layers, incl. their norms, V4 compressors/indexers and hyper-connections
    dense_mlp: int = 0  # dense layers' MLPs (first_k_dense, or every layer of a dense model)
    shared_experts: int = 0
    routed_experts: int = 0
    router: int = 0
    final_norm: int = 0
    active_routed: int = 0  # routed expert parameters one token passes through (top_k of them)

    @property
    def total(self) -> int:
        return (self.embedding + self.output + self.attention + self.dense_mlp + self.shared_experts
                + self.routed_experts + self.router + self.final_norm)

    @property
    def non_expert(self) -> int:
        return self.total - self.routed_experts

    @property
    def active(self) -> int:
        return self.non_expert + self.active_routed


def _attention_params(m: ModelConfig, layer: int) -> int:
    h, n = m.hidden_size, m.num_attention_heads
    norms = 2 * h  # input and post-attention RMSNorm
    f = family(m.arch)
    if f.gqa:  # GQA; Qwen3: per-head q/k RMSNorm; Qwen2: q/k/v biases
        d = m.head_dim
        qkv = (h + (1 if f.qkv_bias else 0)) * (n + 2 * m.num_kv_heads) * d
        return qkv + n * d * h + (2 * d if f.qk_norm else 0) + norms
    if f.mla:  # MLA
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * n * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + n * m.v_head_dim * h + norms
    # deepseek_v4: low-rank q, one shared KV head of head_dim, grouped low-rank output, sinks
    d, ql, g, ol = m.head_dim, m.q_lora_rank or 0, m.o_groups, m.o_lora_rank
    p = h * ql + ql + ql * n * d + h * d + d + n * d * ol + g * ol * h + n + norms
    ratio = m.compress_ratios[layer]
    if ratio == 128:  # heavily compressed attention: one compressor
        p += 2 * h * d + ratio * d + d
    elif ratio == 4:  # compressed sparse attention: overlapping compressor + lightning indexer
        ih, idim = m.index_n_heads, m.index_head_dim
        p += 2 * h * 2 * d + ratio * 2 * d + d
        p += ql * ih * idim + 2 * h * 2 * idim + ratio * 2 * idim + idim + h * ih
    hc = m.hc_mult
    p += 2 * (hc * (2 + hc) * hc * h + hc * (2 + hc) + 3)  # attention and FFN hyper-connections
    return p


def count_params(m: ModelConfig) -> ParamCounts:
    h, L = m.hidden_size, m.num_layers
    c = ParamCounts()
    c.embedding = m.vocab_size * h
    c.output = 0 if m.tie_word_embeddings else m.vocab_size * h
    c.final_norm = h
    f = family(m.arch)
    if f.hyper_connections and not f.engram:  # V4's hyper-connection head that merges the hc_mult streams
        c.final_norm += m.hc_mult * m.hc_mult * h + m.hc_mult + 1
    for i in range(L):
        c.attention += _attention_params(m, i)
        if m.num_experts == 0 or i < m.first_k_dense:
            c.dense_mlp += 3 * h * m.dense_ffn_hidden_size
        else:
            expert = 3 * h * m.moe_ffn_hidden_size
            c.routed_experts += m.num_experts * expert
            c.active_routed += m.top_k * expert
            c.shared_experts += m.num_shared_experts * expert
            c.router += m.num_experts * h
    return c


# ============================================================================ the plan


@dataclass
class Plan:
    recipe_name: str
    params: ParamCounts
    learner_ranks: int
    learner_ranks_per_node: int
    learner_gpus: int
    rollout_gpus: int
    seq_len: int
    learner_mem: dict[str, float] = field(default_factory=dict)  # GiB per GPU (per rank on CPU)
    learner_budget: float | None = None
    rollout_mem: dict[str, float] = field(default_factory=dict)
    rollout_budget: float | None = None
    rollout_seqs_fit: float = 0.0
    rollout_seqs_wanted: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def learner_total(self) -> float:
        return sum(self.learner_mem.values())

    @property
    def rollout_total(self) -> float:
        return sum(self.rollout_mem.values())


def _bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def _act_elements_per_token(m: ModelConfig, moe_layer: bool) -> float:
    h, n = m.hidden_size, m.num_attention_heads
    f = family(m.arch)
    a = 4 * h * (m.hc_mult if f.hyper_connections else 1)
    if f.gqa:
        a += 2 * n * m.head_dim + 2 * m.num_kv_heads * m.head_dim
    elif f.mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        a += (m.q_lora_rank or 0) + 2 * n * qk + (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * n * m.v_head_dim
    else:
        a += (m.q_lora_rank or 0) + 2 * n * m.head_dim + m.head_dim + m.o_groups * m.o_lora_rank
    if moe_layer:
        f = m.moe_ffn_hidden_size
        a += m.num_experts * 2 + m.top_k * (h + 3 * f) + m.num_shared_experts * 3 * f  # fp32 router logits
    else:
        a += 3 * m.dense_ffn_hidden_size
    return a


def _kv_per_token_and_seq(m: ModelConfig, engine_tp: int, aligned: bool = False) -> tuple[float, float]:
    """Rollout KV bytes per GPU: (per token, fixed per sequence). engine_tp: the TP size the cache is
    split over (1 for a replicated aligned class); aligned: the cache as the aligned classes store it."""
    b = _bytes(m.dtype)
    f = family(m.arch)
    if f.gqa:
        heads = math.ceil(m.num_kv_heads / engine_tp)  # replicated when tp > kv heads
        return 2 * heads * m.head_dim * b * m.num_layers, 0.0
    if f.mla:
        if aligned:  # expanded MLA: per local query head K and V of qk_nope + qk_rope (V zero-padded)
            heads = math.ceil(m.num_attention_heads / engine_tp)
            return 2 * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * b * m.num_layers, 0.0
        return (m.kv_lora_rank + m.qk_rope_head_dim) * b * m.num_layers, 0.0
    if aligned and f.engram:  # DeepSeek-V4.1: one payload row per token and layer, replicated over TP
        return _v4_aligned_payload(m) * b * m.num_layers, 0.0
    layout = v4_cache_layout(m, aligned)
    return layout.per_token, layout.per_sequence


def v4_cache_layout(m: ModelConfig, aligned: bool):
    """DeepSeek-V4's rollout cache per engine worker (replicated over TP in both modes): the aligned
    class's compact layout or stock vLLM 0.26's, from kernels.models.dsv4_cache, the definition the
    aligned engine allocates from."""
    from kernels.models import dsv4_cache

    kw = dict(head_dim=m.head_dim, index_head_dim=m.index_head_dim, compress_ratios=m.compress_ratios[:m.num_layers],
              sliding_window=m.sliding_window)
    if not aligned:
        return dsv4_cache.stock_layout(**kw)
    # the entries in the V4 classes' default format (fp8, as stock; a checkpoint's rz_kv_entries=model
    # stores them in the model dtype instead: aligned_layout(entries="model"))
    return dsv4_cache.aligned_layout(dtype_bytes=_bytes(m.dtype), rope_dim=m.qk_rope_head_dim,
                                     entries=dsv4_cache.ENTRIES_DEFAULT, **kw)


def _v4_aligned_payload(m: ModelConfig) -> int:
    """Values the aligned V4 class caches per token and layer: the widest layer's payload (key D;
    HCA + 2D compressor rows; CSA + 4D compressor and 4 index_head_dim indexer rows; V4.1 + 3 token-id
    digits) padded to two halves of whole 128-wide cache heads (RZAlignedDeepseekV4ForCausalLM)."""
    d, di = m.head_dim, m.index_head_dim
    widths = [d if r == 0 else 3 * d if r == 128 else 5 * d + 4 * di for r in m.compress_ratios[:m.num_layers]]
    extra = 3 if family(m.arch).engram else 0
    return 2 * (-(-(max(widths or [d]) + extra) // 256) * 128)


TP_SHARDED_ARCHS = tuple(f.name for f in FAMILIES if f.aligned_tp_sharded)


def aligned_tp_sharded(recipe: Recipe) -> bool:
    """Whether the rollout's aligned vLLM class shards over tensor parallelism (``TP_SHARDED``, blockwise
    FP8 included: vllm_bridge/aligned/qwen3_moe.py, deepseek_v3.py, deepseek_v4.py / deepseek_v41.py);
    False in mode=fast."""
    m = recipe.model
    return recipe.mode == "aligned" and family(m.arch).aligned_tp_sharded


def _fp8_tp_problems(m: ModelConfig, tp: int) -> list[tuple[str, str]]:
    """model.fp8=blockwise: the shape rules of the row-parallel FP8 contract at engine TP=tp, as the
    engine's ``_model.fp8_tp_problems`` checks them (docs/tp.md "FP8")."""
    if m.fp8 == "none" or tp == 1:
        return []
    from kernels import ROW_PARALLEL_K_SEGMENTS as seg

    B = 128
    dsv3 = family(m.arch).mla
    vkey = "v_head_dim" if dsv3 else "head_dim"
    rows = {f"model.num_attention_heads * model.{vkey}": m.num_attention_heads * (m.v_head_dim if dsv3 else m.head_dim)}
    if _has_dense_layers(m):
        rows["model.dense_ffn_hidden_size"] = m.dense_ffn_hidden_size
    out = [(k, f"{k}={K} (a row-parallel FP8 K) is not a multiple of {seg} x {B} = {seg * B}")
           for k, K in rows.items() if K % (seg * B)]
    if dsv3:
        cols = {"model.num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)":
                m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
                "model.num_attention_heads * (qk_nope_head_dim + v_head_dim)":
                m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)}
    else:
        cols = {"model.num_attention_heads * model.head_dim": m.num_attention_heads * m.head_dim,
                "model.num_kv_heads * model.head_dim": m.num_kv_heads * m.head_dim}
    if _has_dense_layers(m):
        cols["model.dense_ffn_hidden_size"] = m.dense_ffn_hidden_size
    out += [(k, f"{k}={n} gives {n // tp} FP8 rows per rank, not a multiple of the {B}-row weight block")
            for k, n in cols.items() if (n // tp) % B]
    return out


def rollout_fp8_cache_params(m: ModelConfig, shard: int, split: int, layers: range | None = None) -> float:
    """Weight elements per engine worker that the aligned class also keeps as e4m3 + 128x128 fp32
    scales (model.fp8=blockwise: every attention projection and dense / shared / routed expert linear,
    quantised once per load next to the model-dtype parameters): the TP-split ones (``split``, all of
    them FP8 linears) over ``shard`` ranks, the replicated ones (shared experts, MLA's q_a / kv_a)
    whole."""
    if m.fp8 == "none":
        return 0.0
    h = m.hidden_size
    layers = range(m.num_layers) if layers is None else layers
    f = family(m.arch)
    if f.dsv4:
        return _v4_fp8_params(m, shard, split, layers)
    moe = [i for i in layers if m.num_experts and i >= m.first_k_dense]
    rep = len(moe) * m.num_shared_experts * 3 * h * m.moe_ffn_hidden_size
    if f.mla:
        lat = (h * m.q_lora_rank if m.q_lora_rank else 0) + h * (m.kv_lora_rank + m.qk_rope_head_dim)
        rep += lat * len(layers)
    tp_split = split if split else rollout_sharded_params(m)
    return tp_split / max(1, shard) + rep


def _v4_fp8_params(m: ModelConfig, shard: int, split: int, layers: range) -> float:
    """DeepSeek-V4 / V4.1 (kernels.models.dsv4.FP8_LINEARS): split over ``shard`` ranks when the engine
    is sharded (``split`` > 0): wq_b, wo_a, wo_b and the routed experts; replicated: wq_a, wkv, the
    indexer's wq_b (V4: compressed sparse layers; V4.1: its index sources, the first layer of each run
    of one compress ratio) and the shared experts."""
    h, n, d, ql = m.hidden_size, m.num_attention_heads, m.head_dim, m.q_lora_rank or 0
    exp = 3 * h * m.moe_ffn_hidden_size
    split_p = rep = 0
    shared_index = family(m.arch).shared_compressors  # V4.1: one indexer per run of one ratio
    for i in layers:
        split_p += ql * n * d + n * d * m.o_lora_rank + m.o_groups * m.o_lora_rank * h + m.num_experts * exp
        rep += h * ql + h * d + m.num_shared_experts * exp
        r = m.compress_ratios[i] if i < len(m.compress_ratios) else 0
        index = r == 4 if not shared_index else (r != 0 and (i == 0 or m.compress_ratios[i - 1] != r))
        if index:
            rep += ql * m.index_n_heads * m.index_head_dim
    return (split_p / max(1, shard) if split else split_p) + rep


def _has_dense_layers(m: ModelConfig) -> bool:
    return m.num_experts == 0 or m.first_k_dense > 0


def _sharded_tp_problems(m: ModelConfig, tp: int) -> list[tuple[str, str]]:
    """(recipe key, what fails) of the aligned TP-sharded class at tensor-parallel size tp, as its
    ``_tp_config`` checks them (vllm_bridge/aligned/_model.py)."""
    from kernels import ROW_PARALLEL_K_SEGMENTS as seg

    if tp == 1:
        return []
    out = []
    if seg % tp:
        out.append(("rollout.tensor_parallel_size", f"rollout.tensor_parallel_size={tp} does not divide the "
                    f"{seg} row-parallel K segments (kernels.ROW_PARALLEL_K_SEGMENTS)"))
    mla = family(m.arch).mla
    if family(m.arch).dsv4:  # RZAlignedDeepseekV4ForCausalLM._tp_config
        for key, n in {"model.num_attention_heads": m.num_attention_heads, "model.num_experts": m.num_experts}.items():
            if n % tp:
                out.append((key, f"{key}={n} is not divisible by rollout.tensor_parallel_size={tp}"))
        k = m.o_groups * m.o_lora_rank  # wo_b's K; the KV head, compressors and indexer are replicated
        if k % seg:
            out.append(("model.o_lora_rank", f"model.o_groups * model.o_lora_rank={k} (the row-parallel K of "
                        f"wo_b) is not divisible by the {seg} row-parallel K segments"))
        if m.fp8 != "none":  # kernels.models.dsv4.fp8_problems: wo_b row-parallel FP8, wq_b column shards
            B = 128
            if k % (seg * B):
                out.append(("model.o_lora_rank", f"model.o_groups * model.o_lora_rank={k} (the row-parallel FP8 K "
                            f"of wo_b) is not a multiple of {seg} x {B} = {seg * B}"))
            rows = m.num_attention_heads * m.head_dim
            if (rows // tp) % B:
                out.append(("model.num_attention_heads", f"model.num_attention_heads * model.head_dim={rows} gives "
                            f"{rows // tp} FP8 wq_b rows per rank, not a multiple of the {B}-row weight block"))
        return out
    counts = {"model.num_attention_heads": m.num_attention_heads}
    if not mla:  # MLA expands K/V per query head: only the query heads are split
        counts["model.num_kv_heads"] = m.num_kv_heads
    if m.num_experts:
        counts["model.num_experts"] = m.num_experts
    if _has_dense_layers(m):
        counts["model.dense_ffn_hidden_size"] = m.dense_ffn_hidden_size
    for key, n in counts.items():
        if n % tp:
            out.append((key, f"{key}={n} is not divisible by rollout.tensor_parallel_size={tp}"))
    vdim = m.v_head_dim if mla else m.head_dim
    ks = {f"model.num_attention_heads * {'v_head_dim' if mla else 'head_dim'}":
          m.num_attention_heads * vdim}
    if _has_dense_layers(m):
        ks["model.dense_ffn_hidden_size"] = m.dense_ffn_hidden_size
    for key, k in ks.items():
        if k % seg:
            out.append((key, f"{key}={k} (a row-parallel K) is not divisible by the {seg} row-parallel K segments"))
    out += _fp8_tp_problems(m, tp)
    return out


def rollout_tp_errors(recipe: Recipe) -> list[str]:
    """[] when the rollout's aligned vLLM class can run at rollout.tensor_parallel_size (or is not
    TP-sharded, or mode=fast); else one line naming every key that fails (what the class's workers
    would refuse after the warm start) and the fix: the tensor-parallel sizes that work."""
    tp = recipe.rollout.tensor_parallel_size
    if not aligned_tp_sharded(recipe) or tp == 1:
        return []
    from kernels import ROW_PARALLEL_K_SEGMENTS as seg

    m = recipe.model
    problems = _sharded_tp_problems(m, tp)
    if not problems:
        return []
    ok = [t for t in range(1, seg + 1) if seg % t == 0 and not _sharded_tp_problems(m, t)]
    fix = (f"use rollout.tensor_parallel_size={'/'.join(map(str, ok))}" + (" (with rollout.num_engines and "
           "cluster.rollout to match)" if recipe.cluster.rollout.gpus_per_node else "")
           + (", or model.fp8=none" if m.fp8 != "none" else ", or mode=fast"))  # FP8 runs in aligned mode only
    return ["; ".join(what for _, what in problems)
            + f": the aligned {m.arch} vLLM class shards only at a tensor-parallel size dividing {seg} that also "
            f"divides its heads / experts / dense size (bitwise equal to the learner); {fix}"]


def check_rollout_tp(recipe: Recipe) -> None:
    """Raise PlanError (one line) when rollout_tp_errors finds a problem: the check to run before
    anything starts (the warm start, the vLLM workers)."""
    errors = rollout_tp_errors(recipe)
    if errors:
        raise PlanError(f"{recipe.name!r}: " + "; ".join(errors))


# Aligned classes with pipeline stages (vllm_bridge/aligned/_model.py's layer loop; the V4 / K3
# classes have their own and refuse pipeline_parallel_size > 1)
PP_ALIGNED_ARCHS = tuple(f.name for f in FAMILIES if f.aligned_pp)


def pp_stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) of each pipeline stage's decoder layers, as vLLM partitions them by default
    (vllm.distributed.utils.get_pp_indices without VLLM_PP_LAYER_PARTITION): num_layers // pp each,
    the remainder one more each on the stages before the last, from the second-to-last backwards."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append((start, start + n))
        start += n
    return out


def _layer_params(m: ModelConfig, i: int) -> int:
    """Parameters of decoder layer i (attention with its norms, then the MLP / MoE), as count_params."""
    h = m.hidden_size
    if m.num_experts == 0 or i < m.first_k_dense:
        mlp = 3 * h * m.dense_ffn_hidden_size
    else:
        expert = 3 * h * m.moe_ffn_hidden_size
        mlp = (m.num_experts + m.num_shared_experts) * expert + m.num_experts * h
    return _attention_params(m, i) + mlp


def stage_params(m: ModelConfig, start: int, end: int, pp: int) -> int:
    """Parameters pipeline stage [start, end) holds: its layers, the embeddings on the first stage
    (and on the last when lm_head is tied to them), the final norm and lm_head on the last."""
    c = count_params(m)
    first, last = start == 0, end == m.num_layers
    n = sum(_layer_params(m, i) for i in range(start, end))
    if first or (last and m.tie_word_embeddings):
        n += c.embedding
    if last:
        n += c.output + c.final_norm
    return n


def rollout_sharded_params(m: ModelConfig, layers: range | None = None) -> int:
    """Parameters an aligned TP-sharded engine splits over its workers (the rest is replicated):
    Qwen3 q/k/v/o_proj; DeepSeek-V3 q_b_proj (q_proj) / kv_b_proj / o_proj; DeepSeek-V4 wq_b /
    attn_sink / wo_a / wo_b; dense MLPs, routed experts. ``layers``: only those decoder layers
    (one pipeline stage's); all by default."""
    h, n = m.hidden_size, m.num_attention_heads
    f = family(m.arch)
    if f.gqa:
        attn = h * n * m.head_dim + 2 * h * m.num_kv_heads * m.head_dim + n * m.head_dim * h
    elif f.dsv4:  # wq_b, attn_sink, wo_a (by rows), wo_b (by K)
        attn = m.q_lora_rank * n * m.head_dim + n + n * m.head_dim * m.o_lora_rank + m.o_groups * m.o_lora_rank * h
    else:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        attn = ((h if m.q_lora_rank is None else m.q_lora_rank) * n * qk
                + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim) + n * m.v_head_dim * h)
    s = 0
    for i in (range(m.num_layers) if layers is None else layers):
        s += attn
        if m.num_experts == 0 or i < m.first_k_dense:
            s += 3 * h * m.dense_ffn_hidden_size
        else:
            s += m.num_experts * 3 * h * m.moe_ffn_hidden_size
    return s


def make_plan(recipe: Recipe) -> Plan:
    """The memory plan of the recipe on its cluster section; PlanError lists what cannot work."""
    m, p, r, c = recipe.model, recipe.parallel, recipe.rollout, recipe.cluster
    L, Lg, plan_cfg = c.learner, c.rollout, c.plan  # the learner's and the rollout's node groups
    errors: list[str] = []
    notes: list[str] = []
    params = count_params(m)

    # ---- learner layout vs nodes and GPUs
    world = p.tp * p.pp * p.dp
    if m.num_experts == 0 and (p.ep > 1 or p.etp > 1):
        errors.append(f"parallel.ep={p.ep}, etp={p.etp} on a dense model (model.num_experts=0): set both to 1")
    if m.num_layers % p.pp:
        errors.append(f"parallel.pp={p.pp} must divide model.num_layers={m.num_layers}")
    if (p.tp * p.dp) % (p.ep * p.etp):
        errors.append(f"ep*etp={p.ep * p.etp} must divide tp*dp={p.tp * p.dp}")
    if L.gpus_per_node > 0:
        gpus = L.nodes * L.gpus_per_node
        ranks_per_node = L.gpus_per_node
        if world != gpus:
            errors.append(
                f"learner layout tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {world} ranks, but cluster.learner has "
                f"{L.nodes} nodes x {L.gpus_per_node} GPUs = {gpus}: make them equal (one rank per GPU)"
            )
        if p.tp > L.gpus_per_node or L.gpus_per_node % p.tp:
            errors.append(
                f"parallel.tp={p.tp} must divide cluster.learner.gpus_per_node={L.gpus_per_node}: tensor "
                "parallelism stays inside a node (NVLink)"
            )
    else:
        gpus = 0
        ranks_per_node = L.procs_per_node or max(1, world // L.nodes)
        if L.nodes * ranks_per_node != world:
            errors.append(
                f"learner layout tp*pp*dp = {world} ranks cannot be spread as {ranks_per_node} per node over "
                f"cluster.learner.nodes={L.nodes}: make nodes * procs_per_node = {world}"
            )

    # ---- rollout layout
    etp, epp = r.tensor_parallel_size, r.pipeline_parallel_size
    width = etp * epp  # GPUs per engine
    if m.num_attention_heads % etp:
        errors.append(f"rollout.tensor_parallel_size={etp} must divide model.num_attention_heads={m.num_attention_heads}")
    if epp > m.num_layers:
        errors.append(f"rollout.pipeline_parallel_size={epp} exceeds model.num_layers={m.num_layers}: every "
                      "pipeline stage needs a decoder layer; lower rollout.pipeline_parallel_size")
    if epp > 1 and recipe.mode == "aligned" and not family(m.arch).aligned_pp:
        errors.append(f"rollout.pipeline_parallel_size={epp}: the aligned {m.arch} vLLM class has no pipeline "
                      f"stages (pipeline-parallel aligned classes: {', '.join(PP_ALIGNED_ARCHS)}); set "
                      "rollout.pipeline_parallel_size=1 or mode=fast")
    if Lg.gpus_per_node > 0:
        rgpus = Lg.nodes * Lg.gpus_per_node
        if r.num_engines * width != rgpus:
            what = f"tensor_parallel_size{' * pipeline_parallel_size' if epp > 1 else ''}"
            n = f"{etp}{f' * {epp}' if epp > 1 else ''}"
            errors.append(
                f"rollout.num_engines * {what} = {r.num_engines} * {n} = {r.num_engines * width} GPUs, "
                f"but cluster.rollout has {Lg.nodes} nodes x {Lg.gpus_per_node} GPUs = {rgpus}: make them equal"
            )
        if epp > 1 and Lg.gpus_per_node % etp:
            errors.append(
                f"rollout.tensor_parallel_size={etp} must divide cluster.rollout.gpus_per_node={Lg.gpus_per_node} "
                f"with rollout.pipeline_parallel_size={epp}: tensor parallelism stays inside a node, the pipeline "
                "stages span nodes"
            )
        elif not (Lg.gpus_per_node % width == 0 or width % Lg.gpus_per_node == 0):
            key = "tensor_parallel_size" + (" * pipeline_parallel_size" if epp > 1 else "")
            errors.append(
                f"rollout.{key}={width} must divide or be a multiple of cluster.rollout.gpus_per_node="
                f"{Lg.gpus_per_node} (an engine fills whole nodes or shares one)"
            )
    else:
        rgpus = 0

    # ---- learner memory per GPU (per rank on CPU)
    seq = plan_cfg.seq_len or m.max_position_embeddings
    b = _bytes(m.dtype)
    n_ne = params.non_expert / (p.tp * p.pp)
    n_e = params.routed_experts / (p.ep * p.etp * p.pp)
    opt_b = 12 if b == 2 else 8
    if p.distributed_optimizer:  # ZeRO-1: optimizer state sharded over (expert-)data-parallel ranks
        edp = max(1, (p.tp * p.dp) // (p.ep * p.etp))
        opt = (n_ne * opt_b / p.dp + n_e * opt_b / edp)
    else:
        opt = (n_ne + n_e) * opt_b
    T = recipe.algo.micro_batch_size * seq
    moe_layers = 0 if m.num_experts == 0 else m.num_layers - m.first_k_dense
    a_max = max(_act_elements_per_token(m, True) if moe_layers else 0.0,
                _act_elements_per_token(m, False) if moe_layers < m.num_layers else 0.0)
    a_sum = (moe_layers * (_act_elements_per_token(m, True) if moe_layers else 0.0)
             + (m.num_layers - moe_layers) * _act_elements_per_token(m, False))
    if plan_cfg.recompute == "full":
        act = (m.num_layers * T * m.hidden_size * b + T * a_max * b) / p.tp
    else:
        act = T * a_sum * b / p.tp
    learner_mem = {
        "weights": (n_ne + n_e) * b / GiB,
        "gradients": (n_ne + n_e) * 4 / GiB,
        "optimizer": opt / GiB,
        "activations": act / GiB,
        "logits": T * m.vocab_size / p.tp * 4 * 2 / GiB,
    }
    if L.gpus_per_node > 0:
        learner_mem["overhead"] = plan_cfg.overhead_gb
        total = sum(learner_mem.values())
        if total > L.gpu_memory_gb:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in learner_mem.items())
            errors.append(
                f"learner needs {total:.1f} GiB per GPU ({parts}) but cluster.learner.gpu_memory_gb="
                f"{L.gpu_memory_gb:g}: raise parallel.ep/tp/dp with more GPUs, lower algo.micro_batch_size or "
                "plan.seq_len, or set cluster.plan.recompute=full / parallel.distributed_optimizer=true"
            )

    # ---- rollout memory per GPU
    # Stock vLLM (fast) shards everything over the engine's TP workers. The aligned classes
    # (vllm_bridge.aligned) with TP_SHARDED (Qwen3-MoE, DeepSeek-V3, blockwise FP8 too; DeepSeek-V4)
    # shard attention heads (and the KV cache, but V4's one KV head's payload cache), dense MLPs and
    # routed experts, and replicate embeddings, lm_head, norms, router, shared experts and the latent
    # projections; Qwen2 holds the whole model on every worker. FP8: the e4m3 copies come on top.
    # Pipeline parallelism (rollout.pipeline_parallel_size): each stage's GPUs hold that stage's layers
    # (+ embeddings on the first, final norm and lm_head on the last) and their KV cache; the plan
    # is the stage that needs the most memory.
    sharded_aligned = aligned_tp_sharded(recipe)
    stages = pp_stage_layers(m.num_layers, epp) if epp <= m.num_layers else [(0, m.num_layers)]
    if recipe.mode == "fast":
        shard = etp
    elif sharded_aligned:
        errors.extend(rollout_tp_errors(recipe))
        shard = etp
    else:
        shard = 1
        if etp > 1:
            why = m.arch
            notes.append(f"mode=aligned: the aligned {m.arch} vLLM class keeps "
                         f"the whole model and KV cache on each of the {etp} tensor-parallel workers ({why} is not "
                         "sharded yet), so rollout.tensor_parallel_size > 1 adds no memory; prefer 1")
    per_tok, per_seq = _kv_per_token_and_seq(m, shard, aligned=recipe.mode == "aligned")
    kv = r.kv_cache_gb * GiB
    rollout_mem, seq_bytes, stage_desc = {}, 0.0, []
    for start, end in stages:  # the stage with the most weights sets the plan; KV: the most layers
        total = stage_params(m, start, end, epp)
        if recipe.mode == "fast":
            split = total
        else:
            split = rollout_sharded_params(m, range(start, end)) if sharded_aligned else 0
        mem = {"weights": ((total - split) + split / shard) * b / GiB, "kv_cache": r.kv_cache_gb}
        if m.fp8 != "none" and recipe.mode == "aligned":  # e4m3 copies (1 byte) + one fp32 scale per 128x128
            mem["fp8_weights"] = (rollout_fp8_cache_params(m, shard, split, range(start, end))
                                  * (1 + 4 / 128 ** 2) / GiB)
        if sum(mem.values()) > sum(rollout_mem.values()):
            rollout_mem = mem
        frac = (end - start) / m.num_layers
        seq_bytes = max(seq_bytes, (seq * per_tok + per_seq) * frac)
        stage_desc.append(f"layers {start}-{end - 1}: weights {mem['weights']:.1f} GiB")
    if epp > 1:
        notes.append(f"rollout pipeline stages (tensor_parallel_size={etp} each, per GPU): " + "; ".join(stage_desc))
    seqs_fit = kv / seq_bytes if seq_bytes else float("inf")
    wanted = min(r.max_num_seqs, math.ceil(r.prompts_per_step * r.samples_per_prompt / max(1, r.num_engines)))
    if seqs_fit < 1:
        errors.append(
            f"rollout.kv_cache_gb={r.kv_cache_gb:g} holds {seqs_fit:.2f} sequences of {seq} tokens "
            f"({seq_bytes / GiB:.2f} GiB each per GPU): raise rollout.kv_cache_gb or lower model.max_position_embeddings"
        )
    elif seqs_fit < wanted:
        notes.append(f"rollout KV cache holds {int(seqs_fit)} full-length sequences per engine; "
                     f"{wanted} are submitted at once, so longer batches queue inside the engine")
    if Lg.gpus_per_node > 0:
        rollout_mem["overhead"] = plan_cfg.overhead_gb
        total = sum(rollout_mem.values())
        if total > Lg.gpu_memory_gb:
            errors.append(
                f"rollout engine needs {total:.1f} GiB per GPU (weights {rollout_mem['weights']:.1f} over "
                f"tensor_parallel_size={etp}" + (f" x pipeline_parallel_size={epp}" if epp > 1 else "") + f", KV cache {r.kv_cache_gb:g}, overhead {plan_cfg.overhead_gb:g}) but "
                f"cluster.rollout.gpu_memory_gb={Lg.gpu_memory_gb:g}: "
                + _rollout_fit_fix(recipe, shard, sharded_aligned, rollout_mem['weights'])
            )

    if errors:
        raise PlanError(f"layout of {recipe.name!r} cannot run on its cluster section:\n  - " + "\n  - ".join(errors))
    return Plan(
        recipe_name=recipe.name, params=params, learner_ranks=world, learner_ranks_per_node=ranks_per_node,
        learner_gpus=gpus, rollout_gpus=rgpus, seq_len=seq, learner_mem=learner_mem,
        learner_budget=L.gpu_memory_gb if L.gpus_per_node else None, rollout_mem=rollout_mem,
        rollout_budget=Lg.gpu_memory_gb if Lg.gpus_per_node else None, rollout_seqs_fit=seqs_fit,
        rollout_seqs_wanted=wanted, notes=notes,
    )


def _rollout_fit_fix(recipe: Recipe, shard: int, sharded_aligned: bool, weights_gb: float) -> str:
    m, etp = recipe.model, recipe.rollout.tensor_parallel_size
    lower_kv = ("lower rollout.kv_cache_gb" if weights_gb + recipe.cluster.plan.overhead_gb
                < recipe.cluster.rollout.gpu_memory_gb else "the weights and overhead alone exceed it")
    if recipe.mode == "fast":
        return "raise rollout.tensor_parallel_size or lower rollout.kv_cache_gb"
    if sharded_aligned:
        from kernels import ROW_PARALLEL_K_SEGMENTS as seg

        more = [t for t in range(etp + 1, seg + 1) if seg % t == 0 and not _sharded_tp_problems(m, t)]
        if more:
            return f"raise rollout.tensor_parallel_size (to {'/'.join(map(str, more))}) or lower rollout.kv_cache_gb"
        if family(m.arch).aligned_pp:
            return (f"the aligned {m.arch} vLLM class shards over at most {etp} tensor-parallel workers here "
                    f"(tensor-parallel sizes dividing the {seg} row-parallel K segments and the model's heads / "
                    f"experts): {lower_kv}; raise rollout.pipeline_parallel_size (now "
                    f"{recipe.rollout.pipeline_parallel_size}: each stage holds only its layers and their KV cache), "
                    "use mode=fast, or GPUs with more memory")
        return (f"the aligned {m.arch} vLLM class shards over at most {etp} workers here (tensor-parallel sizes "
                f"dividing the {seg} row-parallel K segments and the model's heads / experts), replicating "
                f"embeddings, lm_head, norms, router and shared experts: {lower_kv}; use mode=fast (stock vLLM "
                "classes, sharded over any size) or GPUs with more memory")
    return (f"in mode=aligned every tensor-parallel worker holds the whole {m.arch} model (that aligned "
            f"vLLM class is not sharded yet): {lower_kv}; use mode=fast (stock vLLM classes, sharded)")


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def format_plan(plan: Plan, recipe: Recipe) -> str:
    m, p, r, c = recipe.model, recipe.parallel, recipe.rollout, recipe.cluster
    pc = plan.params
    kind = "dense" if m.num_experts == 0 else f"{m.num_experts} experts top-{m.top_k}" + (
        f" + {m.num_shared_experts} shared" if m.num_shared_experts else "")
    where = lambda g: f"{g.nodes} node(s) x {g.gpus_per_node} GPU(s)" if g.gpus_per_node else f"{g.nodes} CPU node(s)"  # noqa: E731
    lines = [
        f"memory plan: {recipe.name} ({m.arch}, {kind}, {m.dtype})",
        f"  parameters: total {_b(pc.total)}, active per token {_b(pc.active)} "
        f"(routed experts {_b(pc.routed_experts)}, non-expert {_b(pc.non_expert)})",
        f"  learner: {where(c.learner)}, {plan.learner_ranks} ranks ({plan.learner_ranks_per_node} per node), "
        f"tp={p.tp} pp={p.pp} dp={p.dp} ep={p.ep} etp={p.etp}; micro batch {recipe.algo.micro_batch_size} x "
        f"{plan.seq_len} tokens, recompute={c.plan.recompute}, distributed optimizer={recipe.parallel.distributed_optimizer}",
    ]
    unit = "GiB per GPU" if plan.learner_budget else "GiB per rank (CPU: not checked)"
    lines.append("    " + ", ".join(f"{k} {v:.2f}" for k, v in plan.learner_mem.items())
                 + f" = {plan.learner_total:.2f} {unit}"
                 + (f" of {plan.learner_budget:g} ({100 * plan.learner_total / plan.learner_budget:.0f}%)"
                    if plan.learner_budget else ""))
    lines.append(f"  rollout: {where(c.rollout)}, {r.num_engines} engine(s) x tensor_parallel_size="
                 f"{r.tensor_parallel_size}" + (f" x pipeline_parallel_size={r.pipeline_parallel_size} "
                                                f"({r.tensor_parallel_size * r.pipeline_parallel_size} GPUs per "
                                                "engine; the largest stage per GPU)"
                                                if r.pipeline_parallel_size > 1 else ""))
    unit = "GiB per GPU" if plan.rollout_budget else "GiB per engine (CPU: not checked)"
    lines.append("    " + ", ".join(f"{k} {v:.2f}" for k, v in plan.rollout_mem.items())
                 + f" = {plan.rollout_total:.2f} {unit}"
                 + (f" of {plan.rollout_budget:g} ({100 * plan.rollout_total / plan.rollout_budget:.0f}%)"
                    if plan.rollout_budget else ""))
    fit = "unbounded" if math.isinf(plan.rollout_seqs_fit) else f"{math.floor(plan.rollout_seqs_fit)}"
    lines.append(f"    KV cache holds {fit} sequences of {plan.seq_len} tokens per engine "
                 f"({plan.rollout_seqs_wanted} submitted at once)")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
