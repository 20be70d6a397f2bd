"""Hugging Face <-> Megatron-Core weight layout for qwen3_moe, qwen2 (dense) and deepseek_v3.

Names on the Hugging Face side are the checkpoint names (`model.safetensors`, one tensor per
expert projection), the names vLLM's loader and `from_pretrained` read.

Every Megatron parameter is described by a `_Rule`: which HF tensors make its full (unsharded,
TP=1) Megatron tensor, how to cut that into tensor-parallel shards, and whether it belongs to an
expert (then the TP group is the expert-TP group, and experts are numbered globally as
ep_rank * experts_per_rank + local index). Layout facts encoded here:
- fused QKV (`linear_qkv`, Qwen3 / Qwen2): per query group g, [q heads of g; k_g; v_g] along the rows,
  so a contiguous row split gives each TP rank whole groups; Qwen2's q/k/v biases are fused into
  `linear_qkv.bias` in the same row order;
- gated MLP `linear_fc1` = [gate; up]; each TP rank holds [gate shard; up shard];
- row-parallel layers (`linear_proj`, `linear_fc2`) split columns; column-parallel and the
  vocab-parallel embedding / output layer split rows; norms, router and expert bias are replicated;
- MLA's kv down-projection is replicated on every TP rank (see model.py);
- MLA (DeepSeek-V3) projections keep HF's row order (per head [nope | rope] for q and
  [k_nope | v] for kv_b; kv_a = [latent | k_rope]); Megatron's MLA applies the same interleaved
  RoPE permutation HF does, so no row permutation is needed.

Rules are written for the local spec's names; a fast learner built from the Transformer Engine
spec (fused norms, grouped experts) has other names for the same tensors, translated first by
megatron_rz.learner.te_spec (shapes and layouts are the same).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from kernels.families import FAMILIES, family, load

from megatron_rz.learner import te_spec
from megatron_rz.recipe import ModelConfig


@dataclass
class _Rule:
    hf_names: list[str]
    kind: str  # "replicated" | "row" (split dim 0) | "col" (split dim 1) | "gated" | "qkv"
    expert: bool = False


def _qkv_merge(m: ModelConfig, q, k, v):
    """HF q [Hq*D, ...], k, v [Hkv*D, ...] (weights [., H] or biases [.]) -> Megatron's grouped rows."""
    ng, hn = m.num_kv_heads, m.head_dim
    per = m.num_attention_heads // ng
    tail = q.shape[1:]
    parts = [q.reshape(ng, per * hn, *tail), k.reshape(ng, hn, *tail), v.reshape(ng, hn, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _qkv_split(m: ModelConfig, w):
    ng, hn = m.num_kv_heads, m.head_dim
    per = m.num_attention_heads // ng
    tail = w.shape[1:]
    q, k, v = w.reshape(ng, (per + 2) * hn, *tail).split([per * hn, hn, hn], dim=1)
    return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _rule(name: str, m: ModelConfig, ep_rank: int, experts_per_rank: int) -> _Rule:
    """The rule for one local Megatron parameter/buffer name."""
    top = {
        "embedding.word_embeddings.weight": _Rule(["model.embed_tokens.weight"], "row"),
        "output_layer.weight": _Rule(["lm_head.weight"], "row"),
        "decoder.final_layernorm.weight": _Rule(["model.norm.weight"], "replicated"),
    }
    if name in top:
        return top[name]
    hit = _LAYER.match(name)
    if not hit:
        raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")
    i, rest = hit.group(1), hit.group(2)
    p = f"model.layers.{i}."
    simple = {
        "input_layernorm.weight": _Rule([p + "input_layernorm.weight"], "replicated"),
        "pre_mlp_layernorm.weight": _Rule([p + "post_attention_layernorm.weight"], "replicated"),
        "self_attention.linear_proj.weight": _Rule([p + "self_attn.o_proj.weight"], "col"),
        # Qwen3 attention
        "self_attention.linear_qkv.weight": _Rule(
            [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"], "qkv"
        ),
        # Qwen2 attention biases
        "self_attention.linear_qkv.bias": _Rule(
            [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"], "qkv"
        ),
        # MLA (DeepSeek-V3); q_layernorm is Qwen3's q_norm or MLA's q_a_layernorm
        "self_attention.q_layernorm.weight": _Rule(
            [p + ("self_attn.q_norm.weight" if family(m.arch).qk_norm else "self_attn.q_a_layernorm.weight")],
            "replicated",
        ),
        "self_attention.k_layernorm.weight": _Rule([p + "self_attn.k_norm.weight"], "replicated"),
        "self_attention.linear_q_proj.weight": _Rule([p + "self_attn.q_proj.weight"], "row"),
        "self_attention.linear_q_down_proj.weight": _Rule([p + "self_attn.q_a_proj.weight"], "row"),
        "self_attention.linear_q_up_proj.weight": _Rule([p + "self_attn.q_b_proj.weight"], "row"),
        "self_attention.linear_kv_down_proj.weight": _Rule([p + "self_attn.kv_a_proj_with_mqa.weight"], "replicated"),
        "self_attention.kv_layernorm.weight": _Rule([p + "self_attn.kv_a_layernorm.weight"], "replicated"),
        "self_attention.linear_kv_up_proj.weight": _Rule([p + "self_attn.kv_b_proj.weight"], "row"),
        # dense MLP (DeepSeek first_k_dense layers)
        "mlp.linear_fc1.weight": _Rule([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "gated"),
        "mlp.linear_fc2.weight": _Rule([p + "mlp.down_proj.weight"], "col"),
        # MoE
        "mlp.router.weight": _Rule([p + "mlp.gate.weight"], "replicated"),
        "mlp.router.expert_bias": _Rule([p + "mlp.gate.e_score_correction_bias"], "replicated"),
        "mlp.shared_experts.linear_fc1.weight": _Rule(
            [p + "mlp.shared_experts.gate_proj.weight", p + "mlp.shared_experts.up_proj.weight"], "gated"
        ),
        "mlp.shared_experts.linear_fc2.weight": _Rule([p + "mlp.shared_experts.down_proj.weight"], "col"),
    }
    if rest in simple:
        return simple[rest]
    ex = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$", rest)
    if ex:
        g = ep_rank * experts_per_rank + int(ex.group(1))
        e = f"{p}mlp.experts.{g}."
        if ex.group(2) == "linear_fc1":
            return _Rule([e + "gate_proj.weight", e + "up_proj.weight"], "gated", expert=True)
        return _Rule([e + "down_proj.weight"], "col", expert=True)
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")


def _full_from_hf(rule: _Rule, tensors: list[torch.Tensor], m: ModelConfig) -> torch.Tensor:
    if rule.kind == "qkv":
        return _qkv_merge(m, *tensors)
    if rule.kind == "gated":
        return torch.cat(tensors, dim=0)
    return tensors[0]


def _hf_from_full(rule: _Rule, full: torch.Tensor, m: ModelConfig) -> list[torch.Tensor]:
    if rule.kind == "qkv":
        return _qkv_split(m, full)
    if rule.kind == "gated":
        return list(full.chunk(2, dim=0))
    return [full]


def _shard(rule: _Rule, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    if size == 1 or rule.kind == "replicated":
        return full
    if rule.kind == "gated":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    dim = 1 if rule.kind == "col" else 0
    return full.chunk(size, dim)[rank]


def _unshard(rule: _Rule, parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1 or rule.kind == "replicated":
        return parts[0]
    if rule.kind == "gated":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=1 if rule.kind == "col" else 0)


# ------------------------------------------------------------------ parallel context


def _ctx():
    """(tp size, tp rank, tp group, etp size, etp rank, etp group, ep size, ep rank, ep group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return 1, 0, None, 1, 0, None, 1, 0, None
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_group(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_group(),
    )


def _local_tensors(model, model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters plus the expert-bias buffers, in module order (the same on every rank), under their
    local-spec names (a Transformer Engine learner's names translated by te_spec.te_to_local)."""
    spec = getattr(model, "rz_learner_spec", "local")
    for name, param in model.named_parameters():
        yield te_spec.to_local(name, model_cfg, spec), param
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buf


def _experts_per_rank(model_cfg: ModelConfig, ep: int) -> int:
    return model_cfg.num_experts // ep


def _dequantized(get_raw: Callable[[str], torch.Tensor], has: Callable[[str], bool]) -> Callable[[str], torch.Tensor]:
    """Reads of an FP8 block-quantised release (DeepSeek's format: e4m3 weights with one fp32
    ``<name>_scale_inv`` per 128 x 128 block, the dequantisation factor) come back dequantised in
    fp32 (kernels.fp8.dequantize_weight_blockwise: each e4m3 value times its block's scale); the
    learner keeps master weights in the model dtype either way."""

    def get(k: str) -> torch.Tensor:
        t = get_raw(k)
        if t.dtype == torch.float8_e4m3fn and has(k + "_scale_inv"):
            from kernels.fp8 import dequantize_weight_blockwise

            return dequantize_weight_blockwise(t, get_raw(k + "_scale_inv"))
        return t

    return get


def _read_hf(src) -> Callable[[str], torch.Tensor]:
    if isinstance(src, dict):
        return _dequantized(lambda k: src[k], lambda k: k in src)
    from safetensors import safe_open

    files = sorted(Path(src).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                where[k] = f

    def get(k: str) -> torch.Tensor:
        if k not in where:
            raise KeyError(f"{k!r} missing from the Hugging Face checkpoint {src}")
        with safe_open(str(where[k]), framework="pt") as fh:
            return fh.get_tensor(k)

    return _dequantized(get, lambda k: k in where)


# ------------------------------------------------------------------ public API


def family_learner(model_cfg: ModelConfig):
    """The family's own learner module (kernels.families ``learner``: build_model / load_weights /
    export_weights, weights under the checkpoint's names), or None for Megatron's GPTModel families."""
    name = family(model_cfg.arch).learner
    return None if name is None else load(name)



@torch.no_grad()
def load_hf_into_megatron(model, hf_dir_or_state_dict, model_cfg: ModelConfig) -> None:
    """Copy a Hugging Face checkpoint (a directory of *.safetensors, or a state dict with HF names)
    into the Megatron model; each rank reads only the tensors of its own shard."""
    own = family_learner(model_cfg)
    if own is not None:  # weights named as in the checkpoint (DeepSeek-V4, Kimi): a direct copy
        return own.load_weights(model, hf_dir_or_state_dict)
    tp, tp_rank, _, etp, etp_rank, _, ep, ep_rank, _ = _ctx()
    get = _read_hf(hf_dir_or_state_dict)
    per_rank = _experts_per_rank(model_cfg, ep)
    for name, t in _local_tensors(model, model_cfg):
        rule = _rule(name, model_cfg, ep_rank, per_rank)
        full = _full_from_hf(rule, [get(k) for k in rule.hf_names], model_cfg)
        size, rank = (etp, etp_rank) if rule.expert else (tp, tp_rank)
        shard = _shard(rule, full, size, rank)
        if shard.shape != t.shape:
            raise ValueError(f"{name}: Megatron shard {tuple(t.shape)} vs converted {tuple(shard.shape)} from {rule.hf_names}")
        t.copy_(shard.to(t.dtype))


def _all_gather(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    if size == 1:
        return [t]
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


@torch.no_grad()
def export_hf_weights(model, model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full unsharded tensor) for every weight of the model.

    Collective: every rank of the model-parallel layout must iterate it to the end in step (the
    gathers run inside the iteration). Tensors are gathered with all_gather, so they are complete on
    every rank (callers may rely on global rank 0 only). Sharded tensors are fresh copies; a
    replicated one may share storage with the parameter (clone before modifying). Model dtype; the
    DeepSeek expert bias stays float32 as Megatron keeps it.
    """
    own = family_learner(model_cfg)
    if own is not None:
        yield from own.export_weights(model)
        return
    tp, _, tp_group, etp, _, etp_group, ep, _, ep_group = _ctx()
    per_rank = _experts_per_rank(model_cfg, ep)
    for name, t in _local_tensors(model, model_cfg):
        # ep_rank 0 names the experts of gathered slot r below (global id = r * per_rank + j).
        rule = _rule(name, model_cfg, 0, per_rank)
        if rule.expert:
            full = _unshard(rule, _all_gather(t, etp, etp_group))
            for r, part in enumerate(_all_gather(full, ep, ep_group)):
                r_rule = _rule(name, model_cfg, r, per_rank)
                yield from zip(r_rule.hf_names, _hf_from_full(r_rule, part, model_cfg))
        else:
            parts = _all_gather(t, tp, tp_group) if rule.kind != "replicated" else [t.detach()]
            full = _unshard(rule, parts)
            yield from zip(rule.hf_names, _hf_from_full(rule, full, model_cfg))


@torch.no_grad()
def local_hf_pieces(model, model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...], tuple]]:
    """Yield (HF name, this rank's piece, full HF shape, box) for every weight this rank holds, with
    no collective and no copy of anything this rank does not hold: the box (per dimension
    ``[start, stop)``) says where the piece sits in the full HF tensor (vllm_bridge/weights/reshard.py).

    The same rules as export_hf_weights: a replicated parameter is the whole tensor; a TP-split one
    is the rank's block of each of its HF tensors (fused QKV: the rank's whole query groups are
    one contiguous block of q, of k and of v; gated [gate; up]: a block of each; row / col: a block
    along dim 0 / 1); a routed expert is the whole expert under its global index. Pieces are views
    of the parameters where the layout allows (QKV's split is a copy of the rank's own shard)."""
    if family(model_cfg.arch).learner is not None:
        gpt = [f.name for f in FAMILIES if f.learner is None]
        raise ValueError(f"model.arch={model_cfg.arch}: the resharded weight sync supports {', '.join(gpt[:-1])} and "
                         f"{gpt[-1]} learners (rollout.weight_transport=auto for this one)")
    from types import SimpleNamespace

    tp, tp_rank, _, etp, etp_rank, _, ep, ep_rank, _ = _ctx()
    per_rank = _experts_per_rank(model_cfg, ep)
    for name, t in _local_tensors(model, model_cfg):
        rule = _rule(name, model_cfg, ep_rank, per_rank)
        size, rank = (etp, etp_rank) if rule.expert else (tp, tp_rank)
        t = t.detach()
        if size == 1 or rule.kind == "replicated":
            for hf, part in zip(rule.hf_names, _hf_from_full(rule, t, model_cfg)):
                yield hf, part, tuple(part.shape), tuple((0, s) for s in part.shape)
            continue
        m = model_cfg
        if rule.kind == "qkv":  # the rank's query groups: split them as a model of ng / size groups
            m = SimpleNamespace(num_kv_heads=model_cfg.num_kv_heads // size, head_dim=model_cfg.head_dim,
                                num_attention_heads=model_cfg.num_attention_heads // size)
        dim = 1 if rule.kind == "col" else 0
        for hf, part in zip(rule.hf_names, _hf_from_full(rule, t, m)):
            n = part.shape[dim]
            full = tuple(s * size if d == dim else s for d, s in enumerate(part.shape))
            box = tuple((rank * n, (rank + 1) * n) if d == dim else (0, s) for d, s in enumerate(part.shape))
            yield hf, part, full, box
