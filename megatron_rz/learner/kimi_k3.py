"""Kimi-Linear / Kimi-K3 learner model on Megatron-Core (megatron-core 0.16.1 has no KDA or Kimi modules).

A ``MegatronModule`` whose decoder layers are built from ``ModuleSpec`` s (:func:`layer_spec`: the
token mixer, KDA or NoPE MLA, and the MLP, dense or the (latent) MoE, are submodules chosen per
layer from the checkpoint's schedule). Every weight sits under its Kimi checkpoint name
(``model.layers.0.self_attn.q_conv1d.weight``, ``model.layers.1.block_sparse_moe.experts.3.w1.weight``;
:func:`kernels.models.kimi_k3.parameter_shapes`), the tree of the aligned vLLM class, so loading
and exporting weights are name-for-name copies.

Numerics: the functions of :mod:`kernels.models.kimi_k3` / :mod:`kernels.models.kda` that the
aligned vLLM class (``vllm_bridge/aligned/kimi_k3.py``) and ``reference_logprobs`` run:
``decoder_layer_apply`` (residuals or K3's block attention residuals) with this layer's mixer and
MLP modules, ``final_hidden``, ``kernels.lm_head_logits``. The learner holds whole sequences:

* **KDA**: :func:`kernels.models.kda.kda_layer_forward` over the whole (right-padded) sequence
  from a zero state, ``kda_chunked`` with ``LEARNER_KDA_CHUNK`` = 8 tokens (the engine prefills in
  chunks of 64 and decodes one token at a time from its cached fp32 state: the same per-token
  step on the same fp32 state, so the same bits; the learner's chunk is deliberately another one).
  Padding sits after the real tokens and the recurrence is causal, so it never reaches them.
* **MLA**: :func:`kernels.models.kimi_k3.mla_nope_forward` without a cache
  (``kernels.causal_attention``: the rows the engine's paged attention gives).
* **MoE**: :func:`kernels.models.kimi_k3.kimi_moe_forward` (router, grouped top-k, routed
  experts on ``x`` or on the latent ``routed_expert_down_proj(x)``, fp32 slot-order combine,
  latent norm, up-projection, shared expert).

Gradients: the ``kernels`` ops give exact forwards and plain-torch backwards (the KDA recurrence
is differentiated through every per-token step). The top-k choice carries no gradient; the
noaux_tc bias ``gate.e_score_correction_bias`` is an fp32 buffer (as vLLM keeps it), not trained
by the loss.

Parallelism: data parallel (Megatron's DDP) and expert parallel (``parallel.ep``): each rank holds
``num_experts / ep`` routed experts (named by their global id); the ranks all-gather their rows (the
MoE input, or the latent) and routing, each computes the slots routed to its own experts (the others
stay exact zeros), a reduce-scatter hands every row its slots back (a sum with exact zeros:
the same bits), and the combine runs in slot order as with one rank. Tensor / pipeline / expert
tensor parallel are refused (:func:`check_supported`).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.models import kda as K
from kernels.models import kimi_k3 as R
from megatron_rz.learner.expert_export import expert_group, expert_id, gather_full_weights
from megatron_rz.recipe import ModelConfig, ParallelConfig

LEARNER_KDA_CHUNK = 8  # kda_chunked's chunk in the learner (any value gives the same bits)


def check_supported(parallel: ParallelConfig, num_experts: int) -> None:
    if (parallel.tp, parallel.pp, parallel.etp) != (1, 1, 1):
        raise ValueError(
            f"kimi_k3 learner: parallel tp={parallel.tp} pp={parallel.pp} etp={parallel.etp} is not supported yet "
            "(the Kimi-K3 modules are data and expert parallel): set parallel.tp, parallel.pp and parallel.etp to 1 "
            "and scale with parallel.dp and parallel.ep")
    if parallel.ep > 1 and (not num_experts or num_experts % parallel.ep):
        raise ValueError(f"kimi_k3 learner: parallel.ep={parallel.ep} must divide the {num_experts} routed experts")


def _getter(module: nn.Module):
    """``name -> tensor`` relative to ``module`` (parameter or buffer), None where absent: the
    reference functions' getters (they test optional weights with ``is None``)."""

    def get(name: str):
        mod, _, leaf = name.rpartition(".")
        try:
            m = module.get_submodule(mod) if mod else module
        except AttributeError:
            return None
        t = m._parameters.get(leaf)
        return m._buffers.get(leaf) if t is None else t

    return get


def _maker(dtype: torch.dtype):
    def make(name: str, shape: tuple, kind: str):
        if kind == "fp32_buffer":
            return torch.zeros(shape, dtype=torch.float32)
        return nn.Parameter(torch.zeros(shape, dtype=dtype))

    return make


class _Sub(nn.Module):
    """The weights of one layer under ``prefix`` (names relative to it), from the model's shapes."""

    def __init__(self, shapes: dict, prefix: str, dtype: torch.dtype, include=None) -> None:
        from kernels.models import dsv4

        super().__init__()
        dsv4.add_parameter_tree(self, shapes, _maker(dtype), prefix=prefix, include=include)


class KimiKDA(_Sub):
    """``model.layers.{i}.self_attn.*`` of a KDA layer; the whole sequence from a zero state."""

    def __init__(self, c: R.KimiConfig, shapes: dict, index: int, dtype: torch.dtype) -> None:
        super().__init__(shapes, f"model.layers.{index}.self_attn.", dtype)
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.kda_layer_forward(x, _getter(self), self.c.kda, None, chunk_size=LEARNER_KDA_CHUNK)[0]


class KimiMLA(_Sub):
    """``model.layers.{i}.self_attn.*`` of a NoPE MLA layer; causal attention over the sequence."""

    def __init__(self, c: R.KimiConfig, shapes: dict, index: int, dtype: torch.dtype) -> None:
        super().__init__(shapes, f"model.layers.{index}.self_attn.", dtype)
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return R.mla_nope_forward(self.c, _getter(self), x, None)[0]


class KimiDenseMLP(_Sub):
    """``model.layers.{i}.mlp.*``: the dense SwiGLU / SituGLU MLP on rows ``[N, H]``."""

    def __init__(self, c: R.KimiConfig, shapes: dict, index: int, dtype: torch.dtype) -> None:
        super().__init__(shapes, f"model.layers.{index}.mlp.", dtype)
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return R.dense_mlp_forward(self.c, _getter(self), x, "")


class KimiMoE(_Sub):
    """``model.layers.{i}.block_sparse_moe.*``: router, shared expert and latent projections on
    every rank, this expert-parallel rank's routed experts; rows ``[N, H]``."""

    def __init__(self, c: R.KimiConfig, shapes: dict, index: int, dtype: torch.dtype) -> None:
        ep, rank, group = expert_group()
        per = c.num_experts // ep
        owned = range(rank * per, (rank + 1) * per)
        super().__init__(shapes, f"model.layers.{index}.block_sparse_moe.", dtype,
                         include=lambda n: expert_id(n) is None or expert_id(n) in owned)
        self.c, self.owned, self.ep, self.group = c, owned, ep, group
        for name, p in self.named_parameters():
            if name.startswith("experts."):
                p.allreduce = False  # Megatron DDP: reduce over the expert-data-parallel group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import kernels

        c, get = self.c, _getter(self)
        if self.ep == 1:
            return R.kimi_moe_forward(c, get, x)[0]
        return self._expert_parallel(c, get, x, kernels)

    def _expert_parallel(self, c, get, x, kernels):
        """kimi_moe_forward's ops with the routed slots computed where their expert lives."""
        from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region

        from megatron_rz.learner.aligned_spec import all_gather_first_dim, gather_seq, keep_in_graph

        ids, wts, shared = R.route_and_shared(c, get, x)
        z = x if c.latent_size is None else kernels.linear(x, get("routed_expert_down_proj.weight"))
        T, k = ids.shape
        z_all = gather_seq(z, self.group)  # autograd: all-gather forward, reduce-scatter backward
        ids_all = all_gather_first_dim(ids, self.group)
        y_all = keep_in_graph(R.routed_slots(c, get, z_all, ids_all, self.owned), z_all)  # other ranks' slots: exact zeros
        y = reduce_scatter_to_sequence_parallel_region(y_all.reshape(-1, k * z.shape[1]), group=self.group)
        y = y.view(T, k, -1)
        if c.latent_size is None:
            return R.fold_combine(y, wts, shared, x.dtype)
        r = R.fold_combine(y, wts, None, x.dtype)
        if c.latent_norm:
            r = kernels.rms_norm(r, get("routed_expert_norm.weight"), c.rms_norm_eps)
        u = kernels.linear(r, get("routed_expert_up_proj.weight"))
        out = u.float() if shared is None else u.float() + shared.float()
        return out.to(x.dtype)


class KimiK3Layer(nn.Module):
    """Norms and (K3) attention-residual weights of ``model.layers.{i}`` around the spec's mixer
    (``self_attn``) and MLP (``mlp`` dense / ``block_sparse_moe``)."""

    def __init__(self, c: R.KimiConfig, shapes: dict, index: int, dtype: torch.dtype, submodules: dict) -> None:
        from kernels.models import dsv4
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        self.c, self.index = c, index
        dsv4.add_parameter_tree(self, shapes, _maker(dtype), prefix=f"model.layers.{index}.",
                                skip=("self_attn.", "mlp.", "block_sparse_moe."))
        self.self_attn = build_module(submodules["mixer"], c, shapes, index, dtype)
        self.mlp_name = R.moe_prefix(c, index).rstrip(".")
        setattr(self, self.mlp_name, build_module(submodules["mlp"], c, shapes, index, dtype))

    def forward(self, h):
        return R.decoder_layer_apply(self.c, _getter(self), self.index, h, self.self_attn,
                                     mlp_rows=getattr(self, self.mlp_name))


def layer_spec(c: R.KimiConfig, index: int):
    """ModuleSpec of decoder layer ``index``: submodules ``mixer`` (KDA / MLA) and ``mlp`` (dense /
    MoE), built with ``(c, shapes, index, dtype)``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=KimiK3Layer, submodules={
        "mixer": ModuleSpec(module=KimiKDA if c.layer_types[index] == "kda" else KimiMLA),
        "mlp": ModuleSpec(module=KimiMoE if c.mlp_types[index] == "moe" else KimiDenseMLP),
    })


class _EmbeddingView:
    """``model.embedding.word_embeddings`` as the learner reads it (pad-row gradient rule)."""

    def __init__(self, model) -> None:
        self._model = model
        self.vocab_start_index, self.vocab_end_index = 0, model.c.vocab_size

    @property
    def weight(self):
        return self._model.model.embed_tokens.weight


def read_config(hf_dir) -> tuple[R.KimiConfig, bool]:
    """(KimiConfig, K3's full-rank KDA output gate) of a checkpoint directory."""
    import json
    import os

    raw = json.loads(open(os.path.join(os.fspath(hf_dir), "config.json")).read())
    lac = (raw.get("text_config") or raw).get("linear_attn_config") or {}
    return R.kimi_config(raw), bool(lac.get("use_full_rank_gate", False))


def build_model(model_cfg: ModelConfig, parallel: ParallelConfig, hf_dir):
    """The Kimi-K3 learner model; weights are zeros until :func:`load_weights`. The sizes and the
    layer schedule come from the checkpoint's config.json (what vLLM reads)."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import build_module

    from kernels.models import dsv4
    from megatron_rz.learner.deepseek_v4 import transformer_config

    from megatron_rz.learner.aligned_spec import check_aligned_supported

    c, full_gate = read_config(hf_dir)
    check_supported(parallel, c.num_experts)
    check_aligned_supported(model_cfg, parallel)  # row-parallel K by 8, named by recipe key
    shapes = R.parameter_shapes(c, full_rank_gate=full_gate)
    config = transformer_config(model_cfg, parallel)
    dtype = getattr(torch, model_cfg.dtype)

    class KimiK3Model(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.c = c
            dsv4.add_parameter_tree(self, shapes, _maker(dtype), skip=("model.layers.",))
            self.model.layers = nn.ModuleList([build_module(layer_spec(c, i), c, shapes, i, dtype)
                                               for i in range(c.num_layers)])
            self.embedding = nn.Module()
            self.embedding.word_embeddings = _EmbeddingView(self)

        def forward(self, input_ids, position_ids=None, attention_mask=None):
            """``input_ids [b, s]`` (right padded) -> fp32 logits ``[b, s, V]``."""
            import kernels

            b, s = input_ids.shape
            emb = self.model.embed_tokens.weight
            h = R.embed_stream(c, emb[input_ids.reshape(-1).long()].view(b, s, -1))
            for layer in self.model.layers:
                h = layer(h)
            h = R.final_hidden(c, _getter(self), h)
            head = emb if c.tie_word_embeddings else self.lm_head.weight
            return kernels.lm_head_logits(h.reshape(b * s, -1), head, out_dtype=torch.float32).view(b, s, -1)

    return KimiK3Model()


def _read_checkpoint(hf_dir_or_state_dict) -> dict:
    if isinstance(hf_dir_or_state_dict, dict):
        return hf_dir_or_state_dict
    from pathlib import Path

    from safetensors.torch import load_file

    sd = {}
    for f in sorted(Path(hf_dir_or_state_dict).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return {k.removeprefix("language_model."): v for k, v in sd.items()}


@torch.no_grad()
def load_weights(model, hf_dir_or_state_dict) -> None:
    """Copy a checkpoint's tensors in, name for name (A_log ``[1, 1, H, 1]`` / conv ``[P, W]``
    reshaped as vLLM does); every model tensor must be present."""
    sd = _read_checkpoint(hf_dir_or_state_dict)
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    missing = sorted(set(own) - set(sd))
    if missing:
        raise ValueError(f"Kimi-K3 checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    for name, t in own.items():
        w = sd[name]
        if tuple(w.shape) != tuple(t.shape):
            if w.numel() != t.numel():
                raise ValueError(f"Kimi-K3 tensor {name}: checkpoint {tuple(w.shape)}, model {tuple(t.shape)}")
            w = w.reshape(t.shape)
        t.copy_(w.to(t.dtype))


@torch.no_grad()
def export_weights(model):
    """(Kimi name, full tensor) for every parameter and buffer: what vLLM and the checkpoint hold.

    Collective under expert parallelism (every rank iterates to the end): each routed-expert tensor
    is all-gathered over the expert group, so every rank yields all experts."""
    yield from gather_full_weights(model, model.c.num_experts)
