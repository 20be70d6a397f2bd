"""DeepSeek-V4: the aligned per-layer functions both engines run, and a full-sequence reference.

The semantics are those of Hugging Face transformers 5.19's ``DeepseekV4ForCausalLM`` (itself a port
of DeepSeek's release): hyper-connection streams around every block, shared-KV multi-query attention
with a per-head sink over a sliding window plus compressed KV entries (heavily compressed layers:
every entry; compressed sparse layers: the lightning indexer's top-k), grouped low-rank output
projection, hash-routed MoE in the first layers and sqrt-softplus scored top-k MoE after. Every op is
a ``kernels`` op, so a token's bits do not depend on batching or on prefill vs decode.

Weights are addressed by the ORIGINAL DeepSeek checkpoint names (``embed.weight``,
``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight`` ...): what the checkpoint
on disk holds, what vLLM loads and what transformers renames on load
(``megatron_rz.learner.tiny_models.deepseek_v4_original_state_dict`` writes a transformers model under them).

The attention is split at the one point where the learner and the rollout engine differ:
:func:`token_state` turns a token's layer input into its query parts and its *payload* (the
per-token rows a later query needs: its key and its compressor/indexer projections); the rollout
engine stores payloads in its paged cache, the learner keeps them for the whole sequence; then
:func:`attend_sequence` answers queries of one sequence from that sequence's payload history.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any, Callable, Mapping, Optional

import torch

import kernels

from . import dsv4_cache
from .qwen3_dsv3 import FP8_CONFIG_KEY, FP8_SUFFIX, FP8WeightCache
from .qwen3_dsv3 import load_state_dict as _load_tensors
from .trace import tap, tracing

Getter = Callable[[str], torch.Tensor]

KV_ENTRIES_KEY = "rz_kv_entries"  # config.json / hf_overrides key of V4Config.kv_entries
KV_ENTRIES_DEFAULT = dsv4_cache.ENTRIES_DEFAULT  # "fp8": what stock vLLM's V4 stores

# Layer kinds (transformers' layer_types; DeepSeek's config spells them as per-layer compress ratios).
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclasses.dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    sliding_window: int
    layer_kinds: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # 0 for sliding layers
    num_hash_layers: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    inv_freq_main: torch.Tensor  # float64 [rope_dim // 2]
    inv_freq_compress: torch.Tensor
    tie_word_embeddings: bool = False
    arch: str = "deepseek_v4"
    # Tensor parallelism (the aligned vLLM class at tensor_parallel_size > 1): this rank's shard and
    # its collectives; ``num_heads`` is then the rank's local head count. None: the whole model.
    tp: Optional["TPShard"] = None
    # "blockwise": the FP8 linears (:data:`FP8_LINEARS`) run as blockwise FP8 GEMMs (kernels/fp8.py);
    # config key ``rz_fp8`` (kernels.models.qwen3_dsv3.FP8_CONFIG_KEY), recipe ``model.fp8``.
    fp8: str = "none"
    # How compressed entries are stored and read (config key ``rz_kv_entries``, :data:`KV_ENTRIES_KEY`):
    # "fp8" (default, stock vLLM's fp8_ds_mla format: kernels/kv_fp8.py; both engines attend over the
    # dequantised entries) or "model" (the entries in the model dtype, as transformers' reference keeps them).
    kv_entries: str = KV_ENTRIES_DEFAULT

    def payload_width(self, layer: int) -> int:
        """Floats cached per token in layer ``layer`` (key, then compressor and indexer rows)."""
        kind = self.layer_kinds[layer]
        D, Di = self.head_dim, self.index_head_dim
        if kind == SLIDING:
            return D
        if kind == HCA:
            return D + 2 * D
        return D + 4 * D + 4 * Di

    @property
    def max_payload_width(self) -> int:
        return max(self.payload_width(i) for i in range(self.num_layers))


@dataclasses.dataclass(frozen=True)
class TPShard:
    """One tensor-parallel rank of an aligned V4 engine (docs/tp.md "DeepSeek-V4").

    * heads: rank ``rank`` of ``size`` holds query heads ``rank * H/size ..`` (``wq_b`` rows,
      ``attn_sink``); the shared KV head, the compressors and the indexer are replicated;
    * grouped output: rank r holds rows ``r * G*R/size ..`` of ``wo_a`` (whole groups when G % size
      == 0; otherwise part of one group, whose heads are then gathered from the other ranks) and the
      same K block of ``wo_b``, which is row-parallel (``row_parallel``: the rank's 8 / size K
      segments' fp32 partials, all-gathered, added in segment order);
    * routed experts ``experts`` (expert parallel): other ranks' slots stay exact zeros and
      ``reduce`` (an all-reduce) fills them; shared experts replicated.

    ``row_parallel(x, w, name)``: ``x [T, K/size]`` against the rank's ``w(name) [N, K/size]``; in
    blockwise FP8 the rank's quantised shard ``w(name + FP8_SUFFIX)`` and its segments' FP8 chains."""

    size: int
    rank: int
    experts: range
    row_parallel: Callable[[torch.Tensor, Callable, str], torch.Tensor]
    gather_heads: Callable[[torch.Tensor], torch.Tensor]  # [T, H/size, D] -> [T, H, D] (rank order)
    reduce: Callable[[torch.Tensor], torch.Tensor]  # sum over ranks (one non-zero term per element)


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _inv_freq(cfg: Any, kind: str, rope_dim: int, theta: float) -> torch.Tensor:
    rp = _get(cfg, "rope_parameters") or {}
    params = rp.get(kind) if isinstance(rp, Mapping) else None
    if isinstance(params, Mapping) and params.get("rope_type", "default") not in ("default", None):
        # YaRN etc. (full-size compress layers): the transformers formula, computed once here so both
        # engines use the same table.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, None, layer_type=kind)
        return inv.to(torch.float64)
    return kernels.rope_inv_freq(rope_dim, theta)


def v4_config(config: Any) -> V4Config:
    """From a transformers DeepseekV4Config, a vLLM hf_config or a config.json dict / directory."""
    if isinstance(config, (str, os.PathLike)):
        return _v4_config_of_dir(os.path.abspath(os.fspath(config)), os.path.getmtime(os.path.join(config, "config.json")))
    head_dim = int(_get(config, "head_dim"))
    rope_dim = _get(config, "qk_rope_head_dim")
    if rope_dim is None:
        rope_dim = int(head_dim * float(_get(config, "partial_rotary_factor", default=1.0)))
    layers = int(_get(config, "num_hidden_layers"))
    rates = {CSA: 4, HCA: 128, **(_get(config, "compress_rates") or {})}
    kinds = _get(config, "layer_types")
    if kinds is None:  # DeepSeek's spelling: a compress ratio per layer, 0 = sliding window only
        by_ratio = {0: SLIDING, int(rates[CSA]): CSA, int(rates[HCA]): HCA}
        kinds = [by_ratio[int(r)] for r in (_get(config, "compress_ratios") or [0] * layers)]
    kinds = tuple(kinds)[:layers]
    ratios = tuple(0 if k == SLIDING else int(rates[k]) for k in kinds)
    mlp_kinds = _get(config, "mlp_layer_types")
    n_hash = (sum(1 for k in mlp_kinds if k == "hash_moe") if mlp_kinds is not None
              else int(_get(config, "num_hash_layers", default=3)))
    rp = _get(config, "rope_parameters") or {}
    theta_main = float((rp.get("main") or {}).get("rope_theta") or _get(config, "rope_theta", default=10000.0))
    theta_comp = float((rp.get("compress") or {}).get("rope_theta") or _get(config, "compress_rope_theta",
                                                                              default=160000.0))
    fp8 = str(_get(config, FP8_CONFIG_KEY, default="none"))
    if fp8 not in ("none", "blockwise"):
        raise ValueError(f"{FP8_CONFIG_KEY}={fp8!r}: expected 'none' or 'blockwise'")
    kv_entries = str(_get(config, KV_ENTRIES_KEY, default=KV_ENTRIES_DEFAULT))
    if kv_entries not in dsv4_cache.ENTRIES_FORMATS:
        raise ValueError(f"{KV_ENTRIES_KEY}={kv_entries!r}: expected one of {', '.join(dsv4_cache.ENTRIES_FORMATS)}")
    score = _get(config, "scoring_func", default="sqrtsoftplus")
    if score != "sqrtsoftplus":
        raise NotImplementedError(f"aligned DeepSeek-V4: scoring_func {score!r} (only sqrtsoftplus)")
    return V4Config(
        vocab_size=int(_get(config, "vocab_size")),
        hidden_size=int(_get(config, "hidden_size")),
        num_layers=layers,
        num_heads=int(_get(config, "num_attention_heads")),
        head_dim=head_dim,
        rope_dim=int(rope_dim),
        q_lora_rank=int(_get(config, "q_lora_rank")),
        o_groups=int(_get(config, "o_groups")),
        o_lora_rank=int(_get(config, "o_lora_rank")),
        num_experts=int(_get(config, "n_routed_experts", "num_local_experts")),
        top_k=int(_get(config, "num_experts_per_tok")),
        moe_intermediate_size=int(_get(config, "moe_intermediate_size", "intermediate_size")),
        n_shared_experts=int(_get(config, "n_shared_experts", default=1)),
        routed_scaling_factor=float(_get(config, "routed_scaling_factor", default=1.0)),
        swiglu_limit=float(_get(config, "swiglu_limit", default=10.0)),
        hc_mult=int(_get(config, "hc_mult")),
        hc_sinkhorn_iters=int(_get(config, "hc_sinkhorn_iters", default=20)),
        hc_eps=float(_get(config, "hc_eps", default=1e-6)),
        rms_norm_eps=float(_get(config, "rms_norm_eps", default=1e-6)),
        sliding_window=int(_get(config, "sliding_window", default=128)),
        layer_kinds=kinds,
        compress_ratios=ratios,
        num_hash_layers=n_hash,
        index_n_heads=int(_get(config, "index_n_heads")),
        index_head_dim=int(_get(config, "index_head_dim")),
        index_topk=int(_get(config, "index_topk")),
        inv_freq_main=_inv_freq(config, "main", int(rope_dim), theta_main),
        inv_freq_compress=_inv_freq(config, "compress", int(rope_dim), theta_comp),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", default=False)),
        fp8=fp8,
        kv_entries=kv_entries,
    )


@functools.lru_cache(maxsize=16)
def _v4_config_of_dir(path: str, mtime: float) -> V4Config:  # mtime: a rewritten config is re-read
    from transformers import AutoConfig

    return v4_config(AutoConfig.from_pretrained(path))


# --------------------------------------------------------------------------------------------------
# Weights by name
# --------------------------------------------------------------------------------------------------

def parameter_shapes(c: V4Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weight by original name -> (shape, kind); kind "model" (the model dtype), "fp32"
    (hyper-connection, sink, window position bias and router bias: fp32 in DeepSeek's checkpoints)
    or "int64" (the hash-routing table). Both engines build their parameter trees from this."""
    H, D, Hn, n = c.hidden_size, c.head_dim, c.num_heads, c.hc_mult
    Di, Hi, E, I = c.index_head_dim, c.index_n_heads, c.num_experts, c.moe_intermediate_size
    hc = (2 + n) * n
    out: dict[str, tuple[tuple[int, ...], str]] = {"embed.weight": ((c.vocab_size, H), "model")}

    def compressor(p: str, width: int, ratio: int, d: int) -> None:
        out[p + "wkv.weight"] = ((width, H), "model")
        out[p + "wgate.weight"] = ((width, H), "model")
        out[p + "ape"] = ((ratio, width), "fp32")
        out[p + "norm.weight"] = ((d,), "model")

    def ffn(p: str, inter: int) -> None:
        out[p + "w1.weight"] = ((inter, H), "model")
        out[p + "w2.weight"] = ((H, inter), "model")
        out[p + "w3.weight"] = ((inter, H), "model")

    for i in range(c.num_layers):
        p = f"layers.{i}."
        out[p + "attn_norm.weight"] = ((H,), "model")
        out[p + "ffn_norm.weight"] = ((H,), "model")
        for which in ("attn", "ffn"):
            out[p + f"hc_{which}_fn"] = ((hc, n * H), "fp32")
            out[p + f"hc_{which}_base"] = ((hc,), "fp32")
            out[p + f"hc_{which}_scale"] = ((3,), "fp32")
        a = p + "attn."
        out[a + "wq_a.weight"] = ((c.q_lora_rank, H), "model")
        out[a + "q_norm.weight"] = ((c.q_lora_rank,), "model")
        out[a + "wq_b.weight"] = ((Hn * D, c.q_lora_rank), "model")
        out[a + "wkv.weight"] = ((D, H), "model")
        out[a + "kv_norm.weight"] = ((D,), "model")
        out[a + "wo_a.weight"] = ((c.o_groups * c.o_lora_rank, Hn * D // c.o_groups), "model")
        out[a + "wo_b.weight"] = ((H, c.o_groups * c.o_lora_rank), "model")
        out[a + "attn_sink"] = ((Hn,), "fp32")
        kind, ratio = c.layer_kinds[i], c.compress_ratios[i]
        if kind in (CSA, HCA):
            compressor(a + "compressor.", 2 * D if kind == CSA else D, ratio, D)
        if kind == CSA:
            compressor(a + "indexer.compressor.", 2 * Di, ratio, Di)
            out[a + "indexer.wq_b.weight"] = ((Hi * Di, c.q_lora_rank), "model")
            out[a + "indexer.weights_proj.weight"] = ((Hi, H), "model")
        f = p + "ffn."
        out[f + "gate.weight"] = ((E, H), "model")
        if i < c.num_hash_layers:
            out[f + "gate.tid2eid"] = ((c.vocab_size, c.top_k), "int64")
        else:
            out[f + "gate.bias"] = ((E,), "fp32")
        for e in range(E):
            ffn(f + f"experts.{e}.", I)
        if c.n_shared_experts:
            ffn(f + "shared_experts.", I * c.n_shared_experts)
    out["norm.weight"] = ((H,), "model")
    out["hc_head_fn"] = ((n, n * H), "fp32")
    out["hc_head_base"] = ((n,), "fp32")
    out["hc_head_scale"] = ((1,), "fp32")
    if not c.tie_word_embeddings:
        out["head.weight"] = ((c.vocab_size, H), "model")
    return out


def build_parameter_tree(root: "torch.nn.Module", c: V4Config, make: Callable[[str, tuple, str], Any],
                         prefix: str = "", skip: tuple[str, ...] = (),
                         include: Optional[Callable[[str], bool]] = None) -> None:
    """Register ``make(name, shape, kind)`` (a Parameter, or a tensor then registered as a buffer)
    under ``root`` for every original name that starts with ``prefix`` (at the name relative to it),
    whose relative name starts with none of ``skip`` and that ``include`` accepts; intermediate
    modules are created."""
    add_parameter_tree(root, parameter_shapes(c), make, prefix, skip, include)


def add_parameter_tree(root, shapes: dict, make, prefix: str = "", skip: tuple[str, ...] = (),
                       include: Optional[Callable[[str], bool]] = None) -> None:
    """The module tree of ``shapes`` ({name: (shape, kind)}) under ``root``: see build_parameter_tree."""
    from torch import nn

    for name, (shape, kind) in shapes.items():
        if not name.startswith(prefix) or name[len(prefix):].startswith(skip or ("\0",)):
            continue
        if include is not None and not include(name):
            continue
        *path, leaf = name[len(prefix):].split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        t = make(name, shape, kind)
        if isinstance(t, nn.Parameter):
            mod.register_parameter(leaf, t)
        else:
            mod.register_buffer(leaf, t)


# --------------------------------------------------------------------------------------------------
# The FP8 form of a checkpoint
# --------------------------------------------------------------------------------------------------

# DeepSeek ships V4 with block-FP8 linears: ``X.weight`` in e4m3 and ``X.scale`` beside it, one
# dequantisation factor per 128 x 128 block (float32, or e8m0 in the FP4-expert release), and stock
# vLLM's V4 class needs that form on CUDA (its wo_a runs DeepGEMM's FP8 einsum). The aligned classes,
# the learner and the reference hold the weights in the model dtype: they take such a checkpoint
# through :func:`dequantized_weights` (``X.weight = e4m3 * scale``, one fp32 product per element, exact
# for power-of-two scales). The FP4 experts of DeepSeek-V4-Flash (packed int8) are not read.
CKPT_SCALE_SUFFIX = ".scale"
_CKPT_FP8_DTYPES = (torch.float8_e4m3fn,)


def dequantize_block_fp8(wq: torch.Tensor, ws: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``wq[N, K]`` e4m3 times its ``ws[ceil(N/128), ceil(K/128)]`` block scales, in fp32 (or ``dtype``)."""
    from kernels.fp8 import BLOCK as B, dequantize_weight_blockwise

    N, K = wq.shape
    if tuple(ws.shape) != (-(-N // B), -(-K // B)):
        raise ValueError(f"FP8 weight {tuple(wq.shape)} has scales {tuple(ws.shape)}; expected one per "
                         f"{B} x {B} block: {(-(-N // B), -(-K // B))}")
    ws = ws.to(torch.float32)
    if N % B == 0 and K % B == 0:  # one broadcast multiply: the same products as the general form
        w = (wq.to(torch.float32).view(N // B, B, K // B, B) * ws[:, None, :, None]).view(N, K)
    else:
        w = dequantize_weight_blockwise(wq, ws)
    return w if dtype is None else w.to(dtype)


def dequantized_weights(items, dtype: Optional[torch.dtype] = None, device=None):
    """``(name, tensor)`` pairs with each e4m3 ``X.weight`` and its ``X.scale`` (either order, anywhere in
    the stream) replaced by one dequantised ``X.weight`` (fp32, or ``dtype``; computed on ``device`` when
    given); everything else passes through unchanged. A weight without its scale, or a scale without
    an e4m3 weight, is an error once the stream ends."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}

    def deq(base: str, wq: torch.Tensor, ws: torch.Tensor):
        if device is not None:
            wq, ws = wq.to(device), ws.to(device)
        return base + ".weight", dequantize_block_fp8(wq, ws, dtype)

    for name, t in items:
        if name.endswith(".weight") and t.dtype in _CKPT_FP8_DTYPES:
            base = name[: -len(".weight")]
            if base in scales:
                yield deq(base, t, scales.pop(base))
            else:
                weights[base] = t
        elif name.endswith(CKPT_SCALE_SUFFIX):
            base = name[: -len(CKPT_SCALE_SUFFIX)]
            if base in weights:
                yield deq(base, weights.pop(base), t)
            else:
                scales[base] = t
        else:
            yield name, t
    if weights or scales:
        raise ValueError(f"FP8 checkpoint: {len(weights)} e4m3 weights without a {CKPT_SCALE_SUFFIX!r} "
                         f"(e.g. {sorted(weights)[:2]}), {len(scales)} scales without an e4m3 weight "
                         f"(e.g. {sorted(scales)[:2]})")


def load_state_dict(hf_dir_or_state_dict) -> dict:
    """The checkpoint's tensors by original name (cloned), an FP8-form checkpoint dequantised to the
    dtype of its unquantised weights (``embed.weight``'s; fp32 without one)."""
    sd = _load_tensors(hf_dir_or_state_dict)
    if not any(k.endswith(CKPT_SCALE_SUFFIX) for k in sd):
        return sd
    dtype = sd["embed.weight"].dtype if "embed.weight" in sd else torch.float32
    return dict(dequantized_weights(sd.items(), dtype))


# --------------------------------------------------------------------------------------------------
# Per-layer functions (w = getter relative to "layers.{i}.")
# --------------------------------------------------------------------------------------------------


# Blockwise FP8 (``c.fp8 == "blockwise"``; docs/tp.md "FP8"): the big projections, by name relative to
# ``layers.{i}.``. Everything else stays in the model dtype: the compressors' ``wkv`` / ``wgate`` and
# the indexer's ``weights_proj`` (their rows are pooled / gated / summed into selection scores, like
# the router), V4.1's ``indexer.wk`` and engram, the router gate, hyper-connections, norms,
# embedding and head.
FP8_LINEARS = re.compile(r"^(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.(experts\.\d+|shared_experts)\.w[123])"
                         r"\.weight$")


def fp8_problems(c: V4Config, tp: int = 1) -> list[tuple[str, str]]:
    """(recipe key, what fails) that keep blockwise FP8 from running this V4 model bitwise on an
    aligned engine of ``tp`` ranks (``tp=1``: the learner and a one-rank engine). [] when it can.

    * ``wo_a`` (any tp): one ``[G*R, H*D/G]`` tensor of 128x128 blocks whose group ``g`` uses rows
      ``g*R ..``; a group's GEMM is the block-FP8 GEMM of its row slice only when the slice starts
      and ends on 128-row blocks, i.e. ``o_lora_rank % 128 == 0``. (Its K, the group width, needs
      nothing: K blocks never split there.)
    * tp > 1: ``wo_b`` is row-parallel: its K = ``o_groups * o_lora_rank`` must be a multiple of
      8 x 128 (8 segment chains of whole blocks; then every rank's ``wo_a`` rows, ``G*R/tp``, are
      whole blocks too); ``wq_b`` is column-parallel: its rows per rank, ``H/tp * D``, must be whole
      128-row blocks. Routed experts are split whole and everything else replicated, so their K and
      N need nothing (shapes that are not multiples of 128 get partial edge blocks, as the format's
      ``ceil`` block grid has)."""
    from kernels.fp8 import BLOCK as B

    out = []
    if c.o_lora_rank % B:
        out.append(("model.o_lora_rank", f"o_lora_rank={c.o_lora_rank} is not a multiple of {B} (wo_a's output "
                    f"groups must start on {B}-row weight blocks)"))
    if tp > 1:
        S = kernels.ROW_PARALLEL_K_SEGMENTS
        K = c.o_groups * c.o_lora_rank
        if K % (S * B):
            out.append(("model.o_lora_rank", f"o_groups * o_lora_rank={K} (the row-parallel FP8 K of wo_b) is not "
                        f"a multiple of {S} x {B} = {S * B}"))
        rows = c.num_heads * c.head_dim
        if rows % tp or (rows // tp) % B:
            out.append(("model.num_attention_heads", f"num_attention_heads * head_dim={rows} gives {rows // tp} wq_b "
                        f"rows per rank, not a multiple of the {B}-row weight block"))
    return out


def quantizing_getter(w: Getter) -> Getter:
    """``w`` extended with ``name + FP8_SUFFIX`` -> ``(wq, ws)`` of ``w(name)`` quantised now (the
    learner: its master weights change every step; the engine and the reference cache instead,
    :class:`~kernels.models.qwen3_dsv3.FP8WeightCache`). Same bits either way."""

    def get(name: str):
        if name.endswith(FP8_SUFFIX):
            with torch.no_grad():
                return kernels.quantize_weight_blockwise(w(name[: -len(FP8_SUFFIX)]).detach())
        return w(name)

    return get


def project(c: V4Config, w: Getter, x: torch.Tensor, name: str, *, k_segments: int = 1,
            rows: Optional[tuple[int, int]] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x @ w(name)[a:b].T`` (``rows=(a, b)``; all rows by default), rounded to ``out_dtype`` or
    ``x.dtype``. ``c.fp8 == "blockwise"`` and ``name`` one of :data:`FP8_LINEARS`:
    ``kernels.fp8_linear`` with the quantised weight ``w(name + FP8_SUFFIX)`` (its 128-row-block
    slice for ``rows``; the master weight passed for the straight-through gradient); a row-parallel
    caller (``k_segments > 1``) gets ``kernels.fp8.row_parallel_k_segments(K)`` chains (8 when
    K % 1024 == 0, else the single chain). Otherwise ``kernels.linear(..., k_segments)``."""
    weight = w(name)
    if rows is not None:
        weight = weight[rows[0] : rows[1]]
    odt = out_dtype or x.dtype
    if c.fp8 != "blockwise" or not FP8_LINEARS.match(name):
        return kernels.linear(x, weight, out_dtype=out_dtype, k_segments=k_segments)
    from kernels.fp8 import BLOCK as B, row_parallel_k_segments

    wq, ws = w(name + FP8_SUFFIX)
    if rows is not None:
        a, b = rows
        if a % B or (b % B and b != wq.shape[0]):
            raise ValueError(f"{name}: FP8 rows {a}:{b} do not start and end on {B}-row weight blocks")
        wq, ws = wq[a:b], ws[a // B : -(-b // B)]
    segs = 1 if k_segments == 1 else row_parallel_k_segments(x.shape[-1])
    return kernels.fp8_linear(x, wq, ws, out_dtype=odt, weight=weight, k_segments=segs)


def fp8_getter(c: V4Config, w: Getter, cache: Optional[FP8WeightCache], prefix: str) -> Getter:
    """The getter the per-layer functions see: ``w`` itself unquantised; in FP8 ``w`` with
    ``name + FP8_SUFFIX`` from ``cache`` (keyed ``prefix + name``), or quantised per call without one."""
    if c.fp8 != "blockwise":
        return w
    return quantizing_getter(w) if cache is None else cache.getter(w, prefix)


def lookup(module: "torch.nn.Module", name: str) -> torch.Tensor:
    """The parameter or buffer at dotted ``name`` under ``module``."""
    mod, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(mod) if mod else module, leaf)


def rope_tables(c: V4Config, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, rope_dim // 2]`` fp32: sliding layers use the main base, compressed layers (and
    their compressor entries and indexer queries) the compress base."""
    inv = c.inv_freq_main if c.layer_kinds[layer] == SLIDING else c.inv_freq_compress
    return kernels.rope_cos_sin(positions, c.rope_dim, inv_freq=inv)


def _rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x[T, H, D]``."""
    r = 2 * cos.shape[-1]
    D = x.shape[-1]
    return torch.cat([x[..., : D - r], kernels.apply_rope(x[..., D - r :], cos, sin, style="interleaved")], dim=-1)


rope_tail = _rope_tail  # public name (DeepSeek-V4.1's compressed entries, kernels.models.dsv41)


def token_state(c: V4Config, w: Getter, layer: int, x: torch.Tensor, positions: torch.Tensor) -> dict:
    """Per-token attention inputs of layer ``layer`` for ``x[T, hidden]`` (the normed block input):
    ``q [T, H, D]``, ``payload [T, payload_width]`` and, in compressed sparse layers, the indexer's
    ``idx_q [T, Hi, Di]`` and ``idx_w [T, Hi]`` fp32. Row by row: no token sees another here."""
    T = x.shape[0]
    H, D = c.num_heads, c.head_dim
    kind = c.layer_kinds[layer]
    cos, sin = rope_tables(c, layer, positions)
    if tracing():  # the tables as one tap (the cat only while the localiser records)
        tap(f"layer{layer}.attn_rope", torch.cat([cos, sin], dim=-1))
    q_a = tap(f"layer{layer}.attn_q_a", project(c, w, x, "attn.wq_a.weight"))
    q_res = tap(f"layer{layer}.attn_q_res", kernels.rms_norm(q_a, w("attn.q_norm.weight"), c.rms_norm_eps))
    q = tap(f"layer{layer}.attn_q_b", project(c, w, q_res, "attn.wq_b.weight")).view(T, H, D)
    q = tap(f"layer{layer}.attn_q", _rope_tail(kernels.rms_norm(q, None, c.rms_norm_eps), cos, sin))
    kv = kernels.rms_norm(project(c, w, x, "attn.wkv.weight"), w("attn.kv_norm.weight"), c.rms_norm_eps)
    kv = tap(f"layer{layer}.attn_kv", _rope_tail(kv.view(T, 1, D), cos, sin).view(T, D))
    parts = [kv]
    out: dict = {"q": q}
    if kind in (CSA, HCA):  # (other kinds: DeepSeek-V4.1's compressed layers, kernels.models.dsv41)
        parts += [kernels.linear(x, w("attn.compressor.wkv.weight")), kernels.linear(x, w("attn.compressor.wgate.weight"))]
    if kind == CSA:
        Hi, Di = c.index_n_heads, c.index_head_dim
        parts += [kernels.linear(x, w("attn.indexer.compressor.wkv.weight")),
                  kernels.linear(x, w("attn.indexer.compressor.wgate.weight"))]
        iq = project(c, w, q_res, "attn.indexer.wq_b.weight").view(T, Hi, Di)
        out["idx_q"] = tap(f"layer{layer}.attn_idx_q", _rope_tail(iq, cos, sin))
        out["idx_w"] = tap(f"layer{layer}.attn_idx_w", kernels.linear(x, w("attn.indexer.weights_proj.weight"),
                                                                       out_dtype=torch.float32) * (Hi ** -0.5))
    out["payload"] = torch.cat([p.to(x.dtype) for p in parts], dim=-1)
    return out


def _entries(c: V4Config, w: Getter, layer: int, kv: torch.Tensor, gate: torch.Tensor, prefix: str,
             overlap: bool, dtype: torch.dtype, first: int = 0) -> torch.Tensor:
    """Compressed entries of one sequence: pooled, normed, RoPE at the window's first position
    (compress base). ``kv, gate`` are the rows from token ``ratio * first`` on (``ratio * (first - 1)``
    with ``overlap`` and ``first > 0``: the predecessor window entry ``first`` also pools); the
    result is entries ``first, first + 1, ..`` of the sequence, one per complete window, each bitwise
    what the whole sequence gives (every op is per entry)."""
    ratio = c.compress_ratios[layer]
    pooled = kernels.compress_windows(kv, gate, w(prefix + "ape"), ratio, overlap=overlap).to(dtype)
    if overlap and first > 0:
        pooled = pooled[1:]  # the predecessor window: its own predecessor is not in these rows
    normed = kernels.rms_norm(pooled, w(prefix + "norm.weight"), c.rms_norm_eps)
    pos = (torch.arange(normed.shape[0], device=normed.device) + first) * ratio
    cos, sin = kernels.rope_cos_sin(pos, c.rope_dim, inv_freq=c.inv_freq_compress)
    return _rope_tail(normed.unsqueeze(1), cos, sin).squeeze(1)


def _pooled_entries(c: V4Config, w: Getter, layer: int, rows: torch.Tensor, dtype: torch.dtype,
                    first: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The entries as pooled, normed and rotated, before they are stored (:func:`layer_entries`)."""
    D, Di = c.head_dim, c.index_head_dim
    kind = c.layer_kinds[layer]
    width = 2 * D if kind == CSA else D
    ckv, cgate = rows[:, D : D + width], rows[:, D + width : D + 2 * width]
    comp = _entries(c, w, layer, ckv, cgate, "attn.compressor.", kind == CSA, dtype, first)
    if kind != CSA:
        return comp, None
    o = D + 2 * width
    ikv, igate = rows[:, o : o + 2 * Di], rows[:, o + 2 * Di : o + 4 * Di]
    return comp, _entries(c, w, layer, ikv, igate, "attn.indexer.compressor.", True, dtype, first)


def layer_entries(c: V4Config, w: Getter, layer: int, rows: torch.Tensor, dtype: torch.dtype,
                  first: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(entries [n, D], index keys [n, Di] or None)`` of a compressed layer from payload ``rows``
    (``>= payload_width`` columns) starting at token ``ratio * first`` (compressed sparse layers,
    ``first > 0``: ``ratio * (first - 1)``): entries ``first ..`` of the complete windows in them, as
    the attention reads them: with ``c.kv_entries == "fp8"`` each entry quantised after its RoPE and
    dequantised (kernels/kv_fp8.py, stock vLLM's cache format; gradient straight through), exactly
    what :func:`unpack_entries` gives from :func:`stored_entries`' bytes."""
    comp, idx = _pooled_entries(c, w, layer, rows, dtype, first)
    if c.kv_entries != "fp8":
        return comp, idx
    from kernels import kv_fp8

    return (kv_fp8.fake_quantize_entry(comp, c.rope_dim),
            None if idx is None else kv_fp8.fake_quantize_index_key(idx))


def entry_bytes(c: V4Config, layer: int, dtype: torch.dtype) -> int:
    """Bytes of one stored entry of compressed layer ``layer`` (main entry, then its indexer key on
    compressed sparse layers): :func:`kernels.models.dsv4_cache.entry_bytes`."""
    b = torch.empty(0, dtype=dtype).element_size()
    return dsv4_cache.entry_bytes(c.compress_ratios[layer], c.head_dim, c.index_head_dim, c.rope_dim, b,
                                  c.kv_entries, csa=c.layer_kinds[layer] == CSA)


def stored_entries(c: V4Config, w: Getter, layer: int, rows: torch.Tensor, dtype: torch.dtype,
                   first: int = 0) -> torch.Tensor:
    """The bytes a cache stores for the entries :func:`layer_entries` gives (same arguments):
    ``uint8 [n, entry_bytes]``; "fp8": :func:`kernels.kv_fp8.pack_entry` then
    :func:`~kernels.kv_fp8.pack_index_key`; "model": the values' own bytes."""
    comp, idx = _pooled_entries(c, w, layer, rows, dtype, first)
    return pack_entries(c, comp, idx)


def pack_entries(c: V4Config, comp: torch.Tensor, idx: Optional[torch.Tensor]) -> torch.Tensor:
    """Stored bytes of pooled entries ``comp`` (and index keys ``idx``) in ``c.kv_entries``' format."""
    with torch.no_grad():
        if c.kv_entries == "fp8":
            from kernels import kv_fp8

            parts = [kv_fp8.pack_entry(*kv_fp8.quantize_entry(comp, c.rope_dim))]
            if idx is not None:
                parts.append(kv_fp8.pack_index_key(*kv_fp8.quantize_index_key(idx)))
        else:
            parts = [t.detach().contiguous().view(torch.uint8) for t in (comp, idx) if t is not None]
        return torch.cat(parts, dim=1)


def unpack_entries(c: V4Config, layer: int, b: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`stored_entries`' bytes ``uint8 [n, >= entry_bytes]`` -> the entries (and index keys) the
    attention reads, in ``dtype``: bitwise :func:`layer_entries` of the same rows."""
    D, Di = c.head_dim, c.index_head_dim
    csa = c.layer_kinds[layer] == CSA
    if c.kv_entries == "fp8":
        from kernels import kv_fp8

        nm = kv_fp8.entry_bytes(D, c.rope_dim)
        comp = kv_fp8.dequantize_entry(*kv_fp8.unpack_entry(b[:, :nm], D, c.rope_dim), dtype)
        if not csa:
            return comp, None
        idx = kv_fp8.dequantize_index_key(*kv_fp8.unpack_index_key(b[:, nm : nm + kv_fp8.index_key_bytes(Di)], Di),
                                          dtype)
        return comp, idx
    from kernels.kv_fp8 import bytes_as

    nb = torch.empty(0, dtype=dtype).element_size()
    vals = bytes_as(b[:, : (D + (Di if csa else 0)) * nb], dtype)
    return vals[:, :D], (vals[:, D:] if csa else None)


def attend_entries(c: V4Config, w: Getter, layer: int, state: dict, positions: torch.Tensor, keys: torch.Tensor,
                   comp: Optional[torch.Tensor], index_keys: Optional[torch.Tensor]) -> torch.Tensor:
    """Queries of ONE sequence against its per-token ``keys[L, D]`` (row j = position j; rows outside
    every query's window may be zeros) and its compressed entries ``comp`` / ``index_keys`` (entries
    0 .. n-1, at least every entry complete before the last query). Returns ``[T, H, D]``."""
    D, Di = c.head_dim, c.index_head_dim
    kind, r = c.layer_kinds[layer], c.compress_ratios[layer]
    keep = None
    if kind in (CSA, HCA):
        n_ready = torch.div(positions + 1, r, rounding_mode="floor")
        if kind == HCA:
            keep = torch.arange(comp.shape[0], device=comp.device)[None, :] < n_ready[:, None]
        else:
            scores = kernels.indexer_scores(state["idx_q"], state["idx_w"], index_keys, Di ** -0.5)
            keep = kernels.select_entries(scores, n_ready, c.index_topk)
    else:
        comp = None
    return kernels.sink_attention(state["q"], positions, keys, w("attn.attn_sink"), D ** -0.5,
                                  window=c.sliding_window, comp=comp, comp_keep=keep)


def attend_sequence(c: V4Config, w: Getter, layer: int, state: dict, positions: torch.Tensor,
                    history: torch.Tensor) -> torch.Tensor:
    """Queries of ONE sequence (``state`` rows at ``positions``) against that sequence's payload
    ``history[L, >= payload_width]`` (row j = the token at position j; every query position < L).
    Returns ``[T, H, D]``."""
    comp = index_keys = None
    if c.layer_kinds[layer] in (CSA, HCA):
        comp, index_keys = layer_entries(c, w, layer, history, state["q"].dtype)
    return attend_entries(c, w, layer, state, positions, history[:, : c.head_dim], comp, index_keys)


def attn_output(c: V4Config, w: Getter, layer: int, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Undo the value's RoPE at the query position, grouped low-rank projection, then ``wo_b``."""
    T = o.shape[0]
    cos, sin = rope_tables(c, layer, positions)
    o = _rope_tail(o, cos, -sin)
    G, R = c.o_groups, c.o_lora_rank
    wo_a = w("attn.wo_a.weight")
    if c.tp is not None:
        return _attn_output_tp(c, w, o, wo_a)
    grouped = o.reshape(T, G, -1)
    mid = torch.cat([project(c, w, grouped[:, g], "attn.wo_a.weight", rows=(g * R, (g + 1) * R)) for g in range(G)],
                    dim=-1)
    return project(c, w, mid, "attn.wo_b.weight", k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)


def _attn_output_tp(c: V4Config, w: Getter, o: torch.Tensor, wo_a: torch.Tensor) -> torch.Tensor:
    """The grouped output on one TP rank (:class:`TPShard`): ``o [T, H/size, D]`` the rank's heads
    (RoPE undone), ``wo_a`` its rows ``lo .. lo + n`` of the full ``[G * R, H * D / G]``. Each
    output row is computed from its whole group's heads with the TP=1 K chain (``kernels.linear`` is
    invariant in N), so ``mid`` is exactly the rank's K block of the TP=1 ``mid``."""
    tp = c.tp
    T = o.shape[0]
    G, R = c.o_groups, c.o_lora_rank
    n = G * R // tp.size
    lo = tp.rank * n
    hpg = c.num_heads * tp.size // G  # heads per group
    if G % tp.size == 0:  # the rank's rows are its own heads' groups
        src, head0 = o, tp.rank * c.num_heads
    else:  # a group spans ranks: every rank needs that group's heads
        src, head0 = tp.gather_heads(o.contiguous()), 0
    parts = []
    for g in range(lo // R, (lo + n - 1) // R + 1):
        a, b = max(lo, g * R), min(lo + n, (g + 1) * R)
        x = src[:, g * hpg - head0 : (g + 1) * hpg - head0].reshape(T, -1)
        parts.append(project(c, w, x, "attn.wo_a.weight", rows=(a - lo, b - lo)))
    mid = torch.cat(parts, dim=-1)
    return tp.row_parallel(mid, w, "attn.wo_b.weight")


def expert(c: V4Config, w: Getter, x: torch.Tensor, prefix: str) -> torch.Tensor:
    """SwiGLU expert with V4's clamp: ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))``."""
    h = kernels.swiglu_clamped(project(c, w, x, prefix + "w1.weight"), project(c, w, x, prefix + "w3.weight"),
                               c.swiglu_limit)
    if c.fp8 == "blockwise":  # experts split whole, shared expert replicated: never K-split, single chain (V3's rule)
        return project(c, w, h, prefix + "w2.weight")
    return kernels.linear(h, w(prefix + "w2.weight"), k_segments=kernels.ROW_PARALLEL_K_SEGMENTS)


def route(c: V4Config, w: Getter, layer: int, x: torch.Tensor, input_ids: torch.Tensor):
    """``(ids [T, k], weights [T, k] fp32)``: hash layers take the experts from the token-id table,
    the others the top-k of score + bias; weights are the chosen scores renormalised and scaled."""
    logits = kernels.router_logits(x, w("ffn.gate.weight"))
    if layer < c.num_hash_layers:
        scores = kernels.sqrtsoftplus(logits)
        ids = w("ffn.gate.tid2eid")[input_ids.long()].long()
        wts = scores.gather(1, ids)
        denom = wts[:, 0:1]
        for j in range(1, ids.shape[1]):
            denom = denom + wts[:, j : j + 1]
        return ids, wts / (denom + 1e-20) * c.routed_scaling_factor
    return kernels.route(logits, c.top_k, score="sqrtsoftplus", expert_bias=w("ffn.gate.bias"),
                         norm_topk_prob=True, scaling_factor=c.routed_scaling_factor)


def routed_outputs(c: V4Config, w: Getter, x: torch.Tensor, ids: torch.Tensor,
                   owned: Optional[range] = None) -> torch.Tensor:
    """``[T, k, hidden]``: slot j of token t = expert ``ids[t, j]`` on ``x[t]`` (each token alone).
    With ``owned`` (expert parallel), slots of other ranks' experts stay exactly zero."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    y = x.new_zeros(T * k, x.shape[1])
    for e in torch.unique(flat).tolist():
        if owned is not None and e not in owned:
            continue
        sel = (flat == e).nonzero().squeeze(1)
        y[sel] = expert(c, w, x[torch.div(sel, k, rounding_mode="floor")], f"ffn.experts.{e}.")
    return y.view(T, k, -1)


def moe_forward(c: V4Config, w: Getter, layer: int, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    ids, wts = route(c, w, layer, x, input_ids)
    shared = expert(c, w, x, "ffn.shared_experts.") if c.n_shared_experts else None
    if c.tp is None:
        routed = routed_outputs(c, w, x, ids)
    else:  # expert parallel: this rank's slots, then the exact sum over the ranks
        routed = c.tp.reduce(routed_outputs(c, w, x, ids, owned=c.tp.experts))
    return kernels.moe_combine(routed, wts, shared, out_dtype=x.dtype)


def hc_args(c: V4Config, w: Getter, which: str) -> tuple:
    return (w(f"hc_{which}_fn"), w(f"hc_{which}_base"), w(f"hc_{which}_scale"))


def layer_forward(
    c: V4Config,
    w: Getter,
    layer: int,
    streams: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attend: Callable[[dict], torch.Tensor],
    moe: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """One decoder layer on ``streams[T, hc_mult, hidden]``. ``attend(state) -> o [T, H, D]`` (state
    from :func:`token_state`) is the only part that differs between the learner and vLLM. ``moe(x)``
    overrides :func:`moe_forward` (the learner's MoE module)."""
    kw = dict(sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps, norm_eps=c.rms_norm_eps)
    post, comb, collapsed = kernels.hc_mix(streams, *hc_args(c, w, "attn"), **kw)
    x = tap(f"layer{layer}.attn_norm", kernels.rms_norm(collapsed, w("attn_norm.weight"), c.rms_norm_eps))
    o = tap(f"layer{layer}.attention", attend(token_state(c, w, layer, x, positions)))
    a = tap(f"layer{layer}.attn_out", attn_output(c, w, layer, o, positions))
    streams = kernels.hc_expand(streams, a, post, comb)
    post, comb, collapsed = kernels.hc_mix(streams, *hc_args(c, w, "ffn"), **kw)
    x = tap(f"layer{layer}.mlp_norm", kernels.rms_norm(collapsed, w("ffn_norm.weight"), c.rms_norm_eps))
    y = tap(f"layer{layer}.mlp", moe(x) if moe is not None else moe_forward(c, w, layer, x, input_ids))
    return tap(f"layer{layer}.output", kernels.hc_expand(streams, y, post, comb))


def embed(c: V4Config, embed_weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[T, hc_mult, hidden]``: the token embedding copied into every stream (exact gather)."""
    h = embed_weight[input_ids.long()]
    return h.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()


def final_hidden(c: V4Config, g: Getter, streams: torch.Tensor) -> torch.Tensor:
    """Collapse the streams (hc head) and apply the final norm: ``[T, hidden]``. ``g`` is a global
    getter (``hc_head_fn``, ``norm.weight``)."""
    h = kernels.hc_head(streams, g("hc_head_fn"), g("hc_head_base"), g("hc_head_scale"), eps=c.hc_eps,
                        norm_eps=c.rms_norm_eps)
    return tap("final_norm", kernels.rms_norm(h, g("norm.weight"), c.rms_norm_eps))


def lm_head_name(c: V4Config) -> str:
    return "embed.weight" if c.tie_word_embeddings else "head.weight"


# --------------------------------------------------------------------------------------------------
# Full-sequence reference
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_logits(sd_or_dir, config, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[B, S, V]`` of right-padded sequences (original-named weights)."""
    sd = sd_or_dir if isinstance(sd_or_dir, dict) else load_state_dict(sd_or_dir)
    if config is None:
        config = sd_or_dir
    c = config if isinstance(config, V4Config) else v4_config(config)
    dev = sd["embed.weight"].device  # the weights' device (CPU, or CUDA for the GPU checks)
    input_ids = torch.as_tensor(input_ids).long().to(dev)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    B, S = input_ids.shape
    ids = input_ids.reshape(-1)
    pos = torch.arange(S, device=dev).repeat(B)
    streams = embed(c, sd["embed.weight"], ids)
    cache = FP8WeightCache()  # FP8: each weight quantised once per call (the engine: once per load)
    for i in range(c.num_layers):
        pre = f"layers.{i}."
        w = fp8_getter(c, lambda n, pre=pre: sd[pre + n], cache, pre)

        def attend(state, i=i, w=w):
            outs = []
            for b in range(B):
                rows = slice(b * S, (b + 1) * S)
                st = {k: v[rows] for k, v in state.items()}
                outs.append(attend_sequence(c, w, i, st, pos[rows], state["payload"][rows]))
            return torch.cat(outs, dim=0)

        streams = layer_forward(c, w, i, streams, ids, pos, attend)
    h = final_hidden(c, sd.__getitem__, streams)
    logits = kernels.lm_head_logits(h, sd[lm_head_name(c)], out_dtype=torch.float32)
    return logits.view(B, S, -1)


@torch.no_grad()
def reference_logprobs(sd_or_dir, config, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, S]`` fp32: ``out[:, t] = log p(ids[:, t] | ids[:, :t])``; ``out[:, 0] = 0``."""
    input_ids = torch.as_tensor(input_ids).long()
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    logits = reference_logits(sd_or_dir, config, input_ids)
    B, S = input_ids.shape
    out = torch.zeros(B, S, dtype=torch.float32, device=logits.device)
    if S > 1:
        lp = kernels.logprobs_from_logits(logits[:, :-1].reshape(B * (S - 1), -1),
                                          input_ids[:, 1:].reshape(-1).to(logits.device), temperature)
        out[:, 1:] = lp.view(B, S - 1)
    return out

