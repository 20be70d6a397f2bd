"""RZAlignedKimiK3ForCausalLM: Kimi-Linear / Kimi-K3 for vLLM with every op through ``kernels``.

Select with ``hf_overrides={"architectures": ["RZAlignedKimiK3ForCausalLM"]}`` on a Kimi-Linear
checkpoint (``model_type: kimi_linear``, vLLM's ``KimiLinearConfig`` schema: ``linear_attn_config``
with the 1-indexed ``kda_layers`` / ``full_attn_layers``; K3 keys ``mla_use_output_gate``,
``routed_expert_hidden_size``, ``latent_moe_use_norm``, ``attn_res_block_size``, ``hidden_act:
situ``, ``linear_attn_config.gate_lower_bound`` / ``use_full_rank_gate``). The module tree mirrors
the Kimi checkpoint names (``model.layers.0.self_attn.q_conv1d.weight``,
``model.layers.1.block_sparse_moe.experts.3.w1.weight``, ...), every weight a plain Parameter in the
model dtype, loaded (and reloaded in place) by name.

Numerics: :mod:`kernels.models.kimi_k3` / :mod:`kernels.models.kda`, the very functions
``reference_logprobs`` runs (``decoder_layer_apply`` = ``decoder_layer_forward`` with the engine's
mixers, MoE / latent MoE / dense MLP, block attention residuals, ``final_hidden``,
``kernels.lm_head_logits``); only where the sequence state lives differs:

* **KDA layers** (:class:`RZKDALayer`: the parameters; its child :class:`RZKDAState`, a vLLM
  ``MambaBase`` layer without parameters, ``model.layers.{i}.self_attn.rz_state``): two states per request slot in
  vLLM's mamba state cache, ``conv [3P, W - 1]`` (activation dtype; vLLM's "DS" layout is the
  reference's, "SD" is viewed transposed) and ``recurrent [H, K, V]`` **fp32** (the reference's
  ``[K, V]`` orientation; only this class reads it, so vLLM's Triton ``[V, K]`` convention does not
  apply; the shape is the same as K = V). Metadata: vLLM's ``LINEAR`` mamba backend
  (``query_start_loc``, ``seq_lens``, ``state_indices_tensor``); a request has an initial state iff
  ``seq_len > query_len`` (tokens computed before this step). Each step: decodes (one token, with a
  state) batched into one :func:`kernels.models.kda.kda_layer_forward` call on their gathered
  states, every other request (a prompt or a prompt chunk) alone from its cached state (None for a
  first chunk, exactly the reference's start); the new states are written back to the slots.
  Chunked prefill == one prefill == decode bitwise is kda.py's contract.
* **MLA layers** (NoPE): expanded per-head form as the aligned DeepSeek-V3 class: q and the
  per-head ``k = [k_nope | k_pe]``, ``v`` from :func:`kernels.models.kimi_k3.mla_nope_qkv`, K/V in a
  paged cache of the aligned attention backend (``num_kv_heads = num_attention_heads``, head size
  ``qk_nope + qk_rope``, V zero-padded, attended over its first ``v_head_dim`` channels), then
  :func:`~kernels.models.kimi_k3.mla_nope_output` (K3's sigmoid output gate, ``o_proj``).
* **Hybrid cache**: ``IsHybrid`` / ``HasInnerState`` with ``get_mamba_state_shape_from_config`` /
  ``_dtype_`` / ``_copy_func`` (vLLM's KDA shapes and copy functions), so vLLM allocates attention
  and mamba pages in one pool (it pads the mamba page to the attention page).

Engine settings: as the other aligned classes (fp32 or bf16, ``enforce_eager``, processed
logprobs), plus ``VLLM_MLA_DISABLE=1`` in the engine's environment (as ``vllm_bridge/engine.py``
sets for the aligned MLA classes): ``kimi_linear`` is an MLA model type to vLLM, and with MLA on,
vLLM-CPU turns chunked prefill and prefix caching off (``platforms/cpu.py``) and sizes the hybrid
page from the latent head. On CPU the MLA layers use the aligned backend with a metadata builder
that skips vLLM's C++ CPU-attention scheduler (``cpu_attn_get_scheduler_metadata`` refuses head
sizes such as 24; the aligned impl never reads it). Tested with prefix caching off (vLLM's hybrid
default with it on is ``mamba_cache_mode="align"``, not tried). The KDA state layer holds no
parameters, so vLLM's layerwise in-place reload (a weight sync) reloads the KDA weights like any
other module (it defers attention-like layers and restores their old tensors).

Not supported (refused at start-up): tensor parallelism (one worker computes the whole model), a
recurrent state dtype other than fp32 (``mamba_ssm_cache_dtype``), speculative decoding.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

import kernels
from kernels.models import kda as K
from kernels.models import kimi_k3 as R

from vllm_bridge.vllm_compat import aligned_attention_backend

from ._model import LogitsScale, Params

__all__ = ["RZAlignedKimiK3ForCausalLM", "RZKDALayer", "RZKDAState"]

PREFILL_CHUNK = 64  # kda_chunked's chunk (the same bits for any value)


def _attention_backend() -> type:
    """The aligned attention backend; on CPU with a metadata builder that skips vLLM's C++ CPU
    attention scheduler (``cpu_attn_get_scheduler_metadata`` refuses head sizes such as Kimi's 24;
    the aligned impl never reads its output)."""
    base = aligned_attention_backend()
    from vllm_bridge.aligned.attention_backend import RZAlignedAttentionBackend

    if base is not RZAlignedAttentionBackend:
        return base
    return _cpu_backend()


_CPU_BACKEND = None


def _cpu_backend() -> type:
    global _CPU_BACKEND
    if _CPU_BACKEND is not None:
        return _CPU_BACKEND
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, CPUAttentionMetadataBuilder

    from vllm_bridge.aligned.attention_backend import RZAlignedAttentionBackend

    class RZKimiAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
            m = common_attn_metadata
            return CPUAttentionMetadata(
                num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                query_start_loc=m.query_start_loc, max_seq_len=m.max_seq_len, seq_lens=m.seq_lens,
                block_table=m.block_table_tensor, slot_mapping=m.slot_mapping, scheduler_metadata=None,
                causal=True, encoder_cache=None, dynamic_causal=None)

    class RZKimiAttentionBackend(RZAlignedAttentionBackend):
        @staticmethod
        def get_builder_cls():
            return RZKimiAttentionMetadataBuilder

    _CPU_BACKEND = RZKimiAttentionBackend
    return _CPU_BACKEND


def _getter(module: nn.Module):
    """``name -> Parameter`` relative to ``module``, None where absent (the reference's getters)."""
    def get(name: str):
        try:
            return module.get_parameter(name)
        except AttributeError:
            return None
    return get


def _kda_state_shape(c: R.KimiConfig):
    kc = c.kda
    return MambaStateShapeCalculator.kda_state_shape(1, kc.num_heads, kc.head_dim,
                                                     conv_kernel_size=kc.conv_kernel, num_spec=0)


def _kda_state_dtype(vllm_config: VllmConfig):
    dts = MambaStateDtypeCalculator.kda_state_dtype(vllm_config.model_config.dtype,
                                                    vllm_config.cache_config.mamba_cache_dtype,
                                                    vllm_config.cache_config.mamba_ssm_cache_dtype)
    if dts[1] != torch.float32:
        raise ValueError(f"RZAlignedKimiK3ForCausalLM: the KDA recurrent state must be fp32 (got {dts[1]}; "
                         "leave mamba_ssm_cache_dtype at auto or float32)")
    return dts


class RZKDAState(nn.Module, MambaBase):
    """The vLLM state-cache layer of one KDA mixer: no parameters (vLLM's layerwise reload defers
    attention-like layers and puts their old tensors back), only ``self.kv_cache = (conv,
    recurrent)`` (bound by vLLM: ``MambaBase.bind_kv_cache``)."""

    def __init__(self, c: R.KimiConfig, vllm_config: VllmConfig, prefix: str) -> None:
        nn.Module.__init__(self)
        self.prefix = prefix
        self.rz_c = c
        self.rz_vllm_config = vllm_config
        self.kv_cache = ()
        sfc = vllm_config.compilation_config.static_forward_context
        if prefix in sfc:
            raise ValueError(f"Duplicate layer name: {prefix}")
        sfc[prefix] = self

    def get_state_shape(self):
        return _kda_state_shape(self.rz_c)

    def get_state_dtype(self):
        return _kda_state_dtype(self.rz_vllm_config)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def process_weights_after_loading(self, *args, **kwargs) -> None:
        pass


class RZKDALayer(nn.Module):
    """One KDA mixer: its parameters (Kimi checkpoint names, relative to ``self_attn.``) and its
    state-cache layer ``rz_state`` (:class:`RZKDAState`, vLLM layer ``...self_attn.rz_state``)."""

    def __init__(self, c: R.KimiConfig, vllm_config: VllmConfig, prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.rz_c = c
        kc = c.kda
        H, P, D, Hd, W = c.hidden_size, kc.proj_dim, kc.head_dim, kc.num_heads, kc.conv_kernel
        for n in "qkv":
            setattr(self, f"{n}_proj", Params(dtype, weight=(P, H)))
            setattr(self, f"{n}_conv1d", Params(dtype, weight=(P, 1, W)))
        self.f_a_proj = Params(dtype, weight=(D, H))
        self.f_b_proj = Params(dtype, weight=(P, D))
        self.register_parameter("dt_bias", nn.Parameter(torch.zeros(P, dtype=dtype), requires_grad=False))
        self.register_parameter("A_log", nn.Parameter(torch.zeros(Hd, dtype=dtype), requires_grad=False))
        self.b_proj = Params(dtype, weight=(Hd, H))
        if c.extra.get("kda_full_rank_gate"):
            self.g_proj = Params(dtype, weight=(P, H))
        else:
            self.g_a_proj = Params(dtype, weight=(D, H))
            self.g_b_proj = Params(dtype, weight=(P, D))
        self.o_norm = Params(dtype, weight=(D,))
        self.o_proj = Params(dtype, weight=(H, P))
        self.rz_state = RZKDAState(c, vllm_config, f"{prefix}.rz_state")
        # requests computed so far, by kind (a first chunk / a later prompt chunk from the cached
        # state / a decode step): read by tests to see that chunked prefill really happened
        self.rz_counts = {"first_chunk": 0, "chunk_from_state": 0, "decode": 0}

    # ---- compute ----------------------------------------------------------------------------------
    def rz_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [1, N, H]`` (post-norm, the step's tokens of all requests) -> the mixer output."""
        sl = self.rz_state
        md = get_forward_context().attn_metadata
        m = md.get(sl.prefix) if isinstance(md, dict) else None
        out = torch.zeros_like(x)
        if m is None or not sl.kv_cache:  # profiling / dummy run
            return out
        kc = self.rz_c.kda
        get = _getter(self)
        conv, rec = sl.kv_cache
        if not is_conv_state_dim_first():
            conv = conv.transpose(-1, -2)  # [slots, 3P, W - 1] view either way
        qsl = m.query_start_loc.tolist()
        seq_lens = m.seq_lens.tolist()
        slots = m.state_indices_tensor.tolist()
        dec_tok, dec_slot = [], []
        for i in range(len(qsl) - 1):
            a, b = qsl[i], qsl[i + 1]
            n = b - a
            if n <= 0 or slots[i] < 0:
                continue
            s = slots[i]
            has_state = int(seq_lens[i]) > n
            if n == 1 and has_state:
                dec_tok.append(a)
                dec_slot.append(s)
                continue
            st = {"conv": conv[s:s + 1], "recurrent": rec[s:s + 1]} if has_state else None
            self.rz_counts["chunk_from_state" if has_state else "first_chunk"] += 1
            o, ns = K.kda_layer_forward(x[:, a:b], get, kc, st, chunk_size=PREFILL_CHUNK)
            out[:, a:b] = o
            conv[s] = ns["conv"][0].to(conv.dtype)
            rec[s] = ns["recurrent"][0]
        if dec_tok:
            self.rz_counts["decode"] += len(dec_tok)
            tok = torch.tensor(dec_tok, dtype=torch.long)
            sl = torch.tensor(dec_slot, dtype=torch.long)
            st = {"conv": conv[sl], "recurrent": rec[sl]}
            o, ns = K.kda_layer_forward(x[0, tok].unsqueeze(1), get, kc, st, chunk_size=None)
            out[0, tok] = o[:, 0]
            conv[sl] = ns["conv"].to(conv.dtype)
            rec[sl] = ns["recurrent"]
        return out


def _mlp_params(dtype, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> nn.Module:
    m = nn.Module()
    g, u, d = names
    setattr(m, g, Params(dtype, weight=(inter, hidden)))
    setattr(m, u, Params(dtype, weight=(inter, hidden)))
    setattr(m, d, Params(dtype, weight=(hidden, inter)))
    return m


class RZAlignedKimiK3ForCausalLM(nn.Module, HasInnerState, IsHybrid):
    # load_weights copies in place, nothing processed after loading: syncs commit through it directly
    # (worker_ext.rz_commit_weights)
    RZ_LOADS_IN_PLACE = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.config = hf
        self.c = c = R.kimi_config(hf)
        lac = getattr(hf, "linear_attn_config", None) or {}
        c.extra["kda_full_rank_gate"] = bool(lac.get("use_full_rank_gate", False))
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError("RZAlignedKimiK3ForCausalLM: tensor parallelism is not supported (tp=1)")
        if vllm_config.speculative_config is not None:
            raise ValueError("RZAlignedKimiK3ForCausalLM: speculative decoding is not supported")
        self.cache_config = vllm_config.cache_config
        dtype = vllm_config.model_config.dtype
        self.rz_dtype = dtype
        # the shared loader / worker-extension state (no shards, no FP8 cache, no packed weights)
        self.rz_shards, self.rz_tp, self.rz_fp8, self.rz_fast = {}, 1, None, False
        H = c.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = Params(dtype, weight=(c.vocab_size, H))
        layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}"
            layer = nn.Module()
            layer.input_layernorm = Params(dtype, weight=(H,))
            layer.post_attention_layernorm = Params(dtype, weight=(H,))
            if c.attn_res_block_size is not None:
                for kind in ("self_attention", "mlp"):
                    setattr(layer, f"{kind}_res_norm", Params(dtype, weight=(H,)))
                    setattr(layer, f"{kind}_res_proj", Params(dtype, weight=(1, H)))
            if c.layer_types[i] == "kda":
                layer.self_attn = RZKDALayer(c, vllm_config, f"{p}.self_attn", dtype)
            else:
                layer.self_attn = self._build_mla(dtype, f"{p}.self_attn")
            if c.mlp_types[i] == "dense":
                layer.mlp = _mlp_params(dtype, H, c.intermediate_size)
            else:
                layer.block_sparse_moe = self._build_moe(dtype)
            layers.append(layer)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = Params(dtype, weight=(H,))
        if c.attn_res_block_size is not None:
            self.model.output_attn_res_norm = Params(dtype, weight=(H,))
            self.model.output_attn_res_proj = Params(dtype, weight=(1, H))
        if not c.tie_word_embeddings:
            self.lm_head = Params(dtype, weight=(c.vocab_size, H))
        self.logits_processor = LogitsScale(c.vocab_size)

    def _build_mla(self, dtype, prefix: str) -> nn.Module:
        c = self.c
        H, nh = c.hidden_size, c.num_heads
        m = nn.Module()
        if c.q_lora_rank is None:
            m.q_proj = Params(dtype, weight=(nh * c.qk_head_dim, H))
        else:
            m.q_a_proj = Params(dtype, weight=(c.q_lora_rank, H))
            m.q_a_layernorm = Params(dtype, weight=(c.q_lora_rank,))
            m.q_b_proj = Params(dtype, weight=(nh * c.qk_head_dim, c.q_lora_rank))
        m.kv_a_proj_with_mqa = Params(dtype, weight=(c.kv_lora_rank + c.qk_rope_head_dim, H))
        m.kv_a_layernorm = Params(dtype, weight=(c.kv_lora_rank,))
        m.kv_b_proj = Params(dtype, weight=(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
        if c.mla_output_gate:
            m.g_proj = Params(dtype, weight=(nh * c.v_head_dim, H))
        m.o_proj = Params(dtype, weight=(H, nh * c.v_head_dim))
        if c.v_head_dim > c.qk_head_dim:
            raise NotImplementedError("aligned Kimi MLA: v_head_dim > qk head dim")
        m.attn = Attention(num_heads=nh, head_size=c.qk_head_dim, scale=c.attn_scale, num_kv_heads=nh,
                           cache_config=self.cache_config, quant_config=None, prefix=f"{prefix}.attn",
                           attn_backend=_attention_backend(), rz_v_head_dim=c.v_head_dim)
        return m

    def _build_moe(self, dtype) -> nn.Module:
        c = self.c
        H, E, I = c.hidden_size, c.num_experts, c.moe_intermediate_size
        m = nn.Module()
        m.gate = Params(dtype, weight=(E, H))
        m.gate.register_parameter("e_score_correction_bias",
                                  nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False))
        hin = H if c.latent_size is None else c.latent_size
        m.experts = nn.ModuleList([_mlp_params(dtype, hin, I, ("w1", "w3", "w2")) for _ in range(E)])
        if c.num_shared_experts:
            m.shared_experts = _mlp_params(dtype, H, I * c.num_shared_experts)
        if c.latent_size is not None:
            m.routed_expert_down_proj = Params(dtype, weight=(c.latent_size, H))
            if c.latent_norm:
                m.routed_expert_norm = Params(dtype, weight=(c.latent_size,))
            m.routed_expert_up_proj = Params(dtype, weight=(H, c.latent_size))
        return m

    # ---- hybrid cache (vLLM's IsHybrid interface) ------------------------------------------------
    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return _kda_state_dtype(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return _kda_state_shape(R.kimi_config(vllm_config.model_config.hf_config))

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    # ---- mixers -------------------------------------------------------------------------------
    def _mla(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        a = layer.self_attn
        get = _getter(a)
        xt = x[0]
        q, k, v = R.mla_nope_qkv(c, get, xt)
        N, nh, D = q.shape
        dv = c.v_head_dim
        if dv < D:
            v = torch.cat([v, v.new_zeros(N, nh, D - dv)], dim=-1)
        o = a.attn(q.reshape(N, -1).contiguous(), k.reshape(N, -1).contiguous(), v.reshape(N, -1).contiguous())
        o = o.view(N, nh, D)[:, :, :dv].reshape(N, nh * dv)
        return R.mla_nope_output(c, get, xt, o)[None]

    # ---- vLLM model interface --------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[input_ids.long()]  # exact gather

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        c = self.c
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        h = R.embed_stream(c, h[None])  # [1, N, H]: the step's tokens as one row
        for i, layer in enumerate(self.model.layers):
            if c.layer_types[i] == "kda":
                mixer = layer.self_attn.rz_forward
            else:
                mixer = lambda x, layer=layer: self._mla(layer, x)  # noqa: E731
            h = R.decoder_layer_apply(c, _getter(layer), i, h, mixer)
        return R.final_hidden(c, _getter(self), h)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens.weight if self.c.tie_word_embeddings else self.lm_head.weight
        logits = kernels.lm_head_logits(hidden_states, head, out_dtype=torch.float32)
        scale = self.logits_processor.scale
        if scale != 1.0:
            logits = logits * scale
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            if name.startswith("language_model."):
                name = name[len("language_model."):]
            p = params.get(name)
            if p is None:  # MTP layers, a tied lm_head, anything this model does not use
                continue
            if tuple(w.shape) != tuple(p.shape) and w.numel() == p.numel():
                w = w.reshape(p.shape)  # A_log [1, 1, H, 1] / conv [P, W]: the same values
            loader = getattr(p, "weight_loader", default_weight_loader)
            loader(p, w)
            loaded.add(name)
        return loaded
