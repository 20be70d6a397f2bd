"""Aligned ("trainer-inference invariant") Megatron-Core modules: every op of the forward is a
`kernels` op, so the learner's token log-probs are bitwise those of
`kernels.models.qwen3_dsv3.reference_logprobs` (and of the aligned vLLM model) for the same
weights and tokens, whatever the micro-batch size, the batch composition, right padding, TP (any tp
dividing kernels.ROW_PARALLEL_K_SEGMENTS = 8) or EP.

The modules subclass Megatron's own (same parameters, names, TP attributes and gradient plumbing,
so hf_convert, DDP and the optimizer are unchanged); only `forward` is replaced. `aligned_layer_spec`
rewrites a local GPT layer spec to use them; `alignify_output_layer` swaps the class of GPTModel's
output layer (GPTModel builds it directly, not from a spec).

Row-parallel rule (K segmentation; both engines must use the same; docs/tp.md):

    ROW_PARALLEL_K_SEGMENTS (= 8) for EVERY o_proj (attention linear_proj) and EVERY down_proj
    (dense MLP, shared experts and routed experts):
    kernels.linear(x, W, k_segments=ROW_PARALLEL_K_SEGMENTS).
    Every other linear (q/k/v/qkv, q_a/q_b, kv_a/kv_b, gate/up, router gate, lm_head): k_segments=1.

Why a fixed 8: a row-parallel layer splits K over the TP ranks; rank r holds K/tp columns, i.e.
segments r*s/tp .. (r+1)*s/tp - 1 of the FIXED segmentation s = 8 (width K/8), computes one fp32
partial per segment (`kernels.linear_partial`), the partials are all-gathered and added in segment
(= rank) order (`kernels.sum_partials`), which equals the one-rank `kernels.linear(..., k_segments=s)`
bitwise. The segmentation does not depend on the TP degree, so every tp dividing 8 (1, 2, 4, 8:
every single-node TP) gives the same bits as TP=1 and as a vLLM engine of any such TP. Routed
experts are not TP-split here (etp = 1) but use the same rule, so the rule is "every
o_proj/down_proj". Every row-parallel K (heads * v_head_dim, intermediate sizes) must be a multiple
of 8 (check_aligned_supported names the recipe key that is not).

Blockwise FP8 (recipe model.fp8=blockwise): the linears a DeepSeek-V3 / vLLM block-FP8 checkpoint
keeps in e4m3 (attention projections; dense, shared and routed expert gate/up/down) compute
`kernels.fake_quant_linear(x, master_weight)`: the master weight (model dtype, what the optimizer
updates) is quantised per 128x128 block at every forward, the activation per 1x128 group, then the
block-scaled GEMM -- bitwise what the engine computes from the same weights quantised once at load
(`kernels.models.qwen3_dsv3.project`). Gradients: straight-through to x and to the master weight.
Block scales follow the Hugging Face tensors, not Megatron's fused ones: the fused QKV weight is
quantised as its q / k / v parts and fc1 as its gate and up halves (a 128-row block must not straddle
two checkpoint tensors), and the outputs are put back in Megatron's layout (an exact permutation).
Router gate, lm_head, embeddings and norms stay in the model dtype. TP > 1 (Qwen3-MoE and
DeepSeek-V3; shape rules in check_aligned_supported): column shards quantised per rank (128-row
aligned), o_proj / dense fc2 through the 8-segment row-parallel FP8 form, DeepSeek-V3's replicated
kv_a quantised whole, its TP-split q_a and its shared expert each computed whole on every rank from
the all-gathered shards (`_GatherWeight`, `_fp8_shared_expert_forward`: the single chain, as the
engine's replicated ones).

Why not nvidia-modelopt's fake quantisation (0.47 has FP8 configs incl. 128x128 blockwise weights):
its quantiser is not ours bit for bit -- scale = 448 / amax and q = x * scale (a reciprocal multiply;
we divide by amax / 448, as DeepSeek / vLLM), dequantised as q * (1 / scale), zero blocks handled with
its own epsilon -- and it returns a dequantised tensor for a plain GEMM, not the FP8 GEMM with
per-block scale products added in K order that the engine runs; dynamic 1x128 activation quant needs
CUDA there. Measured on a 1024x1024 weight with 128x128 block amaxes: the e4m3 codes agreed, but
modelopt's dequantised weight differed from ours on 21.6% of elements (by up to 7e-9: 1/(448/amax)
is not amax/448). A fake quant that must equal the engine bitwise has to share the engine's
quantiser and GEMM, so both sides call `kernels` (tests/integration/test_fp8_models.py).

Other collectives are exact by construction: sequence-parallel all-gathers, the vocab-parallel
embedding's reduce (one non-zero term per element), the vocab gather of the logits, and the MoE
expert-output return (each (token, slot) is non-zero on exactly one rank of the tp-ep group, so the
reduce-scatter adds exact zeros).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

import kernels
from kernels.families import family

ROW_PARALLEL_K_SEGMENTS = kernels.ROW_PARALLEL_K_SEGMENTS


# ------------------------------------------------------------------ linears


def gather_seq(x, group):
    """Sequence-parallel all-gather along the first dim (gradient: reduce-scatter back)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)


def all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` of ``group`` along the first dim, in rank order (no gradient)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def keep_in_graph(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y``, linked to ``x``'s autograd graph when it is not already (gradient exactly zero, bits of
    ``y`` unchanged): an expert-parallel rank whose experts got no token computes its slot outputs as
    plain zeros, and without the link its backward would skip the collectives (reduce-scatter of the
    slot gradients, the sequence all-gather's backward) that the other ranks of the group run: a hang."""
    if torch.is_grad_enabled() and x.requires_grad and not y.requires_grad:
        return y + x[:0].sum()  # an empty sum: exactly 0.0, but a graph edge to x
    return y


class _RowParallelAligned(torch.autograd.Function):
    """Row-parallel linear over a TP group: per-segment fp32 partials, all-gathered, added in global
    segment order, rounded once; with sequence parallelism each rank keeps its sequence chunk.
    Backward: the plain row-parallel gradient (all-gather of the output grad under SP)."""

    @staticmethod
    def forward(ctx, x, w, group, segments, sp):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.group, ctx.sp = group, sp
        tp = dist.get_world_size(group)
        local = segments // tp
        mine = kernels.row_partials(x, w, local)  # [local, ..., N] fp32
        gathered = [torch.empty_like(mine) for _ in range(tp)]
        dist.all_gather(gathered, mine.contiguous(), group=group)
        allp = [g[i] for g in gathered for i in range(local)]  # rank order, then segment order
        if sp:  # only this rank's sequence chunk is needed (elementwise adds: same bits)
            me = dist.get_rank(group)
            allp = [p.chunk(tp, dim=0)[me] for p in allp]
        return kernels.finish_linear(kernels.sum_partials(allp), None, x.dtype).contiguous()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        if ctx.sp:
            g = all_gather_first_dim(g, ctx.group)
        gx = torch.matmul(g.to(w.dtype), w).to(x.dtype)
        gw = torch.matmul(g.reshape(-1, g.shape[-1]).t().to(x.dtype), x.reshape(-1, x.shape[-1])).to(w.dtype)
        return gx, gw, None, None, None


def row_parallel_linear(x: torch.Tensor, w: torch.Tensor, group, sp: bool,
                        segments: int = ROW_PARALLEL_K_SEGMENTS) -> torch.Tensor:
    """Aligned row-parallel linear: bitwise `kernels.linear(x_full, W_full, k_segments=segments)`."""
    tp = 1 if group is None else dist.get_world_size(group)
    if segments % tp:
        raise ValueError(f"aligned row-parallel linear: k_segments={segments} is not divisible by tp={tp}")
    if tp == 1:
        return kernels.linear(x, w, k_segments=segments)
    return _RowParallelAligned.apply(x, w, group, segments, sp)


class _RowParallelFP8Aligned(torch.autograd.Function):
    """Row-parallel blockwise-FP8 linear over a TP group (docs/tp.md "FP8"): the rank quantises its
    master-weight shard per 128x128 block and its activation shard per 1x128 group (both the full
    tensors' blocks: the shard width is a multiple of 128), computes the fp32 chains of its
    segments / tp K segments (``kernels.dispatch.fp8_row_partials``), the chains are all-gathered and
    added in rank (= segment) order, rounded once: bitwise ``kernels.fake_quant_linear(x_full,
    W_full, k_segments=segments)``. Backward: straight-through (the dequantised weight shard for x,
    ``g^T x`` for the master weight), as kernels.fp8_linear's; all-gather of g under SP."""

    @staticmethod
    def forward(ctx, x, w, group, segments, sp):  # type: ignore[override]
        from kernels.dispatch import fp8_row_partials

        tp = dist.get_world_size(group)
        wq, ws = kernels.quantize_weight_blockwise(w.detach())
        ctx.save_for_backward(x, wq, ws)
        ctx.group, ctx.sp, ctx.w_dtype = group, sp, w.dtype
        mine = fp8_row_partials(x, wq, ws, segments // tp)  # [local, ..., N] fp32
        local = mine.shape[0]
        gathered = [torch.empty_like(mine) for _ in range(tp)]
        dist.all_gather(gathered, mine.contiguous(), group=group)
        allp = [g[i] for g in gathered for i in range(local)]  # rank order, then segment order
        if sp:
            me = dist.get_rank(group)
            allp = [p.chunk(tp, dim=0)[me] for p in allp]
        return kernels.finish_linear(kernels.sum_partials(allp), None, x.dtype).contiguous()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        from kernels.fp8 import dequantize_weight_blockwise

        x, wq, ws = ctx.saved_tensors
        if ctx.sp:
            g = all_gather_first_dim(g, ctx.group)
        deq = dequantize_weight_blockwise(wq, ws)
        g32 = g.to(torch.float32)
        gx = torch.matmul(g32, deq).to(x.dtype)
        gw = torch.matmul(g32.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]).to(torch.float32))
        return gx, gw.to(ctx.w_dtype), None, None, None


def fp8_row_parallel_linear(x: torch.Tensor, w: torch.Tensor, group, sp: bool) -> torch.Tensor:
    """Aligned row-parallel FP8 linear (o_proj, dense fc2): ``kernels.fake_quant_linear(x_full, W_full,
    k_segments=row_parallel_k_segments(K_full))`` bitwise; at tp > 1 K_full must be a multiple of
    1024 (check_aligned_supported refuses other models first)."""
    from kernels.fp8 import row_parallel_k_segments

    tp = 1 if group is None else dist.get_world_size(group)
    segments = row_parallel_k_segments(x.shape[-1] * tp)
    if tp == 1:
        return kernels.fake_quant_linear(x, w, None, out_dtype=x.dtype, k_segments=segments)
    if segments % tp or segments == 1:
        raise NotImplementedError(
            f"model.fp8=blockwise at parallel.tp={tp}: a row-parallel K of {x.shape[-1] * tp} is not a multiple "
            f"of {ROW_PARALLEL_K_SEGMENTS} x 128 = {ROW_PARALLEL_K_SEGMENTS * 128} (docs/tp.md \"FP8\")")
    return _RowParallelFP8Aligned.apply(x, w, group, segments, sp)


def _column_forward(self, input_, weight=None, runtime_gather_output=None):
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    if weight is None:
        weight = self.weight
    tp = 1 if self.tp_group is None else self.tp_group.size()
    if tp > 1 and not self.explicit_expert_comm:
        if self.sequence_parallel:
            input_ = gather_seq(input_, self.tp_group)
        else:
            input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
    out_dtype = getattr(self, "aligned_out_dtype", None)
    bias = self.bias if not self.skip_bias_add else None
    out = kernels.linear(input_, weight, bias, out_dtype=out_dtype)
    gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather and tp > 1:
        out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
    return out, (self.bias if self.skip_bias_add else None)


def _make_linear_classes():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class AlignedColumnParallelLinear(ColumnParallelLinear):
        """Column-parallel linear through `kernels.linear` (each output element is computed as on
        one rank, so TP shards are bitwise the TP=1 columns). Sequence-parallel input is gathered."""

        forward = _column_forward

    class AlignedRowParallelLinear(RowParallelLinear):
        """Row-parallel linear: `kernels.linear(..., k_segments=ROW_PARALLEL_K_SEGMENTS)` at TP=1;
        per-rank fp32 segment partials, all-gathered and added in rank order at TP>1."""

        def forward(self, input_):
            if not self.input_is_parallel:
                raise NotImplementedError("aligned RowParallelLinear expects input_is_parallel=True")
            if self.bias is not None and not self.skip_bias_add:
                # kernels add a bias in fp32 before the single rounding; not needed by the
                # supported architectures (add_bias_linear=False), so not implemented.
                raise NotImplementedError("aligned RowParallelLinear: fused bias is not supported")
            if self.explicit_expert_comm:
                out = kernels.linear(input_, self.weight, k_segments=ROW_PARALLEL_K_SEGMENTS)
            else:
                out = row_parallel_linear(input_, self.weight, self.tp_group, self.sequence_parallel)
            return out, (self.bias if self.skip_bias_add else None)

    class AlignedFP8ColumnParallelLinear(AlignedColumnParallelLinear):
        """Blockwise-FP8 fake-quant column linear. Megatron names the fused layers it builds
        (`tp_comm_buffer_name`): "qkv" is quantised as q / k / v, "fc1" as gate / up. At TP > 1
        each rank quantises its own shard (rows per rank multiples of 128, so its 128x128 blocks
        are the full tensors'; the activation is quantised per row over the unsplit K): bitwise the
        TP=1 columns (check_aligned_supported checks the alignment)."""

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.rz_fp8_role = {"qkv": "qkv", "fc1": "gated"}.get(kw.get("tp_comm_buffer_name"), "plain")

        def forward(self, input_, weight=None, runtime_gather_output=None):
            from megatron.core.tensor_parallel.mappings import (
                copy_to_tensor_model_parallel_region,
                gather_from_tensor_model_parallel_region,
            )

            tp = 1 if self.tp_group is None else self.tp_group.size()
            if tp > 1 and getattr(self, "rz_fp8_whole", False):
                # MLA's q_a (q down-projection; alignify_model): Megatron splits its rows, the engine
                # replicates it; computed whole on the rank's rows from the all-gathered shards
                # (quantised whole, as the engine), so MLA's output gather / scatter is skipped
                w = _GatherWeight.apply(self.weight if weight is None else weight, self.tp_group, 0,
                                        bool(self.sequence_parallel))
                return kernels.fake_quant_linear(input_, w, None, out_dtype=input_.dtype), None
            if tp > 1 and not self.explicit_expert_comm:
                if self.sequence_parallel:
                    input_ = gather_seq(input_, self.tp_group)
                else:
                    input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
            bias = self.bias if not self.skip_bias_add else None
            out = fp8_fused_linear(self, input_, self.weight if weight is None else weight, bias, tp=tp)
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            if gather and tp > 1:
                out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
            return out, (self.bias if self.skip_bias_add else None)

    class AlignedFP8RowParallelLinear(AlignedRowParallelLinear):
        """Blockwise-FP8 fake-quant row linear. o_proj and dense fc2: the row-parallel FP8 form
        (`fp8_row_parallel_linear`: 8 per-segment chains when K % 1024 == 0, else the single chain,
        TP=1 only); a shared expert's fc2 (`rz_fp8_single_chain`, set by AlignedSharedExpertMLP: the
        engine replicates shared experts) the single chain (at TP > 1 AlignedSharedExpertMLP computes
        the shared expert whole instead of calling this)."""

        def forward(self, input_):
            tp = 1 if self.tp_group is None else self.tp_group.size()
            bias = self.bias if not self.skip_bias_add else None
            if self.explicit_expert_comm or getattr(self, "rz_fp8_single_chain", False):
                if tp > 1 and not self.explicit_expert_comm:
                    raise NotImplementedError("model.fp8=blockwise: a TP-split shared expert's fc2 keeps the single "
                                              "chain; compute it whole (_fp8_shared_expert_forward)")
                out = kernels.fake_quant_linear(input_, self.weight, bias, out_dtype=input_.dtype)
            else:
                if bias is not None:
                    raise NotImplementedError("aligned FP8 RowParallelLinear: fused bias is not supported")
                out = fp8_row_parallel_linear(input_, self.weight, self.tp_group if tp > 1 else None,
                                              self.sequence_parallel)
            return out, (self.bias if self.skip_bias_add else None)

    _FP8_LINEARS.update(col=AlignedFP8ColumnParallelLinear, row=AlignedFP8RowParallelLinear)
    return AlignedColumnParallelLinear, AlignedRowParallelLinear


# ------------------------------------------------------------------ blockwise FP8 (fake quant)

_FP8_LINEARS: dict = {}


def fp8_fused_linear(mod, x: torch.Tensor, weight: torch.Tensor, bias=None, tp: int = 1) -> torch.Tensor:
    """Fake-quant FP8 linear of a possibly fused Megatron weight, quantised per checkpoint tensor
    (`mod.rz_fp8_role`): "plain" one tensor; "gated" [gate; up] halves; "qkv" Megatron's grouped
    [q heads of g; k_g; v_g] rows split into HF q / k / v. Output in Megatron's column order.
    ``weight``: this TP rank's shard (``tp`` ranks; the qkv shard holds num_query_groups / tp groups)."""
    role = getattr(mod, "rz_fp8_role", "plain")
    fq = lambda w, b=None: kernels.fake_quant_linear(x, w, b, out_dtype=x.dtype)  # noqa: E731
    if role == "plain":
        return fq(weight, bias)
    if bias is not None:
        raise NotImplementedError("fp8: fused linear with bias")
    if role == "gated":
        i = weight.shape[0] // 2
        return torch.cat([fq(weight[:i]), fq(weight[i:])], dim=-1)
    cfg = mod.config
    ng, hn = cfg.num_query_groups // tp, cfg.kv_channels
    per = cfg.num_attention_heads // cfg.num_query_groups
    H = weight.shape[-1]
    q, k, v = weight.view(ng, (per + 2) * hn, H).split([per * hn, hn, hn], dim=1)
    lead = x.shape[:-1]
    parts = [fq(q.reshape(-1, H)).view(*lead, ng, per * hn), fq(k.reshape(-1, H)).view(*lead, ng, hn),
             fq(v.reshape(-1, H)).view(*lead, ng, hn)]
    return torch.cat(parts, dim=-1).reshape(*lead, ng * (per + 2) * hn)


def _fp8_expert_forward(x: torch.Tensor, w_fc1: torch.Tensor, w_fc2: torch.Tensor) -> torch.Tensor:
    """One routed expert in blockwise FP8 (`kernels.expert_mlp_merged`'s chain): gate and up quantised as
    the checkpoint's two tensors."""
    i = w_fc1.shape[0] // 2
    g = kernels.fake_quant_linear(x, w_fc1[:i], out_dtype=x.dtype)
    u = kernels.fake_quant_linear(x, w_fc1[i:], out_dtype=x.dtype)
    return kernels.fake_quant_linear(kernels.swiglu(g, u), w_fc2, out_dtype=x.dtype)


class _GatherWeight(torch.autograd.Function):
    """All-gather a TP-split weight along ``dim`` in rank order, so that every rank can compute the
    layer whole. Backward: the rank's slice of the full-weight gradient; with ``partial`` (each rank
    computed on its own tokens: sequence parallel) the full gradients are first summed over the group."""

    @staticmethod
    def forward(ctx, w, group, dim, partial):  # type: ignore[override]
        ctx.group, ctx.dim, ctx.partial = group, dim, partial
        parts = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, w.detach().contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.contiguous()
        if ctx.partial:
            dist.all_reduce(g, group=ctx.group)
        mine = g.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[dist.get_rank(ctx.group)]
        return mine.contiguous(), None, None, None


def _fp8_shared_expert_forward(se, hidden_states: torch.Tensor) -> torch.Tensor:
    """A shared expert in blockwise FP8. TP=1: fc1 (gate / up) and fc2 with the single chain. TP > 1:
    Megatron keeps the shared expert TP-split (fc1 rows, fc2 K columns), but a single FP8 chain cannot
    be split by K and the engine computes shared experts whole, so every rank all-gathers the fc1 /
    fc2 shards (the full gate, up and down weights) and computes the rank's tokens (its sequence
    chunk) whole: bitwise the TP=1 rows. The weight gradients go back to the shards (summed over the
    ranks' tokens under sequence parallelism)."""
    group = se.linear_fc1.tp_group
    tp = 1 if group is None else group.size()
    if tp == 1:
        return aligned_mlp_forward(se, hidden_states)
    sp = bool(se.config.sequence_parallel)
    w1 = _GatherWeight.apply(se.linear_fc1.weight, group, 0, sp)  # [g_0; u_0; g_1; u_1; ...]
    w1 = w1.view(tp, 2, -1, w1.shape[-1]).transpose(0, 1).reshape(w1.shape)  # [gate; up]
    w2 = _GatherWeight.apply(se.linear_fc2.weight, group, 1, sp)
    # the rank's rows (its sequence chunk under SP; all rows, replicated, without): per-row activation
    # quantisation, so each row is the TP=1 row; the input gradient is then already complete
    return _fp8_expert_forward(hidden_states, w1, w2)


def _make_replicated_linear():
    from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear

    class AlignedReplicatedLinear(ReplicatedLinear):
        """TP-replicated linear (MLA kv down-projection) through `kernels.linear`."""

        def forward(self, input, /):  # noqa: A002
            return kernels.linear(input, self.weight, self.bias), None

    class AlignedFP8ReplicatedLinear(ReplicatedLinear):
        """TP-replicated linear (MLA kv down-projection) in blockwise FP8 (fake quant)."""

        rz_fp8_role = "plain"

        def forward(self, input, /):  # noqa: A002
            return kernels.fake_quant_linear(input, self.weight, self.bias, out_dtype=input.dtype), None

    _FP8_LINEARS["replicated"] = AlignedFP8ReplicatedLinear
    return AlignedReplicatedLinear


# ------------------------------------------------------------------ norm, attention


class AlignedRMSNorm(torch.nn.Module):
    """`kernels.rms_norm` (HF order: normalise in fp32, round, multiply by the weight in fp32)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_tables(seq_len: int, rotary_dim: int, base: float, device=None):
    """float64 tables rounded once (kernels.rope_cos_sin) for positions 0..seq_len-1, shaped
    [s, 1, r/2] to broadcast over Megatron's [s, b, heads, dim] layout. Computed on `device` (the
    activations' device): the aligned vLLM model computes its tables on its positions' device, so
    on a GPU both sides use the GPU's float64 cos/sin (on the CPU: unchanged)."""
    cos, sin = kernels.rope_cos_sin(torch.arange(seq_len, device=device), rotary_dim, float(base))
    return cos[:, None, :], sin[:, None, :]


class AlignedCoreAttention(torch.nn.Module):
    """Causal attention through `kernels.causal_attention` on Megatron's [s, b, heads, dim] tensors
    (right padding, token i at position i). With `rope_dim` > 0 it first applies neox RoPE to q and
    k (Qwen3: after the q/k norms, as Megatron's SelfAttention would; the model is built with
    position_embedding_type="none" so Megatron applies none itself). Scale = head_dim ** -0.5 as a
    Python float, the reference's expression."""

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None, rope_dim: int = 0, rope_base: float = 10000.0, **_):
        super().__init__()
        self.config = config
        self.rope_dim, self.rope_base = rope_dim, rope_base

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_):
        assert packed_seq_params is None, "packed sequences are not supported by AlignedCoreAttention"
        sq, b, nh, d = query.shape
        assert key.shape[0] == sq, "aligned attention expects full sequences (no KV cache)"
        if self.rope_dim:
            cos, sin = rope_tables(sq, self.rope_dim, self.rope_base, device=query.device)
            query = kernels.apply_rope(query, cos, sin, "neox")
            key = kernels.apply_rope(key, cos, sin, "neox")
        scale = float(d ** (-0.5))
        q = query.transpose(0, 1)
        k = key.transpose(0, 1)
        v = value.transpose(0, 1)
        out = kernels.causal_attention(q, k, v, scale)  # [b, s, h, dv]
        return out.transpose(0, 1).reshape(sq, b, nh * value.shape[-1])


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _make_mla():
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class AlignedMLASelfAttention(MLASelfAttention):
        """MLA with the reference's RoPE: rope dims of q and k_pe de-interleaved (an exact
        permutation; HF's / Megatron's MLA layout) then neox-rotated with kernels tables; q and k
        are [nope | rope] per head, as in qwen3_dsv3.dsv3_qkv. Training/full-sequence only."""

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                        packed_seq_params=None, inference_context=None, *,
                                        inference_params=None):
            assert packed_seq_params is None and inference_context is None and inference_params is None
            cfg = self.config
            tp = 1 if self.tp_group is None else self.tp_group.size()
            if cfg.q_lora_rank is not None:
                q_compressed, _ = self.linear_q_down_proj(hidden_states)
                if q_compressed.size(-1) != cfg.q_lora_rank:
                    q_compressed = gather_from_tensor_model_parallel_region(q_compressed)
                    if cfg.sequence_parallel:
                        q_compressed = scatter_to_sequence_parallel_region(q_compressed)
                q_compressed = self.q_layernorm(q_compressed)
                q, _ = self.linear_q_up_proj(q_compressed)
            else:
                q_compressed = hidden_states
                q, _ = self.linear_q_proj(hidden_states)
            kv_combined, _ = self.linear_kv_down_proj(hidden_states)
            if kv_combined.size(-1) != cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim:
                kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
                kv_compressed, k_pos_emb = torch.split(
                    kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
                if cfg.sequence_parallel:
                    kv_compressed = scatter_to_sequence_parallel_region(kv_compressed)
            else:
                kv_compressed, k_pos_emb = torch.split(
                    kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
                if tp > 1 and cfg.sequence_parallel:
                    k_pos_emb = gather_seq(k_pos_emb, self.tp_group)
            kv_compressed = self.kv_layernorm(kv_compressed)
            kv, _ = self.linear_kv_up_proj(kv_compressed)

            n = self.num_attention_heads_per_partition
            s, b = q.shape[0], q.shape[1]
            q = q.view(s, b, n, self.q_head_dim)
            kv = kv.view(s, b, n, cfg.qk_head_dim + cfg.v_head_dim)
            q_nope, q_pe = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
            k_nope, value = torch.split(kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
            cos, sin = rope_tables(s, cfg.qk_pos_emb_head_dim, cfg.rotary_base, device=q.device)
            q_pe = kernels.apply_rope(_deinterleave(q_pe), cos, sin, "neox")
            k_pe = kernels.apply_rope(_deinterleave(k_pos_emb.unsqueeze(-2)), cos, sin, "neox")
            query = torch.cat([q_nope, q_pe], dim=-1)
            key = torch.cat([k_nope, k_pe.expand(-1, -1, n, -1)], dim=-1)
            return query, key, value.contiguous(), q_compressed, kv_compressed

    return AlignedMLASelfAttention


# ------------------------------------------------------------------ MLP / MoE


def aligned_mlp_forward(mlp, hidden_states: torch.Tensor) -> torch.Tensor:
    """fc1 (merged [gate; up] shard, column-parallel) -> kernels.swiglu_merged (kernels.swiglu of the
    two halves, one gradient for both) -> fc2 (row-parallel). Bitwise kernels.expert_mlp with the
    down projection at k_segments=ROW_PARALLEL_K_SEGMENTS."""
    h, _ = mlp.linear_fc1(hidden_states)
    out, _ = mlp.linear_fc2(kernels.swiglu_merged(h))
    return out


def _make_mlp_classes():
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region

    class AlignedMLP(MLP):
        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            return aligned_mlp_forward(self, hidden_states), None

    class AlignedSharedExpertMLP(SharedExpertMLP):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            # FP8: the engine replicates shared experts, so their down_proj keeps the single chain
            self.linear_fc2.rz_fp8_single_chain = True

        def forward(self, hidden_states):
            assert not self.use_shared_expert_gate, "aligned mode: shared expert gate unsupported"
            if hasattr(self.linear_fc1, "rz_fp8_role"):  # model.fp8=blockwise
                return _fp8_shared_expert_forward(self, hidden_states)
            return aligned_mlp_forward(self, hidden_states)

    class AlignedMoELayer(MoELayer):
        """Router (kernels.router_logits + kernels.route, HF semantics), routed experts computed per
        (token, slot) row, outputs returned to the token's rank exactly, `kernels.moe_combine` in
        slot order plus the shared expert. Megatron's token dispatcher is not used (its unpermute
        adds expert outputs in an order that depends on the batch)."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                     router_score: str = "softmax", norm_topk_prob: bool = True, num_groups: int = 1,
                     group_topk: Optional[int] = None, scaling_factor: float = 1.0, fp8: bool = False, **kw):
            super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection, **kw)
            self.rz_fp8 = fp8
            self.aligned_route = dict(score=router_score, norm_topk_prob=norm_topk_prob,
                                      num_groups=num_groups, group_topk=group_topk,
                                      scaling_factor=scaling_factor)
            if config.expert_tensor_parallel_size != 1:
                raise NotImplementedError("aligned MoE supports expert_tensor_parallel_size=1 only")

        def _route(self, x):
            r = self.router
            p = self.aligned_route
            k = self.config.moe_router_topk
            if p["score"] == "softmax":  # Qwen3-MoE: logits rounded like HF's nn.Linear
                logits = kernels.router_logits(x, r.weight, out_dtype=x.dtype)
                ids, w = kernels.route(logits, k, score="softmax", norm_topk_prob=p["norm_topk_prob"])
                return ids, w.to(x.dtype)
            logits = kernels.router_logits(x, r.weight, out_dtype=torch.float32)
            bias = getattr(r, "expert_bias", None)
            return kernels.route(
                logits, k, score="sigmoid", expert_bias=bias, num_groups=p["num_groups"],
                group_topk=p["group_topk"], norm_topk_prob=p["norm_topk_prob"],
                scaling_factor=p["scaling_factor"])

        def _expert_rows(self, x_all, flat, k):
            """[T*k, H] routed-expert outputs of this rank's experts (zero rows for the others):
            `kernels.moe_expert_rows` on the stacked weights (grouped kernels forward, grouped
            GEMMs backward). The stack copies the experts' weights once per forward (autograd
            returns each expert's gradient slice)."""
            ex = self.experts.local_experts
            w13 = torch.stack([e.linear_fc1.weight for e in ex])  # [E_local, 2I, H]
            w2 = torch.stack([e.linear_fc2.weight for e in ex])  # [E_local, H, I]
            e0, n_local = self.local_expert_indices[0], len(self.local_expert_indices)
            if n_local == self.config.num_moe_experts:
                slots = torch.arange(flat.numel(), device=flat.device)
                return kernels.moe_expert_rows(x_all, slots, flat, w13, w2, k)
            # expert parallel: this rank's rows only (a rank with none still runs on 0 rows, so the
            # graph links y to x_all and every rank of the group runs the same backward collectives)
            slots = ((flat >= e0) & (flat < e0 + n_local)).nonzero().squeeze(1)
            rows = kernels.moe_expert_rows(x_all, slots, flat[slots] - e0, w13, w2, k)
            return x_all.new_zeros(flat.numel(), x_all.shape[-1]).index_copy(0, slots, rows)

        def _fp8_expert_rows(self, x_all, flat, k):
            """Blockwise FP8: one expert at a time (each weight fake-quantised on its own)."""
            y = x_all.new_zeros(flat.numel(), x_all.shape[-1])
            for li, e in enumerate(self.local_expert_indices):
                # An expert with no tokens still runs (on 0 rows): the graph then always links y to
                # x_all, so every rank of the group runs the same backward collectives.
                sel = (flat == e).nonzero().squeeze(1)
                tok = torch.div(sel, k, rounding_mode="floor")
                ex = self.experts.local_experts[li]
                y = y.index_copy(0, sel, _fp8_expert_forward(x_all[tok], ex.linear_fc1.weight, ex.linear_fc2.weight))
            return y

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None, **_):
            s, b, H = hidden_states.shape
            x = hidden_states.reshape(s * b, H)
            ids, wts = self._route(x)
            k = ids.shape[1]
            group = self.token_dispatcher.tp_ep_group
            G = 1 if group is None else group.size()
            if G > 1:
                x_all = gather_seq(x, group)
                ids_all = all_gather_first_dim(ids, group)
            else:
                x_all, ids_all = x, ids
            T = x_all.shape[0]
            flat = ids_all.reshape(-1)
            y = self._fp8_expert_rows(x_all, flat, k) if self.rz_fp8 else self._expert_rows(x_all, flat, k)
            if G > 1:  # each (token, slot) is non-zero on exactly one rank: the sum is exact
                y = reduce_scatter_to_sequence_parallel_region(y, group=group)
            shared = None
            if self.use_shared_expert:
                shared = AlignedSharedExpertMLP.forward(self.shared_experts, hidden_states).reshape(s * b, H)
            out = kernels.moe_combine(y.view(s * b, k, H), wts, shared, out_dtype=x.dtype)
            return out.view(s, b, H), None

    return AlignedMLP, AlignedSharedExpertMLP, AlignedMoELayer


# ------------------------------------------------------------------ spec rewriting


_CLASSES: dict = {}
# MLA picks the constructor kwargs of its down projections by exact class (`in [Linear, ...]`):
# these keep the Megatron class in the spec and get the aligned forward by `alignify_model`.
_KEEP_IN_SPEC = ("linear_q_down_proj", "linear_kv_down_proj")


def _classes() -> dict:
    """{megatron class: aligned class} (built lazily: megatron imports are heavy)."""
    if _CLASSES:
        return _CLASSES
    from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    col, row = _make_linear_classes()
    mlp, shared, moe = _make_mlp_classes()
    _CLASSES.update({
        ColumnParallelLinear: col,
        RowParallelLinear: row,
        ReplicatedLinear: _make_replicated_linear(),
        MLP: mlp,
        SharedExpertMLP: shared,
        MoELayer: moe,
        MLASelfAttention: _make_mla(),
    })
    return _CLASSES


def _rewrite(obj, table, norm_cls, core_cls):
    """Recursively replace module classes inside a ModuleSpec / submodules dataclass tree."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, ModuleSpec):
        obj.module = _rewrite(obj.module, table, norm_cls, core_cls)
        if obj.submodules is not None:
            obj.submodules = _rewrite(obj.submodules, table, norm_cls, core_cls)
        return obj
    if isinstance(obj, type):
        if obj is norm_cls:
            return AlignedRMSNorm
        if obj is core_cls:
            return AlignedCoreAttention
        return table.get(obj, obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.name in _KEEP_IN_SPEC:
                continue
            setattr(obj, f.name, _rewrite(getattr(obj, f.name), table, norm_cls, core_cls))
        return obj
    return obj


def aligned_layer_spec(spec, model_cfg, norm_cls, core_cls):
    """Rewrite a (fast-mode) layer spec in place into the aligned one and return it.

    `norm_cls` / `core_cls` are the fast mode's RMSNorm / CoreAttention classes to replace."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    import copy

    m = model_cfg
    table = _classes()
    if getattr(m, "fp8", "none") == "blockwise":
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        table = dict(table)
        table[ColumnParallelLinear] = _FP8_LINEARS["col"]
        table[RowParallelLinear] = _FP8_LINEARS["row"]
    spec = copy.deepcopy(spec)  # never mutate specs megatron might share between calls
    _rewrite(spec, table, norm_cls, core_cls)
    attn = spec.submodules.self_attention.submodules
    if family(m.arch).gqa:  # RoPE inside the aligned core attention (Qwen2: after the biased qkv)
        attn.core_attention = ModuleSpec(module=AlignedCoreAttention,
                                         params={"rope_dim": m.head_dim, "rope_base": float(m.rope_theta)})
    mlp = spec.submodules.mlp
    if isinstance(mlp, ModuleSpec) and mlp.module is table[_moe_base()]:
        mlp.params = dict(mlp.params or {})
        mlp.params.update(
            router_score=m.router_score,
            norm_topk_prob=m.norm_topk_prob,
            num_groups=m.router_num_groups,
            group_topk=m.router_group_topk if m.router_num_groups > 1 else None,
            scaling_factor=m.routed_scaling_factor if m.router_score == "sigmoid" else 1.0,
            fp8=getattr(m, "fp8", "none") == "blockwise",
        )
    return spec


def _moe_base():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer


def alignify_model(model, norm_cls, core_cls) -> None:
    """After GPTModel is built: give the modules the spec could not carry the aligned forward by
    swapping their class (same parameters and attributes; the aligned classes only override
    `forward`): GPTModel's output_layer (built directly as a ColumnParallelLinear; it then returns
    fp32 logits, the reference's `final_logits`) and MLA's down projections. Then check that no
    module with Megatron's own numerics is left."""
    table = _classes()
    swappable = {k: v for k, v in table.items() if k.__name__ in ("ColumnParallelLinear", "RowParallelLinear", "Linear")}
    out_layer = getattr(model, "output_layer", None)
    # model.fp8=blockwise (the spec built FP8 linears): MLA's down projections, kept out of the spec,
    # become FP8 too; the output layer (lm_head) stays in the model dtype.
    fp8 = any(hasattr(mod, "rz_fp8_role") for mod in model.modules())
    fp8_swap = {k: _FP8_LINEARS["col" if k.__name__ == "ColumnParallelLinear" else "replicated"]
                for k in swappable if k.__name__ in ("ColumnParallelLinear", "Linear")} if fp8 else {}
    for name, mod in model.named_modules():
        if ".experts.local_experts." in name + ".":
            continue  # routed experts are computed by AlignedMoELayer from their weights
        cls = type(mod)
        if cls in fp8_swap and mod is not out_layer and name.endswith(_KEEP_IN_SPEC):
            mod.__class__ = fp8_swap[cls]
            mod.rz_fp8_role = "plain"
            mod.rz_fp8_whole = name.endswith("linear_q_down_proj")  # at TP > 1: computed whole
        elif cls in swappable:
            mod.__class__ = swappable[cls]
        elif cls in table or cls in (norm_cls, core_cls):
            raise AssertionError(f"aligned model: module {name} still has fast-mode class {cls.__name__}")
    if out_layer is not None:
        out_layer.aligned_out_dtype = torch.float32
    # DeepSeek-V3's e_score_correction_bias is an fp32 statistic (fp32 in HF checkpoints and in
    # vLLM); model.to(bf16) would round it and could change the chosen experts. Keep it fp32.
    for mod in model.modules():
        if isinstance(getattr(mod, "expert_bias", None), torch.Tensor):
            mod.expert_bias = mod.expert_bias.float()


def check_aligned_supported(model_cfg, parallel) -> None:
    m, p = model_cfg, parallel
    if p.etp != 1:
        raise NotImplementedError("aligned mode: parallel.etp must be 1")
    if ROW_PARALLEL_K_SEGMENTS % p.tp:
        raise NotImplementedError(
            f"aligned mode: parallel.tp={p.tp} does not divide the fixed row-parallel K segments "
            f"(kernels.ROW_PARALLEL_K_SEGMENTS={ROW_PARALLEL_K_SEGMENTS}): set parallel.tp to one of "
            f"{[t for t in range(1, ROW_PARALLEL_K_SEGMENTS + 1) if ROW_PARALLEL_K_SEGMENTS % t == 0]}")
    if p.pp != 1:
        raise NotImplementedError("aligned mode: pipeline parallelism is not supported")
    if getattr(m, "fp8", "none") != "none" and p.tp != 1:
        bad = fp8_tp_problems(m, p.tp)
        if bad:
            raise NotImplementedError(fp8_tp_message(m, p.tp, bad[0]))
    for key, K in row_parallel_ks(m).items():
        if K % ROW_PARALLEL_K_SEGMENTS:
            raise ValueError(
                f"aligned mode: row-parallel K {key} = {K} is not a multiple of kernels.ROW_PARALLEL_K_SEGMENTS="
                f"{ROW_PARALLEL_K_SEGMENTS} (the fixed K segmentation of every o_proj / down_proj, docs/tp.md): "
                f"make {key} (recipe model section) a multiple of {ROW_PARALLEL_K_SEGMENTS}")


# the FP8 shape rules at TP > 1 live with the recipe (megatron_rz.recipe checks them at load time)
from megatron_rz.recipe import fp8_tp_message, fp8_tp_problems  # noqa: E402


def row_parallel_ks(m) -> dict:
    """{recipe key expression: K} of every row-parallel projection of model config ``m`` (the K
    that ROW_PARALLEL_K_SEGMENTS must divide): attention output, dense / shared / routed down_proj
    (DeepSeek-V4: the grouped output wo_b and the expert w2)."""
    ks = {}
    # the family's attention outputs (kernels.families attn_out_ks; Kimi-K3: MLA o_proj and KDA o_proj)
    for fields in family(m.arch).attn_out_ks:
        ks[" * ".join(f"model.{k}" for k in fields)] = math.prod(getattr(m, k) for k in fields)
    if m.num_experts:
        ks["model.moe_ffn_hidden_size"] = m.moe_ffn_hidden_size
    if not m.num_experts or m.first_k_dense:
        ks["model.dense_ffn_hidden_size"] = m.dense_ffn_hidden_size
    if m.num_shared_experts:
        ks["model.num_shared_experts * model.moe_ffn_hidden_size"] = m.num_shared_experts * m.moe_ffn_hidden_size
    return ks
