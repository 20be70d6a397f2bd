"""DeepSeek-V4.1: what V4.1 computes beyond DeepSeek-V4, as aligned per-layer functions, and a
full-sequence reference.

Read from vLLM 0.32's ``DeepseekV41ForCausalLM`` (``vllm/models/deepseek_v41/``: ``nvidia/model.py``,
``common/engram.py``, ``attention.py``, ``model_executor/kernels/mhc/torch.py``); transformers has no
V4.1. Everything not listed here is :mod:`kernels.models.dsv4`'s (its per-layer functions are called
unchanged: attention :func:`~kernels.models.dsv4.token_state` / ``attend_sequence`` /
``attn_output``, the hash-routed and sqrt-softplus MoE, the embedding, RoPE tables).

What V4.1 adds or changes:

1. **Delayed hyper-connection pre-mix.** Each sublayer still computes ``pre, post, comb`` from its
   input streams exactly as V4 does, but its input is collapsed with the *previous* sublayer's
   ``pre`` (the attention of layer i with layer i-1's FFN ``pre``; the FFN with this layer's
   attention ``pre``; layer 0's attention takes stream 0, i.e. the embedding). Its own ``pre`` is
   carried to the next sublayer. (vLLM: ``mhc_pre_delayed_torch`` and the fused TileLang kernels.)
2. **No learned hc head.** The final streams are collapsed with the last FFN's carried ``pre``, then
   the final norm (``hc_head_fn/base/scale`` do not exist in V4.1).
3. **Engram** on the layers in ``engram_layer_ids``, applied to the full stream *before* that
   layer's attention coefficients (so the mix sees the injected streams):

   * token ids map to a compressed vocabulary (NFKC/NFD, accents stripped, lower-cased, whitespace
     runs collapsed, stripped; the map is built from the tokenizer: :func:`compressed_token_map`);
   * at position p, for shift s = 0..N-1 (``N = engram_max_ngram_size``) the compressed id of the
     token at p - s (or the pad's compressed id once p - s < 0, sticky for longer shifts) is
     multiplied by a per-(layer, shift) odd multiplier (numpy ``default_rng(10007 * layer_id)``) and
     XOR-folded into a rolling int64; for each n-gram size n = s + 1 >= 2 and head h the hash is
     ``rolling % prime[layer][n-2][h] + offset`` (distinct primes above ``engram_vocab_size - 1``
     drawn in order over all layers, offsets the running sum within the layer's table);
   * the ``(N - 1) * engram_n_heads`` table rows (``engram.embed.weight [num_embeddings,
     engram_head_dim]``) are concatenated and projected by ``engram.wkv`` to ``hc_mult`` keys plus
     one value of ``hidden`` each;
   * stream k gets ``value * sigmoid(ssqrt(dot_k))`` added, where ``dot_k = sum(h_k * q_k * k_k *
     key_k) * rsqrt(mean(h_k^2) + eps) * rsqrt(mean(key_k^2) + eps) / sqrt(hidden)``,
     ``ssqrt(x) = sign(x) sqrt(max(|x|, 1e-6))`` (``engram.q_weight``, ``engram.k_weight [hc_mult,
     hidden]``).

Every sum here is a :func:`kernels.tree_sum`, every GEMM a :func:`kernels.linear`, and a position's
n-gram reads token ids by absolute position, so chunked prefill == decode and a sequence alone ==
in a batch, bitwise, as for V4.

4. **Compressed attention** (``compress_ratios`` 1 / 2; V4's are 4 / 128): compressors and
   compressed caches only on ``kv_source_layer_ids``, indexers only on ``index_source_layer_ids``
   (their keys ``k_norm(wk(latent))`` from the kv source's latent); every compressed layer reads the
   latest kv source at or below it and the selection of the latest index source
   (:func:`token_state`, :func:`attend_compressed`; the section "Compressed attention" below).

NOT reproduced (refused by :func:`v41_config` with the reason):

* The candidate-block prefilter (``candidate_source_layer_id`` >= 0 with ``candidate_topk_blocks``).
* A compressed layer whose kv source, index source or the index source's key source has another
  ratio (vLLM would index one cache with another's compressed positions).
* The fp32 compressor rows: vLLM keeps ``kv`` / ``score`` in fp32 (``torch.mm(out_dtype=fp32)``);
  the aligned payload rounds them to the model dtype once (identical in fp32 runs).
* The checkpoint's FP8 engram table (e4m3 rows + e8m0 scales per 32 columns): the aligned model
  takes the table in the model dtype (dequantise it first).
* Image-span ("dead") tokens: text only; every token takes part in its n-grams.
* vLLM skips an engram on layer 0 (its first-layer branch never calls it); layer 0 in
  ``engram_layer_ids`` is refused here rather than guessed.

Taken over from V4 by reading, not compared numerically (vLLM's V4.1 attention and MoE run on CUDA
only; the compressed path is checked against a float64 restatement of vLLM's kernels in
``tests/unit/test_dsv41_reference.py``): the sliding-window attention (same projections, q/kv norms,
interleaved RoPE at ``rope_theta``, per-head sinks, grouped ``wo_a``) and the MoE (vLLM's V4.1 MoE
subclasses its V4 MoE).

SWA bounded replay (``decoder_replay_layers.py``) runs the layers past the last KV-source layer on
each request's last ``sliding_window`` rows only: an execution optimisation that leaves the numbers
of the rows it keeps as they are; the aligned classes compute every row.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

import kernels
from kernels.dsv4 import sigmoid

from . import dsv4 as V4
from .qwen3_dsv3 import load_state_dict
from .trace import tap

Getter = V4.Getter

# V4.1's compressed layer kind (compress_ratios 1 / 2); RoPE at the compress base, as V4's.
V41C = "v41_compressed_attention"


@dataclasses.dataclass(frozen=True)
class V41Config(V4.V4Config):
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 3
    engram_n_heads: int = 1
    engram_head_dim: int = 32
    engram_vocab_size: int = 0
    engram_compressed_vocab_size: int = 0
    engram_pad_token_id: int = 0
    engram_primes: tuple = ()  # [layer][ngram - 2][head]
    engram_clamp: float = 1e-6
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()

    @property
    def engram_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def kv_source(self, layer: int) -> Optional[int]:
        """The layer whose compressor / compressed cache layer ``layer`` reads (None: sliding)."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source(self, layer: int) -> Optional[int]:
        """The layer whose indexer chooses layer ``layer``'s compressed entries (None: sliding)."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def payload_width(self, layer: int) -> int:
        """Per-token cached floats: the key; on a kv source also the compressor's ``wkv`` row and,
        at ratio 2, its ``wgate`` row (V4.1's other compressed layers cache only their key)."""
        D = self.head_dim
        if self.layer_kinds[layer] != V41C or layer not in self.kv_source_layer_ids:
            return D
        return D + D * (2 if self.compress_ratios[layer] == 2 else 1)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    v = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
    return default if v is None else v


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(n_layers: int, max_ngram: int, n_heads: int, vocab: int) -> tuple:
    """``[layer][ngram - 2][head]``: the next unused prime above ``vocab - 1`` for each
    (n-gram size, head) in order, restarting the search at ``vocab - 1`` for each (layer, n-gram).

    One known difference: vLLM 0.32's Miller-Rabin (witnesses 2, 7, 61) calls 61 composite (the
    witness 61 is 0 mod 61), so for ``engram_vocab_size <= 61`` its buckets differ from these; the
    tiny configs start above it and real vocabularies are far larger."""
    seen: set[int] = set()
    out = []
    for _ in range(n_layers):
        per = []
        for _ in range(max_ngram - 1):
            sizes, cur = [], vocab - 1
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per.append(tuple(sizes))
        out.append(tuple(per))
    return tuple(out)


def v41_config(config: Any) -> V41Config:
    """From a config.json dict / directory or an hf_config object of a DeepSeek-V4.1 checkpoint."""
    if isinstance(config, (str, os.PathLike)):
        import json

        path = os.path.join(os.fspath(config), "config.json")
        with open(path) as f:
            return v41_config(json.load(f))
    n_layers = int(_get(config, "num_hidden_layers"))
    ratios = tuple(int(r) for r in (_get(config, "compress_ratios") or [0] * n_layers))[:n_layers]
    kv_src, idx_src = compressed_topology(config, ratios)
    if isinstance(config, Mapping):
        plain = dict(config, compress_ratios=[0] * n_layers)
    else:
        plain = {k: v for k, v in vars(config).items() if not k.startswith("_")}
        plain["compress_ratios"] = [0] * n_layers
        plain.pop("layer_types", None)
    base = dataclasses.replace(V4.v4_config(plain), compress_ratios=ratios,
                               layer_kinds=tuple(V41C if r else V4.SLIDING for r in ratios))
    layers = tuple(int(i) for i in (_get(config, "engram_layer_ids") or ()))
    if 0 in layers:
        raise NotImplementedError("aligned DeepSeek-V4.1: an engram on layer 0 (vLLM 0.32 never applies it there)")
    if any(i >= base.num_layers for i in layers):
        raise ValueError(f"engram_layer_ids {layers} beyond num_hidden_layers {base.num_layers}")
    nums = tuple(int(n) for n in (_get(config, "engram_num_embeddings") or ()))
    if len(nums) != len(layers):
        raise ValueError("engram_num_embeddings needs one entry per engram_layer_ids entry")
    N = int(_get(config, "engram_max_ngram_size", 3))
    heads = int(_get(config, "engram_n_heads", 1))
    vocab = int(_get(config, "engram_vocab_size", 0))
    primes = engram_primes(len(layers), N, heads, vocab) if layers else ()
    for li, per in enumerate(primes):
        if sum(sum(p) for p in per) > nums[li]:
            raise ValueError(f"engram layer {layers[li]}: engram_num_embeddings {nums[li]} < the "
                             f"{sum(sum(p) for p in per)} rows its hash buckets need")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(V4.V4Config)}
    fields["arch"] = "deepseek_v41"
    return V41Config(
        **fields,
        engram_layer_ids=layers,
        engram_num_embeddings=nums,
        engram_max_ngram_size=N,
        engram_n_heads=heads,
        engram_head_dim=int(_get(config, "engram_head_dim", 32)),
        engram_vocab_size=vocab,
        engram_compressed_vocab_size=int(_get(config, "engram_compressed_vocab_size", 0)),
        engram_pad_token_id=int(_get(config, "engram_pad_token_id", _get(config, "pad_token_id", 0))),
        engram_primes=primes,
        kv_source_layer_ids=kv_src,
        index_source_layer_ids=idx_src,
    )


def compressed_topology(config: Any, ratios: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(kv_source_layer_ids, index_source_layer_ids)`` of the backbone, checked: vLLM 0.32's
    ``DeepseekV4Attention`` gives a compressed layer the latest kv / index source at or below it.
    Refused (with the reason): ratios other than 0 / 1 / 2, the candidate-block prefilter, a layer
    whose sources have another ratio (their compressed positions would not be its own)."""
    bad = [r for r in ratios if r not in (0, 1, 2)]
    if bad:
        raise NotImplementedError(f"aligned DeepSeek-V4.1: compress_ratios must be 0, 1 or 2, got {list(ratios)}")
    n = len(ratios)
    kv_src = tuple(sorted(int(i) for i in (_get(config, "kv_source_layer_ids") or ()) if int(i) < n))
    idx_src = tuple(sorted(int(i) for i in (_get(config, "index_source_layer_ids") or ()) if int(i) < n))
    if not any(ratios):
        return kv_src, idx_src
    if int(_get(config, "candidate_source_layer_id", -1)) >= 0 and int(_get(config, "candidate_topk_blocks", 0)) > 0:
        raise NotImplementedError(
            "aligned DeepSeek-V4.1: the candidate-block prefilter (candidate_source_layer_id / "
            "candidate_topk_blocks) is not reproduced; set candidate_source_layer_id -1")
    for i, r in enumerate(ratios):
        if r == 0:
            if i in kv_src or i in idx_src:
                raise ValueError(f"DeepSeek-V4.1 layer {i}: a kv / index source must be a compressed layer")
            continue
        ks = [s for s in kv_src if s <= i]
        js = [s for s in idx_src if s <= i]
        if not ks or not js:
            raise ValueError(f"DeepSeek-V4.1 layer {i} (compress_ratio {r}): no kv_source_layer_ids / "
                             f"index_source_layer_ids entry at or below it ({kv_src}, {idx_src})")
        j = max(js)
        kj = max(s for s in kv_src if s <= j)
        if kj not in idx_src:
            raise ValueError(f"DeepSeek-V4.1 layer {j}: its index keys come from kv source {kj}, which is "
                             "not an index source (only those own indexer.wk / k_norm)")
        if len({r, ratios[max(ks)], ratios[j], ratios[kj]}) != 1:
            raise NotImplementedError(
                f"aligned DeepSeek-V4.1 layer {i}: compress_ratio {r} but its kv source {max(ks)} / index "
                f"source {j} (keys from {kj}) have ratios {ratios[max(ks)]} / {ratios[j]} / {ratios[kj]}")
    return kv_src, idx_src


# --------------------------------------------------------------------------------------------------
# Weights by name
# --------------------------------------------------------------------------------------------------


def parameter_shapes(c: V41Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """V4's weights without the hc head, plus each engram layer's table, ``wkv``, ``q_weight`` and
    ``k_weight`` (original checkpoint names ``layers.{i}.engram.*``)."""
    out = {k: v for k, v in V4.parameter_shapes(c).items() if not k.startswith("hc_head_")}
    H, n = c.hidden_size, c.hc_mult
    for li, i in enumerate(c.engram_layer_ids):
        p = f"layers.{i}.engram."
        out[p + "embed.weight"] = ((c.engram_num_embeddings[li], c.engram_head_dim), "model")
        out[p + "wkv.weight"] = (((n + 1) * H, c.engram_cols * c.engram_head_dim), "model")
        out[p + "q_weight"] = ((n, H), "model")
        out[p + "k_weight"] = ((n, H), "model")
    D, Di, Hi = c.head_dim, c.index_head_dim, c.index_n_heads
    for i in range(c.num_layers):
        if c.layer_kinds[i] != V41C:
            continue
        a = f"layers.{i}.attn."
        if i in c.kv_source_layer_ids:
            out[a + "compressor.wkv.weight"] = ((D, H), "model")
            if c.compress_ratios[i] == 2:  # ratio 1 pools single tokens: no gate
                out[a + "compressor.wgate.weight"] = ((D, H), "model")
            out[a + "compressor.norm.weight"] = ((D,), "model")
        if i in c.index_source_layer_ids:
            out[a + "indexer.wq_b.weight"] = ((Hi * Di, c.q_lora_rank), "model")
            out[a + "indexer.weights_proj.weight"] = ((Hi, H), "model")
            if i in c.kv_source_layer_ids:
                out[a + "indexer.wk.weight"] = ((Di, D), "model")
                out[a + "indexer.k_norm.weight"] = ((Di,), "model")
    return out


def build_parameter_tree(root, c: V41Config, make, prefix: str = "", skip: tuple[str, ...] = (),
                         include: Optional[Callable[[str], bool]] = None) -> None:
    """:func:`kernels.models.dsv4.build_parameter_tree` over V4.1's names."""
    V4.add_parameter_tree(root, parameter_shapes(c), make, prefix, skip, include)


# --------------------------------------------------------------------------------------------------
# Engram: compressed vocabulary, n-gram hashes, gated injection
# --------------------------------------------------------------------------------------------------


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """``(map token id -> compressed id, compressed vocab size)``: tokens whose decoded text
    normalises alike share an id, numbered in order of first appearance."""
    from tokenizers import Regex, normalizers

    keep_space = "\ue000"  # a lone-space token must not strip to "" (and merge with others)
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep_space),
        normalizers.Strip(), normalizers.Replace(keep_space, " "),
    ])
    backend = tokenizer.backend_tokenizer
    ids: dict[str, int] = {}
    out = []
    for t in range(len(tokenizer)):
        text = backend.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte: key by the raw token
            key = backend.id_to_token(t)
        else:
            key = norm.normalize_str(text) or text
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)


def hash_multipliers(c: V41Config) -> torch.Tensor:
    """int64 ``[engram layers, max_ngram]``: odd multipliers small enough that ``id * m`` fits int64."""
    bound = max(1, (np.iinfo(np.int64).max // c.engram_compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * i).integers(0, bound, size=(c.engram_max_ngram_size,), dtype=np.int64) * 2 + 1
            for i in c.engram_layer_ids]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, c.engram_max_ngram_size, dtype=torch.int64)


def _offsets(c: V41Config, li: int) -> torch.Tensor:
    flat = [p for per in c.engram_primes[li] for p in per]
    return torch.tensor([0] + list(np.cumsum(flat[:-1])), dtype=torch.int64)


def _hash_params(c: V41Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _hash_params_of(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_compressed_vocab_size,
                           c.engram_primes)


@functools.lru_cache(maxsize=32)
def _hash_params_of(layer_ids, max_ngram, cvocab, primes_) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = V41Config.__new__(V41Config)  # only the engram fields are read below
    for k, v in dict(engram_layer_ids=layer_ids, engram_max_ngram_size=max_ngram,
                     engram_compressed_vocab_size=cvocab, engram_primes=primes_).items():
        object.__setattr__(c, k, v)
    mult = hash_multipliers(c)
    primes = torch.tensor([[p for per in layer for p in per] for layer in c.engram_primes], dtype=torch.int64)
    offs = torch.stack([_offsets(c, li) for li in range(len(c.engram_layer_ids))]) if c.engram_layer_ids else primes
    return mult, primes.reshape(len(c.engram_layer_ids), -1), offs


def ngram_hashes(c: V41Config, token_map: torch.Tensor, history_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, engram layers, (N-1) * heads]``: the table rows of the n-grams ending at
    ``positions`` of ONE sequence whose token ids by absolute position are ``history_ids[L]``
    (every position < L). Exact integer arithmetic: the same for prefill and decode."""
    token_map = torch.as_tensor(token_map, dtype=torch.int64)
    mult, primes, offs = _hash_params(c)
    pad = int(token_map[c.engram_pad_token_id])
    pos = positions.long()
    T, n_layers, heads = pos.shape[0], len(c.engram_layer_ids), c.engram_n_heads
    rolling = torch.zeros(T, n_layers, dtype=torch.int64)
    blocked = torch.zeros(T, dtype=torch.bool)
    out = torch.empty(T, n_layers, c.engram_cols, dtype=torch.int64)
    hist = history_ids.long()
    for s in range(c.engram_max_ngram_size):
        back = pos - s
        blocked = blocked | (back < 0)
        src = token_map[hist[back.clamp(min=0)]]
        val = torch.where(blocked, torch.full_like(src, pad), src)
        rolling = rolling ^ (val[:, None] * mult[None, :, s])
        if s > 0:
            cols = slice((s - 1) * heads, s * heads)
            out[:, :, cols] = rolling[:, :, None] % primes[None, :, cols] + offs[None, :, cols]
    return out


def engram_forward(c: V41Config, w: Getter, streams: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """``streams[T, hc, H]`` plus the gated engram value (``w`` relative to ``layers.{i}.engram.``;
    ``hashes[T, cols]`` this layer's rows)."""
    T, n, H = streams.shape
    table = w("embed.weight")
    rows = table[hashes.long().reshape(-1)].reshape(T, -1)
    kv = kernels.linear(rows.to(streams.dtype), w("wkv.weight"), out_dtype=torch.float32)
    key = kv[:, : n * H].reshape(T, n, H)
    value = kv[:, n * H :]
    h = streams.to(torch.float32)
    q = w("q_weight").to(torch.float32)
    k = w("k_weight").to(torch.float32)
    dot = kernels.tree_sum(h * q * k * key, dim=-1)
    h_rms = torch.rsqrt(kernels.tree_sum(h * h, dim=-1) / H + c.rms_norm_eps)
    k_rms = torch.rsqrt(kernels.tree_sum(key * key, dim=-1) / H + c.rms_norm_eps)
    dot = dot * (h_rms * k_rms * (1.0 / float(np.sqrt(H))))
    mag = torch.sqrt(torch.clamp(dot.abs(), min=c.engram_clamp))
    gate = sigmoid(torch.where(dot < 0, -mag, mag))
    return (h + gate.unsqueeze(-1) * value.unsqueeze(1)).to(streams.dtype)


# --------------------------------------------------------------------------------------------------
# Compressed attention (compress_ratios 1 / 2, kv / index sources)
# --------------------------------------------------------------------------------------------------
#
# vLLM 0.32 (``deepseek_v41/attention.py``, ``compressor.py``, ``common/ops/
# fused_compress_quant_cache.py``, ``indexer_k_store.py``): a kv-source layer's compressor projects
# ``x`` to ``kv`` (and, at ratio 2, ``score``) rows; group j (tokens j*r .. j*r + r - 1) is pooled
# when its last token arrives (ratio 1: the row itself; ratio 2: ``sum softmax_slots(score) * kv``,
# per channel, no position bias, no overlap), RMS-normed (``compressor.norm``) into a *latent*. The
# main compressed entry is the latent with RoPE (compress base) at the group's first position
# j*r; the index key is ``k_norm(indexer.wk(latent))`` with RoPE there. An index-source layer
# scores its kv source's keys with its own ``indexer.wq_b`` / ``weights_proj`` queries (V4's
# formula) and publishes the top ``index_topk`` of the n_ready = (p + 1) // r complete groups
# (every one while there are fewer: vLLM's short-context path); a compressed layer attends its
# sliding window plus the entries its index source chose, read from its kv source's cache.


def token_state(c: V41Config, w: Getter, layer: int, x: torch.Tensor, positions: torch.Tensor) -> dict:
    """V4's per-token state (:func:`kernels.models.dsv4.token_state`: ``q``, ``payload`` = key) plus,
    on a kv source, the compressor rows in the payload and, on an index source, ``idx_q`` / ``idx_w``."""
    out = V4.token_state(c, w, layer, x, positions)
    if c.layer_kinds[layer] != V41C:
        return out
    if layer in c.kv_source_layer_ids:
        parts = [out["payload"], kernels.linear(x, w("attn.compressor.wkv.weight")).to(x.dtype)]
        if c.compress_ratios[layer] == 2:
            parts.append(kernels.linear(x, w("attn.compressor.wgate.weight")).to(x.dtype))
        out["payload"] = torch.cat(parts, dim=-1)
    if layer in c.index_source_layer_ids:
        Hi, Di = c.index_n_heads, c.index_head_dim
        T = x.shape[0]
        q_res = kernels.rms_norm(V4.project(c, w, x, "attn.wq_a.weight"), w("attn.q_norm.weight"), c.rms_norm_eps)
        iq = V4.project(c, w, q_res, "attn.indexer.wq_b.weight").view(T, Hi, Di)
        cos, sin = V4.rope_tables(c, layer, positions)
        out["idx_q"] = V4.rope_tail(iq, cos, sin)
        out["idx_w"] = kernels.linear(x, w("attn.indexer.weights_proj.weight"), out_dtype=torch.float32) * (Hi ** -0.5)
    return out


def compressed_latents(c: V41Config, w_src: Getter, source: int, history: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """``[L // r, D]`` latents of one sequence from kv-source layer ``source``'s payload
    ``history[L, >= payload_width]`` (``w_src`` relative to ``layers.{source}.``): pooled in fp32,
    RMS-normed in fp32, rounded to ``dtype`` once."""
    D, r = c.head_dim, c.compress_ratios[source]
    n = history.shape[0] // r
    kv = history[: n * r, D : 2 * D].to(torch.float32)
    if r == 1:
        pooled = kv
    else:
        gate = history[: n * r, 2 * D : 3 * D]
        pooled = kernels.compress_windows(kv, gate, torch.zeros(r, D), r, overlap=False)
    return kernels.rms_norm(pooled, w_src("attn.compressor.norm.weight").to(torch.float32), c.rms_norm_eps).to(dtype)


def rope_groups(c: V41Config, x: torch.Tensor, ratio: int) -> torch.Tensor:
    """RoPE (compress base, interleaved tail) of per-group rows ``x[N, d]`` at positions j * ratio."""
    cos, sin = kernels.rope_cos_sin(torch.arange(x.shape[0]) * ratio, c.rope_dim, inv_freq=c.inv_freq_compress)
    return V4.rope_tail(x.unsqueeze(1), cos, sin).squeeze(1)


def index_keys(c: V41Config, w_src: Getter, latents: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[N, Di]``: ``k_norm(indexer.wk(latent))`` with RoPE at the group position."""
    k = kernels.rms_norm(kernels.linear(latents, w_src("attn.indexer.wk.weight")),
                         w_src("attn.indexer.k_norm.weight"), c.rms_norm_eps)
    return rope_groups(c, k, ratio)


def select_compressed(c: V41Config, layer: int, state: dict, positions: torch.Tensor, keys: torch.Tensor
                      ) -> torch.Tensor:
    """Index-source layer ``layer``: boolean ``[T, N]`` of the entries each query keeps (top
    ``index_topk`` of the complete groups, ties to the lower index)."""
    n_ready = torch.div(positions + 1, c.compress_ratios[layer], rounding_mode="floor")
    scores = kernels.indexer_scores(state["idx_q"], state["idx_w"], keys, c.index_head_dim ** -0.5)
    return kernels.select_entries(scores, n_ready, c.index_topk)


def attend_compressed(c: V41Config, g: Getter, layer: int, state: dict, positions: torch.Tensor,
                      histories: Mapping[int, torch.Tensor], keep: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Queries of ONE sequence in layer ``layer`` (``g`` the GLOBAL getter) against that sequence's
    payload histories by layer (``histories[layer]`` and, on compressed layers, the kv source's and the
    index source's key source's; row j = position j, every query position < L). ``keep``: the
    selection the index source published for these queries (computed here on an index source).
    Returns ``(out [T, H, D], keep)``; sliding layers return ``keep`` unchanged."""
    D = c.head_dim
    w = lambda n: g(f"layers.{layer}." + n)
    kv = histories[layer][:, :D]
    if c.layer_kinds[layer] != V41C:
        o = kernels.sink_attention(state["q"], positions, kv, w("attn.attn_sink"), D ** -0.5, window=c.sliding_window)
        return o, keep
    dtype, r = state["q"].dtype, c.compress_ratios[layer]
    src = c.kv_source(layer)
    w_src = lambda n: g(f"layers.{src}." + n)
    latents = compressed_latents(c, w_src, src, histories[src], dtype)
    if layer in c.index_source_layer_ids:
        ksrc = c.kv_source(layer)
        klat = latents if ksrc == src else compressed_latents(
            c, lambda n: g(f"layers.{ksrc}." + n), ksrc, histories[ksrc], dtype)
        keys = index_keys(c, lambda n: g(f"layers.{ksrc}." + n), klat, r)
        keep = select_compressed(c, layer, state, positions, keys)
    elif keep is None:
        raise ValueError(f"layer {layer}: pass the selection of its index source {c.index_source(layer)}")
    comp = rope_groups(c, latents, r)
    o = kernels.sink_attention(state["q"], positions, kv, w("attn.attn_sink"), D ** -0.5,
                               window=c.sliding_window, comp=comp, comp_keep=keep[:, : comp.shape[0]])
    return o, keep


# --------------------------------------------------------------------------------------------------
# Delayed hyper-connections
# --------------------------------------------------------------------------------------------------


def hc_coefficients(c: V41Config, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                    scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [T, n], post [T, n], comb [T, n, n])`` fp32 of ``streams[T, n, H]``: V4's formulas
    (:func:`kernels.hc_mix`), ``pre`` returned instead of applied."""
    T, n, D = streams.shape
    eps = c.hc_eps
    flat = kernels.rms_norm(streams.reshape(T, n * D).to(torch.float32), None, c.rms_norm_eps)
    mixes = kernels.linear(flat, fn, out_dtype=torch.float32)
    b, s = base.to(torch.float32), scale.to(torch.float32)
    pre = sigmoid(mixes[:, :n] * s[0] + b[:n]) + eps
    post = 2.0 * sigmoid(mixes[:, n : 2 * n] * s[1] + b[n : 2 * n])
    comb = mixes[:, 2 * n :].reshape(T, n, n) * s[2] + b[2 * n :].reshape(n, n)
    e = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = e / kernels.tree_sum(e, dim=-1, keepdim=True) + eps
    comb = comb / (kernels.tree_sum(comb, dim=-2, keepdim=True) + eps)
    for _ in range(c.hc_sinkhorn_iters - 1):
        comb = comb / (kernels.tree_sum(comb, dim=-1, keepdim=True) + eps)
        comb = comb / (kernels.tree_sum(comb, dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: Optional[torch.Tensor]) -> torch.Tensor:
    """``[T, H]``: ``sum_k pre[k] * streams[k]`` in fp32 (tree order), or stream 0 when ``pre`` is None."""
    if pre is None:
        return streams[:, 0]
    return kernels.tree_sum(pre.unsqueeze(-1) * streams.to(torch.float32), dim=1).to(streams.dtype)


def layer_forward(
    c: V41Config,
    w: Getter,
    layer: int,
    streams: torch.Tensor,
    pre_mix: Optional[torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attend: Callable[[dict], torch.Tensor],
    engram_hashes: Optional[torch.Tensor] = None,
    moe: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One V4.1 decoder layer: ``(streams, pre_mix) -> (streams, pre_mix)``. ``engram_hashes
    [T, cols]`` (this layer's, from :func:`ngram_hashes`) is required on engram layers."""
    if layer in c.engram_layer_ids:
        if engram_hashes is None:
            raise ValueError(f"layer {layer} has an engram: pass its n-gram hashes")
        streams = tap(f"layer{layer}.engram", engram_forward(c, lambda n: w("engram." + n), streams, engram_hashes))
    pre, post, comb = hc_coefficients(c, streams, *V4.hc_args(c, w, "attn"))
    x = tap(f"layer{layer}.attn_norm", kernels.rms_norm(hc_collapse(streams, pre_mix), w("attn_norm.weight"),
                                                        c.rms_norm_eps))
    o = tap(f"layer{layer}.attention", attend(token_state(c, w, layer, x, positions)))
    a = tap(f"layer{layer}.attn_out", V4.attn_output(c, w, layer, o, positions))
    streams = kernels.hc_expand(streams, a, post, comb)
    attn_pre = pre
    pre, post, comb = hc_coefficients(c, streams, *V4.hc_args(c, w, "ffn"))
    x = tap(f"layer{layer}.mlp_norm", kernels.rms_norm(hc_collapse(streams, attn_pre), w("ffn_norm.weight"),
                                                       c.rms_norm_eps))
    y = tap(f"layer{layer}.mlp", moe(x) if moe is not None else V4.moe_forward(c, w, layer, x, input_ids))
    return tap(f"layer{layer}.output", kernels.hc_expand(streams, y, post, comb)), pre


def final_hidden(c: V41Config, g: Getter, streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """Collapse with the last FFN's ``pre`` (no hc head in V4.1), then the final norm."""
    return tap("final_norm", kernels.rms_norm(hc_collapse(streams, pre_mix), g("norm.weight"), c.rms_norm_eps))


def engram_rows(c: V41Config, hashes: Optional[torch.Tensor], layer: int) -> Optional[torch.Tensor]:
    """Layer ``layer``'s columns of the all-layer ``hashes`` (None off the engram layers)."""
    if hashes is None or layer not in c.engram_layer_ids:
        return None
    return hashes[:, c.engram_layer_ids.index(layer)]


# --------------------------------------------------------------------------------------------------
# Full-sequence reference
# --------------------------------------------------------------------------------------------------


def token_map_of(dir_or_tokenizer, c: Optional[V41Config] = None) -> torch.Tensor:
    """int64 ``[vocab]``: the compressed token map of a checkpoint directory's tokenizer (or of a
    tokenizer). With ``c``, ids past the tokenizer (a model vocab larger than the tokenizer, as in
    the tiny models) map to the pad token's compressed id; vLLM would read past its map there."""
    tok = dir_or_tokenizer
    if isinstance(tok, (str, os.PathLike)):
        from transformers import AutoTokenizer, PretrainedConfig

        # config given: transformers' DeepseekV4Config cannot parse V4.1's compress_ratios 1 / 2
        tok = AutoTokenizer.from_pretrained(os.fspath(tok), config=PretrainedConfig())
    m = compressed_token_map(tok)[0]
    if c is not None and len(m) < c.vocab_size:
        m = m + [m[c.engram_pad_token_id]] * (c.vocab_size - len(m))
    return torch.tensor(m, dtype=torch.int64)


def forward_logits(c: V41Config, g: Getter, input_ids: torch.Tensor, token_map: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 logits ``[B, S, V]`` of right-padded ``input_ids [B, S]`` with weights from the global
    getter ``g`` (original names); differentiable (the tiny models' warm start trains through it)."""
    B, S = input_ids.shape
    ids = input_ids.reshape(-1)
    pos = torch.arange(S).repeat(B)
    hashes = None
    if c.engram_layer_ids:
        hashes = torch.cat([ngram_hashes(c, token_map, input_ids[b], torch.arange(S)) for b in range(B)])
    streams = V4.embed(c, g("embed.weight"), ids)
    pre = None
    histories: list[dict] = [{} for _ in range(B)]  # per sequence: layer -> payload rows
    keeps: list = [None] * B  # per sequence: the latest index source's selection
    cache = V4.FP8WeightCache()  # FP8 (V4's linears, kernels.models.dsv4.FP8_LINEARS): quantised once per call
    for i in range(c.num_layers):
        pre_ = f"layers.{i}."
        w = V4.fp8_getter(c, lambda n, pre_=pre_: g(pre_ + n), cache, pre_)

        def attend(state, i=i):
            outs = []
            for b in range(B):
                rows = slice(b * S, (b + 1) * S)
                st = {k: v[rows] for k, v in state.items()}
                histories[b][i] = st["payload"]
                o, keeps[b] = attend_compressed(c, g, i, st, pos[rows], histories[b], keeps[b])
                outs.append(o)
            return torch.cat(outs, dim=0)

        streams, pre = layer_forward(c, w, i, streams, pre, ids, pos, attend, engram_rows(c, hashes, i))
    h = final_hidden(c, g, streams, pre)
    return kernels.lm_head_logits(h, g(V4.lm_head_name(c)), out_dtype=torch.float32).view(B, S, -1)


@torch.no_grad()
def reference_logits(sd_or_dir, config, input_ids: torch.Tensor, token_map: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
    """fp32 logits ``[B, S, V]`` of right-padded sequences (original-named weights)."""
    sd = sd_or_dir if isinstance(sd_or_dir, dict) else load_state_dict(sd_or_dir)
    if config is None:
        config = sd_or_dir
    c = config if isinstance(config, V41Config) else v41_config(config)
    input_ids = torch.as_tensor(input_ids).long()
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if c.engram_layer_ids and token_map is None:
        token_map = token_map_of(sd_or_dir, c)
    return forward_logits(c, sd.__getitem__, input_ids, token_map)


@torch.no_grad()
def reference_logprobs(sd_or_dir, config, input_ids: torch.Tensor, temperature: float = 1.0,
                       token_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, S]`` fp32: ``out[:, t] = log p(ids[:, t] | ids[:, :t])``; ``out[:, 0] = 0``."""
    input_ids = torch.as_tensor(input_ids).long()
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    logits = reference_logits(sd_or_dir, config, input_ids, token_map)
    B, S = input_ids.shape
    out = torch.zeros(B, S, dtype=torch.float32)
    if S > 1:
        lp = kernels.logprobs_from_logits(logits[:, :-1].reshape(B * (S - 1), -1),
                                          input_ids[:, 1:].reshape(-1), temperature)
        out[:, 1:] = lp.view(B, S - 1)
    return out
