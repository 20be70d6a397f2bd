"""DeepSeek-V4 learner model on Megatron-Core (megatron-core 0.16.1 has no DeepSeek-V4 modules).

A ``MegatronModule`` whose decoder layers are built from a ``ModuleSpec`` (:func:`layer_spec`: swap
the attention or MoE submodule there). Every weight sits under its ORIGINAL DeepSeek checkpoint name
(``layers.3.attn.wq_b.weight``), so loading a Hugging Face / DeepSeek checkpoint and exporting
weights to vLLM are name-for-name copies. The numerics are the per-layer functions of
:mod:`kernels.models.dsv4`, the same code the aligned vLLM class runs: here each
sequence attends over its own full payload history, in vLLM over the paged cache; the results are
bitwise equal.

Gradients: the ``kernels`` ops give exact forwards and plain-torch backwards. The indexer's top-k
choice carries no gradient (as in the reference model); the noaux_tc expert bias and the hash table
``tid2eid`` are buffers, not trained by the loss.

Parallelism: data parallel (Megatron's DDP) and expert parallel: with ``ep`` ranks each holds
``num_experts / ep`` routed experts (named by their global id), the ranks all-gather their tokens,
each computes the slots routed to its own experts (the others stay exact zeros) and a
reduce-scatter hands every token its slots back; the combine then runs in slot order as with one
rank, so EP=2 equals EP=1 bitwise. TP and PP are refused (:func:`check_supported`).

DeepSeek-V4.1 (a checkpoint whose config.json :func:`is_v41` recognises; recipe ``model.arch:
deepseek_v41``): the same modules over :mod:`kernels.models.dsv41`'s names and layer function (delayed
hyper-connection pre-mix carried from layer to layer, engram on ``engram_layer_ids``, no hc head).
The engram n-gram hashes are integers computed once per sequence from its token ids; the engram
table, ``wkv``, ``q_weight`` and ``k_weight`` are trained like any weight.

Blockwise FP8 (recipe ``model.fp8=blockwise``): the same switch as the engine's, in the shared numerics
(``kernels.models.dsv4.project`` on :data:`~kernels.models.dsv4.FP8_LINEARS`): every forward quantises
the master weights (``quantizing_getter``) and activations and runs ``kernels.fp8_linear``; its backward
is the straight-through estimate (the linear with the dequantised weight; the master weight gets
``g^T x``), as the Qwen3 / V3 FP8 layers of aligned_spec. Learner tp stays 1.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron_rz.learner.expert_export import expert_group, expert_id, gather_full_weights
from megatron_rz.recipe import ModelConfig, ParallelConfig
from kernels.models import dsv4 as R
from kernels.models import dsv41 as R41


def is_v41(hf_dir) -> bool:
    """The checkpoint is DeepSeek-V4.1 (its architectures name it, or it has V4.1-only keys)."""
    import json
    import os

    cfg = json.loads(open(os.path.join(os.fspath(hf_dir), "config.json")).read())
    return (any("V41" in a for a in cfg.get("architectures") or [])
            or any(k in cfg for k in ("engram_layer_ids", "kv_source_layer_ids", "index_source_layer_ids")))


def _tree(c):
    """The parameter-tree builder of the config's family (V4.1: no hc head, engram weights)."""
    return R41.build_parameter_tree if isinstance(c, R41.V41Config) else R.build_parameter_tree


def check_supported(parallel: ParallelConfig, num_experts: int) -> None:
    if (parallel.tp, parallel.pp, parallel.etp) != (1, 1, 1):
        raise ValueError(
            f"deepseek_v4 learner: parallel tp={parallel.tp} pp={parallel.pp} etp={parallel.etp} is not supported "
            "yet (the DeepSeek-V4 modules are data and expert parallel): set parallel.tp, pp and etp to 1 and "
            "scale with parallel.dp and parallel.ep"
        )
    if num_experts % parallel.ep:
        raise ValueError(f"deepseek_v4 learner: parallel.ep={parallel.ep} must divide the {num_experts} routed experts")


def transformer_config(m: ModelConfig, parallel: ParallelConfig):
    """The TransformerConfig Megatron's DDP and optimizer read (sizes, dtype, parallel degrees)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = getattr(torch, m.dtype)
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        kv_channels=m.head_dim, ffn_hidden_size=m.moe_ffn_hidden_size, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, pipeline_dtype=dtype, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep, num_moe_experts=m.num_experts, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_topk=m.top_k, gradient_accumulation_fusion=False,
    )


def _maker(dtype: torch.dtype):
    """Parameters in the model dtype (fp32 where DeepSeek keeps fp32); the hash table and the
    noaux_tc bias as buffers (returned as plain tensors)."""

    def make(name: str, shape: tuple, kind: str):
        if kind == "int64":
            return torch.zeros(shape, dtype=torch.int64)
        if name.endswith("ffn.gate.bias"):
            return torch.zeros(shape, dtype=torch.float32)
        return nn.Parameter(torch.zeros(shape, dtype=torch.float32 if kind == "fp32" else dtype))

    return make


class DeepseekV4Attention(nn.Module):
    """The ``layers.{i}.attn.*`` weights; answers one sequence's queries from its payload history."""

    def __init__(self, c: R.V4Config, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.c, self.index = c, index
        _tree(c)(self, c, _maker(dtype), prefix=f"layers.{index}.attn.")

    def forward(self, state: dict, positions: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        w = lambda n: R.lookup(self, n.removeprefix("attn."))
        return R.attend_sequence(self.c, w, self.index, state, positions, history)


class DeepseekV4MoE(nn.Module):
    """The ``layers.{i}.ffn.*`` weights: router and shared expert on every rank, this expert-parallel
    rank's routed experts. Routing (hash table in the first layers, sqrt-softplus top-k after) and
    expert compute are :mod:`kernels.models.dsv4`'s."""

    def __init__(self, c: R.V4Config, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.c, self.index = c, index
        self.ep, rank, self.group = expert_group()
        per = c.num_experts // self.ep
        self.owned = range(rank * per, (rank + 1) * per)
        _tree(c)(self, c, _maker(dtype), prefix=f"layers.{index}.ffn.",
                               include=lambda n: expert_id(n) is None or expert_id(n) in self.owned)
        for name, p in self.named_parameters():
            if name.startswith("experts."):
                p.allreduce = False  # Megatron DDP: reduce over the expert-data-parallel group

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        import kernels
        from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region

        from megatron_rz.learner.aligned_spec import all_gather_first_dim, gather_seq, keep_in_graph

        c = self.c
        w = R.fp8_getter(c, lambda n: R.lookup(self, n.removeprefix("ffn.")), None, "")  # FP8: quantised per call
        if self.ep == 1:
            return R.moe_forward(c, w, self.index, x, input_ids)
        ids, wts = R.route(c, w, self.index, x, input_ids)
        x_all = gather_seq(x, self.group)  # autograd: all-gather forward, reduce-scatter backward
        ids_all = all_gather_first_dim(ids, self.group)
        y_all = keep_in_graph(R.routed_outputs(c, w, x_all, ids_all, self.owned), x_all)  # other ranks' slots: exact zeros
        T, k = ids.shape
        y = reduce_scatter_to_sequence_parallel_region(y_all.reshape(-1, k * x.shape[1]), group=self.group)
        shared = R.expert(c, w, x, "ffn.shared_experts.") if c.n_shared_experts else None
        return kernels.moe_combine(y.view(T, k, -1), wts, shared, out_dtype=x.dtype)


class DeepseekV4Layer(nn.Module):
    """Hyper-connections and norms (its own weights) around the spec's attention and MoE."""

    def __init__(self, c: R.V4Config, index: int, dtype: torch.dtype, submodules: dict) -> None:
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        self.c, self.index = c, index
        _tree(c)(self, c, _maker(dtype), prefix=f"layers.{index}.", skip=("attn.", "ffn."))
        self.attn = build_module(submodules["attention"], c, index, dtype)
        self.ffn = build_module(submodules["moe"], c, index, dtype)

    def forward(self, streams, input_ids, positions, seq_len: int, pre_mix=None, hashes=None, shared=None):
        """V4: ``streams``; V4.1: ``(streams, pre_mix)`` (``hashes``: every engram layer's n-gram rows;
        ``shared``: with compressed layers, the model's global getter ``g`` and per sequence the
        payload histories by layer ``hist`` and the latest index source's selection ``keep``)."""
        def attend(state):
            outs = []  # one sequence at a time, over its own payload rows
            for n, b0 in enumerate(range(0, state["q"].shape[0], seq_len)):
                rows = slice(b0, b0 + seq_len)
                st = {k: v[rows] for k, v in state.items()}
                if shared is None:
                    outs.append(self.attn(st, positions[rows], state["payload"][rows]))
                    continue
                hist = shared["hist"].setdefault(n, {})
                hist[self.index] = st["payload"]
                o, shared["keep"][n] = R41.attend_compressed(self.c, shared["g"], self.index, st, positions[rows],
                                                             hist, shared["keep"].get(n))
                outs.append(o)
            return torch.cat(outs, dim=0)

        # names relative to the layer ("attn.wq_a.weight" lives in the attention submodule); blockwise
        # FP8: the FP8 linears quantise the master weights at every call (straight-through gradients)
        w = R.fp8_getter(self.c, lambda n: R.lookup(self, n), None, "")
        if isinstance(self.c, R41.V41Config):
            return R41.layer_forward(self.c, w, self.index, streams, pre_mix, input_ids,
                                     positions, attend, R41.engram_rows(self.c, hashes, self.index),
                                     moe=lambda x: self.ffn(x, input_ids))
        return R.layer_forward(self.c, w, self.index, streams, input_ids, positions, attend,
                               moe=lambda x: self.ffn(x, input_ids))


def layer_spec():
    """ModuleSpec of a DeepSeek-V4 decoder layer; submodules ``attention`` and ``moe`` are built with
    ``(c, layer_index, dtype)``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=DeepseekV4Layer, submodules={
        "attention": ModuleSpec(module=DeepseekV4Attention),
        "moe": ModuleSpec(module=DeepseekV4MoE),
    })


class _EmbeddingView:
    """``model.embedding.word_embeddings`` as the learner reads it (pad-row gradient rule)."""

    def __init__(self, model) -> None:
        self._model = model
        self.vocab_start_index, self.vocab_end_index = 0, model.c.vocab_size

    @property
    def weight(self):
        return self._model.embed.weight


def build_model(model_cfg: ModelConfig, parallel: ParallelConfig, hf_dir):
    """The DeepSeek-V4 learner model; weights are zeros until :func:`load_weights`. The layer
    sizes come from the checkpoint's config.json (what vLLM reads)."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import build_module

    v41 = is_v41(hf_dir)
    c = R41.v41_config(str(hf_dir)) if v41 else R.v4_config(str(hf_dir))
    # blockwise FP8 from the recipe (the base model's config.json does not carry it)
    c = dataclasses.replace(c, fp8=getattr(model_cfg, "fp8", "none"))
    for key, why in R.fp8_problems(c) if c.fp8 != "none" else ():
        raise ValueError(f"deepseek_v4 learner: model.fp8={c.fp8}: {why} (docs/tp.md \"FP8\"); change {key}, "
                         "or model.fp8=none")
    token_map = R41.token_map_of(str(hf_dir), c) if v41 and c.engram_layer_ids else None
    check_supported(parallel, c.num_experts)
    config = transformer_config(model_cfg, parallel)
    dtype = getattr(torch, model_cfg.dtype)

    class DeepseekV4Model(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.c = c
            _tree(c)(self, c, _maker(dtype), skip=("layers.",))
            self.layers = nn.ModuleList([build_module(layer_spec(), c, i, dtype) for i in range(c.num_layers)])
            self.embedding = nn.Module()
            self.embedding.word_embeddings = _EmbeddingView(self)

        def forward(self, input_ids, position_ids=None, attention_mask=None):
            """``input_ids [b, s]`` (right padded) -> fp32 logits ``[b, s, V]``."""
            import kernels

            b, s = input_ids.shape
            ids = input_ids.reshape(-1)
            pos = torch.arange(s, device=ids.device).repeat(b)
            streams = R.embed(c, self.embed.weight, ids)
            if v41:
                hashes = None
                if token_map is not None:  # exact integers, one sequence at a time
                    hashes = torch.cat([R41.ngram_hashes(c, token_map, input_ids[r], torch.arange(s))
                                        for r in range(b)])
                pre = None
                shared = ({"g": lambda n: R.lookup(self, n), "hist": {}, "keep": {}} if any(c.compress_ratios)
                          else None)
                for layer in self.layers:
                    streams, pre = layer(streams, ids, pos, s, pre, hashes, shared)
                h = R41.final_hidden(c, lambda n: R.lookup(self, n), streams, pre)
            else:
                for layer in self.layers:
                    streams = layer(streams, ids, pos, s)
                h = R.final_hidden(c, lambda n: R.lookup(self, n), streams)
            lm = self.embed.weight if c.tie_word_embeddings else self.head.weight
            return kernels.lm_head_logits(h, lm, out_dtype=torch.float32).view(b, s, -1)

    return DeepseekV4Model()


@torch.no_grad()
def load_weights(model, hf_dir_or_state_dict) -> None:
    """Copy a checkpoint's tensors in, name for name; every model tensor must be present."""
    sd = R.load_state_dict(hf_dir_or_state_dict)
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    missing = sorted(set(own) - set(sd))
    if missing:
        raise ValueError(f"DeepSeek-V4 checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    for name, t in own.items():
        if tuple(sd[name].shape) != tuple(t.shape):
            raise ValueError(f"DeepSeek-V4 tensor {name}: checkpoint {tuple(sd[name].shape)}, model {tuple(t.shape)}")
        t.copy_(sd[name].to(t.dtype))


@torch.no_grad()
def export_weights(model):
    """(original name, full tensor) for every parameter and buffer: what vLLM and the checkpoint hold.

    Collective under expert parallelism (every rank iterates to the end): each routed-expert tensor
    is all-gathered over the expert group, so every rank yields all experts."""
    yield from gather_full_weights(model, model.c.num_experts)
