"""Shared vLLM model class for the aligned architectures (subclassed per architecture).

The module tree mirrors the Hugging Face checkpoint names exactly (``model.layers.3.mlp.experts.5.
gate_proj.weight`` is a parameter of that name), every weight a plain unpacked Parameter in the model
dtype, so weights can be read back (``named_parameters``), loaded with vLLM's
``default_weight_loader`` at start-up and reloaded in place through ``Worker.reload_weights``
(vLLM's layerwise reload wraps each parameter's ``weight_loader``; ``load_weights`` below goes
through it).

All numerics are the per-layer functions of :mod:`vllm_bridge.aligned.reference` (the same code the
full-sequence reference runs); only the attention core differs: q/k/v go through a vLLM
``Attention`` layer with the aligned backend (:mod:`.attention_backend`), which writes K/V into the
paged cache and runs ``kernels.attention`` per sequence.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from . import reference as ref
from .attention_backend import RZAlignedAttentionBackend


class _Params(nn.Module):
    """A leaf holding named parameters (e.g. ``weight``), no forward of its own."""

    def __init__(self, dtype: torch.dtype, **shapes) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False))


def _mlp(dtype, hidden: int, inter: int) -> nn.Module:
    m = nn.Module()
    m.gate_proj = _Params(dtype, weight=(inter, hidden))
    m.up_proj = _Params(dtype, weight=(inter, hidden))
    m.down_proj = _Params(dtype, weight=(hidden, inter))
    return m


class _LogitsScale(nn.Module):
    """Stands where vLLM models keep their LogitsProcessor: only its ``scale`` is honoured
    (``vllm_bridge.worker_ext.rz_set_logit_scale`` sets it)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = 1.0
        self.soft_cap = None


class RZAlignedForCausalLM(nn.Module):
    """Base class; subclasses set ``ARCH`` and build their attention modules."""

    ARCH = ""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.config = hf
        self.c = c = ref.arch_config(hf)
        if c.arch != self.ARCH:
            raise ValueError(f"{type(self).__name__} needs a {self.ARCH} config, got {c.arch}")
        self.cache_config = vllm_config.cache_config
        dtype = vllm_config.model_config.dtype
        self.rz_dtype = dtype
        H = c.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = _Params(dtype, weight=(c.vocab_size, H))
        layers = []
        for i in range(c.num_layers):
            layer = nn.Module()
            layer.input_layernorm = _Params(dtype, weight=(H,))
            layer.post_attention_layernorm = _Params(dtype, weight=(H,))
            layer.self_attn = self._build_attention(i, dtype, f"model.layers.{i}.self_attn")
            if c.moe_layers[i]:
                mlp = nn.Module()
                gate = dict(weight=(c.num_experts, H))
                if c.has_expert_bias:
                    gate["e_score_correction_bias"] = (c.num_experts,)
                mlp.gate = _Params(dtype, **gate)
                mlp.experts = nn.ModuleList([_mlp(dtype, H, c.moe_intermediate_size) for _ in range(c.num_experts)])
                if c.n_shared_experts:
                    mlp.shared_experts = _mlp(dtype, H, c.moe_intermediate_size * c.n_shared_experts)
                layer.mlp = mlp
            else:
                layer.mlp = _mlp(dtype, H, c.intermediate_size)
            layers.append(layer)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = _Params(dtype, weight=(H,))
        if not c.tie_word_embeddings:
            self.lm_head = _Params(dtype, weight=(c.vocab_size, H))
        self.logits_processor = _LogitsScale(c.vocab_size)
        # Blockwise FP8 (config key reference.FP8_CONFIG_KEY, e.g. hf_overrides={"rz_fp8": "blockwise"}):
        # the parameters stay the checkpoint's high-precision weights (what a weight sync writes and
        # reads back); their e4m3 copies + 128x128 scales live here, off the module tree (vLLM's
        # layerwise reload rebuilds registered buffers), quantised once per load / in-place update.
        self.rz_fp8 = ref.FP8WeightCache() if c.fp8 == "blockwise" else None

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
            attn_backend=RZAlignedAttentionBackend,
            **extra,
        )

    # ---- vLLM model interface --------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[input_ids.long()]  # exact gather

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        c = self.c
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        cos, sin = ref.rope_tables(c, positions)
        for i, layer in enumerate(self.model.layers):
            w = layer.get_parameter if self.rz_fp8 is None else self.rz_fp8.getter(layer.get_parameter, f"{i}.")
            h = ref.layer_forward(
                c, w, i, h, cos, sin, lambda q, k, v, layer=layer: self._attend(layer, q, k, v)
            )
        return ref.final_norm(c, self.model.norm.weight, h)

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
                # rotary inv_freq buffers, MTP layers (model.layers.{num_layers}.*), a tied lm_head
                continue
            loader = getattr(p, "weight_loader", default_weight_loader)
            loader(p, w)
            loaded.add(name)
        if self.rz_fp8 is not None:
            self.rz_fp8.clear()  # re-quantise from the new weights at the next forward
        return loaded
