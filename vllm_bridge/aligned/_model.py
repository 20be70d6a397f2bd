"""Shared vLLM model class for the aligned architectures (subclassed per architecture).

The module tree mirrors the Hugging Face checkpoint names exactly (``model.layers.3.mlp.experts.5.
gate_proj.weight`` is a parameter of that name), every weight a plain unpacked Parameter in the model
dtype, so weights can be read back (``named_parameters``), loaded with vLLM's
``default_weight_loader`` at start-up and reloaded in place by a weight sync: the worker calls
``load_weights`` below directly (``RZ_LOADS_IN_PLACE``; worker_ext.rz_commit_weights), which copies
each tensor into its parameter's storage, so the captured CUDA graphs keep their addresses.

All numerics are the per-layer functions of :mod:`kernels.models.qwen3_dsv3` (the same code the
full-sequence reference runs); only the attention core differs: q/k/v go through a vLLM
``Attention`` layer with the aligned backend (:mod:`.attention_backend`), which writes K/V into the
paged cache and runs ``kernels.attention`` per sequence.

Tensor parallelism (classes with ``TP_SHARDED = True``, today Qwen3-MoE and DeepSeek-V3, when vLLM's
tensor_parallel_size > 1, blockwise FP8 included): each rank holds a shard and every logprob stays
bitwise the TP=1 one. DeepSeek-V4 / V4.1 (deepseek_v4.py, its own base class) shard too, with the
same row-parallel contract and expert split (that module's docstring). Qwen2 is replicated on every
TP worker (each computes the whole model: also bitwise TP=1, no memory saved).
Blockwise FP8 (docs/tp.md "FP8"): the FP8 weight cache quantises each rank's shard (its 128x128 blocks
are the full tensor's: ``_tp_config`` requires rows per rank of column shards and the K per rank of
row-parallel shards to be multiples of 128); o_proj and dense down_proj use the row-parallel FP8 form
(8 per-segment fp32 chains, ``kernels.dispatch.fp8_row_partials``, all-gathered and added in
segment order; needs K % 1024 == 0, else refused); routed experts (split whole) and shared experts
(replicated) keep the single chain.
* attention: query heads split in contiguous blocks (each head is computed as at TP=1): Qwen3 q/k/v
  by heads; DeepSeek-V3 MLA: the latent projections (q_a / kv_a_proj_with_mqa and their norms)
  replicated, q_b_proj (q_proj) and kv_b_proj column-parallel by heads (see deepseek_v3.py); the
  vLLM ``Attention`` layer is registered with the local head counts, so the KV cache is sharded;
* o_proj and dense down_proj row-parallel as the learner's ``megatron_rz.learner.aligned_spec``: each rank
  computes the fp32 partials of its ROW_PARALLEL_K_SEGMENTS / tp K segments
  (``kernels.linear_partial``), the partials are all-gathered over the TP group and added in rank
  (= segment) order, rounded once: bitwise ``kernels.linear(x, W, k_segments=ROW_PARALLEL_K_SEGMENTS)``;
  dense gate/up column-parallel;
* routed experts split over the ranks (expert parallel, rank r holds experts r*E/tp ..); the router
  is replicated; each rank computes its experts' (token, slot) rows, the ``[T, k, H]`` slot outputs
  are all-reduced (one non-zero term per element: exact), ``kernels.moe_combine`` runs on every rank;
  DeepSeek-V3's shared experts are replicated (computed whole on every rank, added by moe_combine);
* embeddings, norms, router gates (and DeepSeek's e_score_correction_bias) and lm_head replicated
  (the logits need no gather).
``_tp_config`` checks divisibility (tp | ROW_PARALLEL_K_SEGMENTS, the head / expert / dense
intermediate counts by tp, each row-parallel K by ROW_PARALLEL_K_SEGMENTS) and refuses otherwise
with a one-line ValueError naming the key.
``load_weights`` receives full Hugging Face tensors (start-up and the in-place reload of a weight
sync) and narrows them to the rank's shard (``rz_shards``); other ranks' experts are skipped. A
tensor already of the shard's shape (a resharded sync, vllm_bridge/weights/reshard.py, which reads the
layout from ``rz_shards`` through worker_ext.rz_shard_layout) is loaded as it is.
Weight read-back for a sync's checksums (``vllm_bridge.worker_ext.rz_checksums``, rank 0) reads only
the replicated kinds (embeddings, norms, router gate and bias), which are full tensors on every
rank; sharded parameters are not read back (``rz_param_shapes`` reports each worker's shard shapes).

Pipeline parallelism (vLLM pipeline_parallel_size > 1, with or without TP; ``supports_pp``): stage r
holds the decoder layers vLLM's ``get_pp_indices`` gives it (``rz_start`` .. ``rz_end``; the others are
``PPMissingLayer`` placeholders without parameters, so names keep the global layer index); the first
stage holds embed_tokens and embeds, the last holds the final norm and lm_head and computes the
logits; between stages the residual stream travels as ``IntermediateTensors({"hidden_states"})``
(a send / recv of the exact bits). Every op and its inputs are the PP=1 ones, so the logprobs are
bitwise PP=1's. ``load_weights`` (start-up and in-place reload) skips tensors of layers the stage does
not hold (they are not among its parameters); ``RolloutEngine.engine_checksums`` merges every
worker's read-back, so ``verify_sync`` covers every stage.

GPU fast path (CUDA, unsharded, no FP8; ``rz_fast``): the same numbers through fewer, larger
launches and no host synchronisation, so vLLM can replay decode steps as CUDA graphs.
* Packed storage, no copies: a layer's routed experts' gate / up / down weights are *views* into
  three stacked ``[E, ...]`` tensors (``rz_pack``), q/k/v (Qwen3; Qwen2 with its biases as blocks of
  one ``[N_q + N_k + N_v]`` vector) and a dense or shared MLP's gate/up are row blocks of one
  ``[N_q + N_k + N_v, H]`` / ``[2I, H]`` tensor. The HF-named
  parameters stay (loading, in-place reload and read-back work as before) and write straight into
  the packed tensors; ``load_weights`` re-points any parameter that stopped aliasing its pack.
* One GEMM for q/k/v and one for gate/up: ``kernels.linear`` with one K segment computes every
  output element with the same K chain whatever N is, so the fused GEMM has the separate GEMMs' bits.
* Routed experts through the grouped Triton MoE (``kernels.moe_experts``: device-side work list,
  bitwise the per-expert reference) instead of a Python loop over ``torch.unique`` ids.
* RoPE frequencies cached on the device (``rz_inv_freq``; the same float64 values). Without q/k
  norm (Qwen2) q and k, adjacent blocks of the packed q/k/v output, are rotated in one launch.
* The residual carried across layers (``ref.layer_forward_fast``): each layer's last add ``h + y``
  is done by the next layer's input norm launch (``kernels.add_rms_norm``), o_proj's and a dense
  down_proj's row-parallel segment partials (split-mode GEMM at decode sizes,
  ``kernels.linear_unreduced``) are summed inside the add + norm that follows them, and the stage's
  last pending add is finished by the final norm (last stage, one launch) or before the residual
  is sent on (``ref.carried_residual``: a pipeline stage boundary carries the whole residual ``h``).
  Every value is the one ``ref.layer_forward`` computes; MoE outputs (the grouped GEMM's own
  reduction) arrive finished and take the plain add + norm.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

import kernels
from kernels import settings as kernel_settings

from vllm_bridge.vllm_compat import aligned_attention_backend

from kernels.models import qwen3_dsv3 as ref
from kernels.families import family


def fp8_tp_problems(c: ref.ArchConfig, tp: int) -> list[tuple[str, str]]:
    """(config key, what fails) that keep a blockwise-FP8 model from sharding over tp ranks
    bitwise (docs/tp.md "FP8"): the row-parallel K (o_proj; a dense layer's down_proj) must be a
    multiple of 8 x 128 (8 segments of whole 128-wide blocks), every column shard's rows per rank
    (q / k / v or MLA's q_b / kv_b, a dense layer's gate / up) a multiple of the 128-row block."""
    if tp == 1:
        return []
    from kernels.fp8 import BLOCK as B

    S = kernels.ROW_PARALLEL_K_SEGMENTS
    vdim = "v_head_dim" if c.mla else "head_dim"
    rows = {f"num_attention_heads * {vdim}": c.num_heads * c.attn_v_dim}
    dense = not all(c.moe_layers)
    if dense:
        rows["intermediate_size"] = c.intermediate_size
    out = [(k, f"= {K} (a row-parallel K) is not a multiple of {S} x {B} = {S * B}")
           for k, K in rows.items() if K % (S * B)]
    if c.mla:
        cols = {"num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)": c.num_heads * c.qk_head_dim,
                "num_attention_heads * (qk_nope_head_dim + v_head_dim)": c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)}
    else:
        cols = {"num_attention_heads * head_dim": c.num_heads * c.head_dim,
                "num_key_value_heads * head_dim": c.num_kv_heads * c.head_dim}
    if dense:
        cols["intermediate_size"] = c.intermediate_size
    out += [(k, f"= {n} gives {n // tp} rows per rank, not a multiple of the {B}-row weight block")
            for k, n in cols.items() if (n // tp) % B]
    return out


def tp_info() -> tuple[int, int]:
    """(world size, rank) of vLLM's tensor-parallel group; (1, 0) outside a vLLM worker."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def pp_info() -> tuple[int, int]:
    """(world size, rank) of vLLM's pipeline-parallel group; (1, 0) outside a vLLM worker."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    g = ps.get_pp_group()
    return g.world_size, g.rank_in_group


def pp_layer_range(num_layers: int, pp: int, rank: int) -> tuple[int, int]:
    """[start, end) of the decoder layers pipeline stage ``rank`` of ``pp`` holds: vLLM's own
    partition (``vllm.distributed.utils.get_pp_indices``, VLLM_PP_LAYER_PARTITION honoured), so the
    stages agree with vLLM's KV-cache and scheduler bookkeeping. A stage without a layer is refused."""
    if pp == 1:
        return 0, num_layers
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(num_layers, rank, pp)
    if end <= start:
        raise ValueError(f"pipeline_parallel_size={pp} leaves stage {rank} without a decoder layer "
                         f"(num_hidden_layers={num_layers}): use a pipeline_parallel_size <= {num_layers}")
    return start, end


def tp_all_reduce(y: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import get_tp_group

    return get_tp_group().all_reduce(y)


class Params(nn.Module):
    """A leaf holding named parameters (e.g. ``weight``), no forward of its own."""

    def __init__(self, dtype: torch.dtype, **shapes) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False))


def _mlp(dtype, hidden: int, inter: int) -> nn.Module:
    m = nn.Module()
    m.gate_proj = Params(dtype, weight=(inter, hidden))
    m.up_proj = Params(dtype, weight=(inter, hidden))
    m.down_proj = Params(dtype, weight=(hidden, inter))
    return m


def _view_param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _Views(nn.Module):
    """A leaf whose ``weight`` (and ``bias``, when given) is a view into a packed tensor (``Params``
    otherwise)."""

    def __init__(self, view: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.register_parameter("weight", _view_param(view))
        if bias is not None:
            self.register_parameter("bias", _view_param(bias))


def packed_rows(dtype, hidden: int, rows: dict, *, bias: bool = False):
    """One ``[sum(rows), hidden]`` tensor and a ``_Views`` leaf per named row block; with ``bias``
    also one ``[sum(rows)]`` tensor whose blocks are the leaves' ``bias`` (returned third)."""
    pack = torch.empty(sum(rows.values()), hidden, dtype=dtype)
    bpack = torch.empty(sum(rows.values()), dtype=dtype) if bias else None
    leaves, start = {}, 0
    for name, n in rows.items():
        leaves[name] = _Views(pack[start:start + n], None if bpack is None else bpack[start:start + n])
        start += n
    return (pack, leaves, bpack) if bias else (pack, leaves)


def _packed_mlp(dtype, hidden: int, inter: int) -> nn.Module:
    """A gate/up/down MLP whose gate and up are the two row blocks of ``m.rz_gate_up [2I, H]``."""
    m = nn.Module()
    pack, leaves = packed_rows(dtype, hidden, {"gate_proj": inter, "up_proj": inter})
    m.gate_proj, m.up_proj = leaves["gate_proj"], leaves["up_proj"]
    m.down_proj = Params(dtype, weight=(hidden, inter))
    m.rz_packs = {"gate_up": (pack, ("gate_proj", "up_proj"))}
    return m


def _packed_experts(dtype, n: int, hidden: int, inter: int) -> tuple[nn.ModuleList, dict]:
    """``n`` expert MLPs whose weights are views into stacked ``[n, I, H]`` / ``[n, H, I]`` tensors."""
    stacks = {"gate_proj": torch.empty(n, inter, hidden, dtype=dtype),
              "up_proj": torch.empty(n, inter, hidden, dtype=dtype),
              "down_proj": torch.empty(n, hidden, inter, dtype=dtype)}
    experts = nn.ModuleList()
    for e in range(n):
        m = nn.Module()
        for name, st in stacks.items():
            setattr(m, name, _Views(st[e]))
        experts.append(m)
    return experts, stacks


class LogitsScale(nn.Module):
    """Stands where vLLM models keep their LogitsProcessor: only its ``scale`` is honoured
    (``vllm_bridge.worker_ext.rz_set_logit_scale`` sets it)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = 1.0
        self.soft_cap = None


class RZAlignedForCausalLM(nn.Module):
    """Base class; subclasses set ``ARCH`` (the family's recipe name, whose registry entry in
    kernels.families names the subclass) and build their attention modules."""

    # load_weights copies each tensor into its parameter in place and nothing is processed after
    # loading: the worker commits a sync through it directly (worker_ext.rz_commit_weights)
    RZ_LOADS_IN_PLACE = True

    ARCH = ""
    # vLLM's SupportsPP interface (module docstring "Pipeline parallelism"): forward takes and
    # returns IntermediateTensors between stages, make_empty_intermediate_tensors below.
    supports_pp = True
    # True: shard over vLLM's tensor-parallel group (see the module docstring); False: every TP
    # worker holds and computes the whole model (bitwise the TP=1 result, no memory saved).
    TP_SHARDED = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.config = hf
        self.c = c = ref.arch_config(hf)
        if c.family is not family(self.ARCH):  # a checkpoint of another family (kernels.families)
            raise ValueError(f"{type(self).__name__} needs a {self.ARCH} config, got {c.arch}")
        self.cache_config = vllm_config.cache_config
        dtype = vllm_config.model_config.dtype
        self.rz_dtype = dtype
        self.rz_tp, self.rz_rank = tp_info()
        # pipeline parallelism: this stage's decoder layers [rz_start, rz_end); the others are
        # PPMissingLayer placeholders (no parameters), so parameter names keep the global layer index
        self.rz_pp, self.rz_pp_rank = pp_info()
        self.rz_start, self.rz_end = pp_layer_range(c.num_layers, self.rz_pp, self.rz_pp_rank)
        self.rz_first = self.rz_pp_rank == 0
        self.rz_last = self.rz_pp_rank == self.rz_pp - 1
        # Blockwise FP8 shards too (docs/tp.md "FP8": row-parallel layers use 8 per-segment chains)
        self.rz_sharded = self.TP_SHARDED and self.rz_tp > 1
        # full HF parameter name -> (dim, start, length): the slice of the full tensor this rank holds
        self.rz_shards: dict[str, tuple[int, int, int]] = {}
        # rz_c: the config the per-layer functions see (the rank's local head counts when sharded)
        self.rz_c = self._tp_config(c) if self.rz_sharded else c
        self.rz_ep = None
        # GPU fast path (module docstring): CUDA, unsharded, no FP8
        self.rz_fast = (vllm_config.device_config.device_type == "cuda" and not self.rz_sharded
                        and c.fp8 == "none")
        tp, r = self.rz_tp, self.rz_rank
        if self.rz_sharded and c.num_experts:
            n = c.num_experts // tp
            self.rz_ep = ref.ExpertShard(local=range(r * n, (r + 1) * n), reduce=tp_all_reduce)
        H = c.hidden_size
        from vllm.model_executor.models.utils import PPMissingLayer

        self.model = nn.Module()
        # the first stage embeds; the last also needs the table when lm_head is tied to it
        if self.rz_first or (self.rz_last and c.tie_word_embeddings):
            self.model.embed_tokens = Params(dtype, weight=(c.vocab_size, H))
        else:
            self.model.embed_tokens = PPMissingLayer()
        layers = []
        for i in range(c.num_layers):
            if not self.rz_start <= i < self.rz_end:  # another pipeline stage's layer
                layers.append(PPMissingLayer())
                continue
            layer = nn.Module()
            layer.input_layernorm = Params(dtype, weight=(H,))
            layer.post_attention_layernorm = Params(dtype, weight=(H,))
            layer.self_attn = self._build_attention(i, dtype, f"model.layers.{i}.self_attn")
            if c.moe_layers[i]:
                mlp = nn.Module()
                gate = dict(weight=(c.num_experts, H))
                if c.has_expert_bias:
                    gate["e_score_correction_bias"] = (c.num_experts,)
                mlp.gate = Params(dtype, **gate)
                if self.rz_fast:
                    mlp.experts, mlp.rz_stacks = _packed_experts(dtype, c.num_experts, H, c.moe_intermediate_size)
                elif self.rz_ep is None:
                    mlp.experts = nn.ModuleList([_mlp(dtype, H, c.moe_intermediate_size) for _ in range(c.num_experts)])
                else:  # this rank's experts only, under their global ids (the HF names)
                    mlp.experts = nn.ModuleDict({str(e): _mlp(dtype, H, c.moe_intermediate_size) for e in self.rz_ep.local})
                if c.n_shared_experts:  # replicated when sharded
                    make = _packed_mlp if self.rz_fast else _mlp
                    mlp.shared_experts = make(dtype, H, c.moe_intermediate_size * c.n_shared_experts)
                layer.mlp = mlp
            elif self.rz_sharded:  # gate/up column-parallel, down row-parallel
                inter = c.intermediate_size
                layer.mlp = _mlp(dtype, H, inter // tp)
                p = f"model.layers.{i}.mlp."
                self._shard(p + "gate_proj.weight", 0, inter)
                self._shard(p + "up_proj.weight", 0, inter)
                self._shard(p + "down_proj.weight", 1, inter)
            else:
                layer.mlp = (_packed_mlp if self.rz_fast else _mlp)(dtype, H, c.intermediate_size)
            layers.append(layer)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = Params(dtype, weight=(H,)) if self.rz_last else PPMissingLayer()
        if not c.tie_word_embeddings:
            self.lm_head = Params(dtype, weight=(c.vocab_size, H)) if self.rz_last else PPMissingLayer()
        self.logits_processor = LogitsScale(c.vocab_size)
        # Blockwise FP8 (config key qwen3_dsv3.FP8_CONFIG_KEY, e.g. hf_overrides={"rz_fp8": "blockwise"}):
        # the parameters stay the checkpoint's high-precision weights (what a weight sync writes and
        # reads back); their e4m3 copies + 128x128 scales live here, off the module tree (vLLM's
        # layerwise reload rebuilds registered buffers), quantised once per load / in-place update.
        self.rz_fp8 = ref.FP8WeightCache() if c.fp8 == "blockwise" else None
        if self.rz_fast:
            self.rz_inv_freq = kernels.rope_inv_freq(c.rope_dim, c.rope_theta).to(vllm_config.device_config.device)
            from vllm_bridge import vllm_patches

            vllm_patches.use_kernels_log_softmax()  # this worker's sampler (vllm_compat, item 3)

    # ---- tensor parallelism ----------------------------------------------------------------------
    def _tp_config(self, c: ref.ArchConfig) -> ref.ArchConfig:
        """Check that this model can be sharded over tp ranks bitwise; the local-head config."""
        tp = self.rz_tp
        seg = kernels.ROW_PARALLEL_K_SEGMENTS
        name = type(self).__name__
        if seg % tp:
            raise ValueError(
                f"{name}: tensor_parallel_size={tp} does not divide ROW_PARALLEL_K_SEGMENTS={seg}: the "
                "row-parallel o_proj / down_proj could not reproduce the TP=1 (and learner) bits. Use a "
                f"tensor_parallel_size that divides {seg}.")
        # DeepSeek-V3 MLA expands K/V per query head: only the query head count is split
        checks = {"num_attention_heads": c.num_heads, "num_experts": c.num_experts}
        if not c.mla:
            checks["num_key_value_heads"] = c.num_kv_heads
        if not all(c.moe_layers):
            checks["intermediate_size"] = c.intermediate_size
        for what, n in checks.items():
            if n % tp:
                raise ValueError(f"{name}: {what}={n} is not divisible by tensor_parallel_size={tp}")
        # The row-parallel K (o_proj: heads x value head dim; dense down_proj: intermediate_size) must
        # split into ROW_PARALLEL_K_SEGMENTS equal segments, so that each rank's contiguous block
        # (its heads / its intermediate slice) is exactly seg / tp of those segments.
        ks = {"num_attention_heads * " + ("v_head_dim" if c.mla else "head_dim"):
              c.num_heads * c.attn_v_dim}
        if not all(c.moe_layers):
            ks["intermediate_size"] = c.intermediate_size
        for what, k in ks.items():
            if k % seg:
                raise ValueError(
                    f"{name}: {what}={k} (a row-parallel K) is not divisible by ROW_PARALLEL_K_SEGMENTS="
                    f"{seg}: pick a model whose {what} is a multiple of {seg}, or run tensor_parallel_size=1")
        if c.fp8 == "blockwise":
            for what, why in fp8_tp_problems(c, tp):
                raise ValueError(f"{name}: rz_fp8=blockwise at tensor_parallel_size={tp}: {what} {why} "
                                 "(docs/tp.md \"FP8\"); run tensor_parallel_size=1 or rz_fp8=none")
        kv = c.attn_kv_heads  # MLA: K/V per query head
        return dataclasses.replace(c, num_heads=c.num_heads // tp, num_kv_heads=kv // tp)

    def _shard(self, name: str, dim: int, full: int) -> None:
        """Record that parameter ``name`` holds block ``rank`` of ``full`` along ``dim``."""
        n = full // self.rz_tp
        self.rz_shards[name] = (dim, self.rz_rank * n, n)

    def _row_parallel(self, x: torch.Tensor, w, name: str) -> torch.Tensor:
        """Row-parallel linear over the TP group: x [T, K/tp] and ``w(name)`` [N, K/tp] are this rank's K
        block. Bitwise ``kernels.linear(x_full, W_full, k_segments=ROW_PARALLEL_K_SEGMENTS)``
        (the learner's megatron_rz.learner.aligned_spec.row_parallel_linear, vLLM's collectives);
        blockwise FP8: the rank's quantised shard ``w(name + FP8_SUFFIX)`` and its segments' FP8
        chains, bitwise ``kernels.fp8_linear(x_full, *quantised W_full, k_segments=8)`` (the learner's
        aligned_spec.fp8_row_parallel_linear)."""
        from vllm.distributed import get_tp_group

        local = kernels.ROW_PARALLEL_K_SEGMENTS // self.rz_tp
        if self.c.fp8 == "blockwise":
            from kernels.dispatch import fp8_row_partials

            wq, ws = w(name + ref.FP8_SUFFIX)
            mine = fp8_row_partials(x, wq, ws, local)
        else:
            mine = kernels.row_partials(x, w(name), local)
        allp = get_tp_group().all_gather(mine.contiguous(), dim=0)  # rank order
        return kernels.finish_linear(kernels.sum_partials(list(allp.unbind(0))), None, x.dtype)

    def _tp_o_proj(self, w, o: torch.Tensor) -> torch.Tensor:
        return self._row_parallel(o.reshape(o.shape[0], -1), w, "self_attn.o_proj.weight")

    def _tp_mlp(self, w, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.rz_c.moe_layers[i]:
            return ref.mlp_forward(self.rz_c, w, i, x, ep=self.rz_ep)
        g = ref.project(self.rz_c, w, x, "mlp.gate_proj.weight")  # kernels.linear, or FP8 on the shard
        u = ref.project(self.rz_c, w, x, "mlp.up_proj.weight")
        return self._row_parallel(kernels.swiglu(g, u), w, "mlp.down_proj.weight")

    # ---- per-architecture ------------------------------------------------------------------------
    def _build_attention(self, i: int, dtype, prefix: str) -> nn.Module:
        raise NotImplementedError

    def _attend(self, layer: nn.Module, q, k, v) -> torch.Tensor:
        raise NotImplementedError

    def _make_attn(self, prefix: str, num_heads: int, head_size: int, num_kv_heads: int, **extra) -> Attention:
        return Attention(
            num_heads=num_heads,
            head_size=head_size,
            scale=self.c.attn_scale,
            num_kv_heads=num_kv_heads,
            cache_config=self.cache_config,
            quant_config=None,
            prefix=f"{prefix}.attn",
            attn_backend=aligned_attention_backend(),
            **extra,
        )

    # ---- vLLM model interface --------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[input_ids.long()]  # exact gather

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype, device: torch.device):
        """What a pipeline stage receives from the previous one: the residual stream [T, H]."""
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors({"hidden_states": torch.zeros(batch_size, self.c.hidden_size,
                                                                 dtype=dtype, device=device)})

    def _stage_layers(self):
        """(global index, layer) of this pipeline stage's decoder layers."""
        return [(i, self.model.layers[i]) for i in range(self.rz_start, self.rz_end)]

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        **kwargs,
    ):
        c = self.c
        if self.rz_first:
            h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        else:  # the previous stage's residual stream, bit for bit (a plain send / recv)
            h = intermediate_tensors["hidden_states"]
        if self.rz_fast:
            h, y = self._fast_forward(h, positions)  # the stage's residual is h + y, the add not yet done
            if self.rz_last:  # the last add and the final norm: one launch
                return ref.final_norm_carried(c, self.model.norm.weight, h, y)
            h = ref.carried_residual(h, y)  # the next stage receives the whole residual stream
        else:
            h = self._layers_forward(h, positions)
        if not self.rz_last:
            from vllm.sequence import IntermediateTensors

            return IntermediateTensors({"hidden_states": h})
        return ref.final_norm(c, self.model.norm.weight, h)

    def _layers_forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.c
        cos, sin = ref.rope_tables(c, positions)
        for i, layer in self._stage_layers():
            w = layer.get_parameter if self.rz_fp8 is None else self.rz_fp8.getter(layer.get_parameter, f"{i}.")
            attend = lambda q, k, v, layer=layer: self._attend(layer, q, k, v)  # noqa: E731
            if self.rz_sharded:
                h = ref.layer_forward(self.rz_c, w, i, h, cos, sin, attend,
                                      o_proj=lambda o, w=w: self._tp_o_proj(w, o),
                                      mlp=lambda x, w=w, i=i: self._tp_mlp(w, i, x))
            else:
                h = ref.layer_forward(c, w, i, h, cos, sin, attend)
        return h

    # ---- GPU fast path (module docstring) ---------------------------------------------------------
    def _fast_forward(self, h: torch.Tensor, positions: torch.Tensor):
        """This stage's layers through ``ref.layer_forward_fast`` -> ``(h, y)``: the stage's output
        residual is ``h + y`` (y: the last layer's MLP output, its add left to the caller)."""
        c = self.c
        cos, sin = kernels.rope_cos_sin(positions, c.rope_dim, c.rope_theta, inv_freq=self.rz_inv_freq)
        y = None
        for i, layer in self._stage_layers():
            w = layer.get_parameter
            attend = lambda q, k, v, layer=layer: self._attend(layer, q, k, v)  # noqa: E731
            qkv = (lambda x, cos, sin, layer=layer: self._fast_qkv(layer, x, cos, sin)) \
                if "qkv" in (getattr(layer.self_attn, "rz_packs", None) or {}) else None
            h, y = ref.layer_forward_fast(c, w, i, h, y, cos, sin, attend,
                                          mlp=lambda x, layer=layer, i=i: self._fast_mlp(layer, i, x), qkv=qkv)
        return h, y

    def _fast_qkv(self, layer, x, cos, sin):
        """q/k/v from one GEMM over the packed ``[N_q + 2 N_kv, H]`` weight (same bits as three: one K
        segment, each output column its own K chain); Qwen2's biases are one packed ``[N_q + 2 N_kv]``
        vector, added per column in fp32 before the one rounding as in the three biased GEMMs. Then
        Qwen3's q/k RMSNorm (families with ``qk_norm``) and RoPE; without q/k norm (Qwen2) one RoPE
        launch rotates q and k together. q, k and v come back as views of the GEMM output / the
        RoPE output (the CUDA backend reads them through their strides: ``_attend`` copies nothing)."""
        c = self.c
        T, D = x.shape[0], c.head_dim
        a = layer.self_attn
        pack = a.rz_packs["qkv"][0]
        bias = a.rz_packs["qkv_bias"][0] if "qkv_bias" in a.rz_packs else None
        y = kernels.linear(x, pack, bias)
        nq, nk = c.num_heads * D, c.num_kv_heads * D
        v = y[:, nq + nk:].reshape(T, c.num_kv_heads, D)
        if not c.family.qk_norm:
            # Qwen2: q and k are adjacent column blocks of y, rotated as one strided
            # [T, Hq + Hkv, D] view in one launch (RoPE is elementwise: the two calls' bits)
            qk = kernels.apply_rope(y[:, :nq + nk].view(T, c.num_heads + c.num_kv_heads, D), cos, sin, "neox")
            return qk[:, :c.num_heads], qk[:, c.num_heads:], v
        if kernel_settings.qk_one_launch():
            # both norms in one launch over the q and k heads, then one RoPE launch (the four calls' bits)
            qk = kernels.qk_rms_norm(y[:, :nq + nk].view(T, c.num_heads + c.num_kv_heads, D), a.q_norm.weight,
                                     a.k_norm.weight, c.num_heads, c.rms_norm_eps)
            qk = kernels.apply_rope(qk, cos, sin, "neox")
            return qk[:, :c.num_heads], qk[:, c.num_heads:], v
        q = kernels.rms_norm(y[:, :nq].reshape(T, c.num_heads, D), a.q_norm.weight, c.rms_norm_eps)
        k = kernels.rms_norm(y[:, nq:nq + nk].reshape(T, c.num_kv_heads, D), a.k_norm.weight, c.rms_norm_eps)
        return kernels.apply_rope(q, cos, sin, "neox"), kernels.apply_rope(k, cos, sin, "neox"), v

    @staticmethod
    def _fast_dense(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return kernels.expert_mlp_merged(x, m.rz_packs["gate_up"][0], m.down_proj.weight)

    @staticmethod
    def _fast_dense_unreduced(m: nn.Module, x: torch.Tensor):
        """:meth:`_fast_dense` (``kernels.expert_mlp_merged``'s ops) with down_proj through
        ``kernels.linear_unreduced``: its segment sum is left to the next residual add + norm."""
        pack = m.rz_packs["gate_up"][0]
        gu = kernels.linear(x, pack)
        i = pack.shape[0] // 2
        return kernels.linear_unreduced(kernels.swiglu(gu[..., :i], gu[..., i:]), m.down_proj.weight,
                                        k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)

    def _fast_mlp(self, layer, i: int, x: torch.Tensor):
        """The layer's MLP output: a tensor, or for a dense layer a ``kernels.Unreduced`` where the
        down_proj GEMM runs in split mode (``ref.layer_forward_fast`` finishes it in the next add)."""
        c, m = self.c, layer.mlp
        if not c.moe_layers[i]:
            return self._fast_dense_unreduced(m, x)
        st = m.rz_stacks
        if c.family.router == "softmax":  # Qwen3-MoE
            logits = kernels.router_logits(x, m.gate.weight, out_dtype=x.dtype)
            ids, wts = kernels.route(logits, c.top_k, score="softmax", norm_topk_prob=c.norm_topk_prob)
            # the weights rounded to x.dtype as qwen3_dsv3.moe_qwen3 rounds them, in the combine
            # kernel (weights_dtype) instead of a conversion launch per layer
            round_to = x.dtype
            shared = None
        else:
            logits = kernels.router_logits(x, m.gate.weight, out_dtype=torch.float32)
            ids, wts = kernels.route(logits, c.top_k, score="sigmoid", expert_bias=m.gate.e_score_correction_bias,
                                     num_groups=c.n_group, group_topk=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                                     scaling_factor=c.routed_scaling_factor)
            round_to = None  # DeepSeek: fp32 weights
            se = getattr(m, "shared_experts", None)
            shared = None if se is None else [self._fast_dense(se, x)]
        from kernels.triton.moe import moe_experts  # CUDA only; bitwise kernels.moe_experts

        return moe_experts(x, st["gate_proj"], st["up_proj"], st["down_proj"], ids, wts, shared,
                           k_segments_down=kernels.ROW_PARALLEL_K_SEGMENTS, weights_dtype=round_to)

    def _rz_pack_check(self) -> None:
        """Re-point every packed parameter that no longer aliases its pack (a loader that replaced
        its storage): copy it into the pack, then make it a view again. Zero copies otherwise.
        An ``rz_packs`` entry is ``(pack, leaf names)`` for the leaves' ``weight`` or ``(pack, leaf
        names, attribute)`` (Qwen2's packed q/k/v ``bias``)."""
        def fix(p: nn.Parameter, view: torch.Tensor) -> None:
            if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                view.copy_(p.data)
                p.data = view

        for _, layer in self._stage_layers():
            owners = [layer.self_attn, layer.mlp, getattr(layer.mlp, "shared_experts", None)]
            for m in owners:
                for entry in (getattr(m, "rz_packs", None) or {}).values():
                    pack, names = entry[0], entry[1]
                    attr = entry[2] if len(entry) > 2 else "weight"
                    start = 0
                    for n in names:  # row blocks in order
                        p = getattr(getattr(m, n), attr)
                        fix(p, pack[start:start + p.shape[0]])
                        start += p.shape[0]
            st = getattr(layer.mlp, "rz_stacks", None)
            for e, ex in enumerate(layer.mlp.experts if st is not None else []):
                for n, t in st.items():
                    fix(getattr(ex, n).weight, t[e])

    def _lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.c.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = ref.final_logits(hidden_states, self._lm_head_weight())
        scale = self.logits_processor.scale
        if scale != 1.0:
            logits = logits * scale
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            p = params.get(name)
            if p is None:
                # rotary inv_freq buffers, MTP layers (model.layers.{num_layers}.*), a tied lm_head,
                # other tensor-parallel ranks' experts, other pipeline stages' layers / embeddings / norm / lm_head
                continue
            shard = self.rz_shards.get(name)
            if shard is not None and tuple(w.shape) == tuple(p.shape):
                pass  # already this rank's block (a resharded sync, vllm_bridge.weights.reshard): loaded as it is
            elif shard is not None:  # a full HF tensor: keep this rank's block
                dim, start, n = shard
                if w.shape[dim] != n * self.rz_tp:
                    raise ValueError(f"load_weights: {name} has shape {tuple(w.shape)}, expected the full "
                                     f"tensor ({n * self.rz_tp} along dim {dim}) to shard over tp={self.rz_tp}")
                w = w.narrow(dim, start, n)
            loader = getattr(p, "weight_loader", default_weight_loader)
            loader(p, w)
            loaded.add(name)
        if self.rz_fp8 is not None:
            self.rz_fp8.clear()  # re-quantise from the new weights at the next forward
        if self.rz_fast:
            with torch.no_grad():
                self._rz_pack_check()
        return loaded
