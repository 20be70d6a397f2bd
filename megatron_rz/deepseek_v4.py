"""DeepSeek-V4 learner model on Megatron-Core (megatron-core 0.16.1 has no DeepSeek-V4 modules).

A ``MegatronModule`` whose decoder layers are built from a ``ModuleSpec`` (:func:`layer_spec`: swap
the attention or MoE submodule there). Every weight sits under its ORIGINAL DeepSeek checkpoint name
(``layers.3.attn.wq_b.weight``), so loading a Hugging Face / DeepSeek checkpoint and exporting
weights to vLLM are name-for-name copies. The numerics are the per-layer functions of
:mod:`vllm_bridge.aligned.dsv4_reference`, the same code the aligned vLLM class runs: here each
sequence attends over its own full payload history, in vLLM over the paged cache; the results are
bitwise equal.

Gradients: the ``kernels`` ops give exact forwards and plain-torch backwards. The indexer's top-k
choice carries no gradient (as in the reference model); the noaux_tc expert bias and the hash table
``tid2eid`` are buffers, not trained by the loss.

Parallelism: TP = EP = PP = 1 (data parallel through Megatron's DDP as for the other models);
:func:`check_supported` refuses other layouts with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_rz.recipe import ModelConfig, ParallelConfig
from vllm_bridge.aligned import dsv4_reference as R


def check_supported(parallel: ParallelConfig) -> None:
    if (parallel.tp, parallel.ep, parallel.pp, parallel.etp) != (1, 1, 1, 1):
        raise ValueError(
            f"deepseek_v4 learner: parallel tp={parallel.tp} ep={parallel.ep} pp={parallel.pp} etp={parallel.etp} "
            "is not supported yet (the DeepSeek-V4 modules run TP=EP=PP=1; scale out with parallel.dp): "
            "set parallel.tp, ep, pp and etp to 1"
        )


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
        expert_model_parallel_size=parallel.ep, gradient_accumulation_fusion=False,
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
        R.build_parameter_tree(self, c, _maker(dtype), prefix=f"layers.{index}.attn.")

    def forward(self, state: dict, positions: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        w = lambda n: R.lookup(self, n.removeprefix("attn."))
        return R.attend_sequence(self.c, w, self.index, state, positions, history)


class DeepseekV4MoE(nn.Module):
    """The ``layers.{i}.ffn.*`` weights (router, routed and shared experts); routing and expert
    compute are :func:`dsv4_reference.moe_forward` (hash table in the first layers, sqrt-softplus
    top-k after)."""

    def __init__(self, c: R.V4Config, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.c, self.index = c, index
        R.build_parameter_tree(self, c, _maker(dtype), prefix=f"layers.{index}.ffn.")

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        w = lambda n: R.lookup(self, n.removeprefix("ffn."))
        return R.moe_forward(self.c, w, self.index, x, input_ids)


class DeepseekV4Layer(nn.Module):
    """Hyper-connections and norms (its own weights) around the spec's attention and MoE."""

    def __init__(self, c: R.V4Config, index: int, dtype: torch.dtype, submodules: dict) -> None:
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        self.c, self.index = c, index
        R.build_parameter_tree(self, c, _maker(dtype), prefix=f"layers.{index}.", skip=("attn.", "ffn."))
        self.attn = build_module(submodules["attention"], c, index, dtype)
        self.ffn = build_module(submodules["moe"], c, index, dtype)

    def _weight(self, name: str) -> torch.Tensor:
        if name.startswith("ffn.") and not name.startswith("ffn_norm"):
            return R.lookup(self.ffn, name.removeprefix("ffn."))
        if name.startswith("attn.") and not name.startswith("attn_norm"):
            return R.lookup(self.attn, name.removeprefix("attn."))
        return R.lookup(self, name)

    def forward(self, streams, input_ids, positions, seq_len: int):
        def attend(state):
            outs = []  # one sequence at a time, over its own payload rows
            for b0 in range(0, state["q"].shape[0], seq_len):
                rows = slice(b0, b0 + seq_len)
                outs.append(self.attn({k: v[rows] for k, v in state.items()}, positions[rows], state["payload"][rows]))
            return torch.cat(outs, dim=0)

        return R.layer_forward(self.c, self._weight, self.index, streams, input_ids, positions, attend,
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

    check_supported(parallel)
    c = R.v4_config(str(hf_dir))
    config = transformer_config(model_cfg, parallel)
    dtype = getattr(torch, model_cfg.dtype)

    class DeepseekV4Model(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.c = c
            R.build_parameter_tree(self, c, _maker(dtype), skip=("layers.",))
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


def export_weights(model):
    """(original name, tensor) for every parameter and buffer: what vLLM and the checkpoint hold."""
    for name, t in model.named_parameters():
        yield name, t.detach()
    for name, t in model.named_buffers():
        yield name, t.detach()
