"""The GPU engine's fast layer loop (``kernels.models.qwen3_dsv3.layer_forward_fast``): each layer's
last residual add carried into the next layer's input norm, row-parallel deltas handed on unreduced
(``kernels.Unreduced``), the last pending add finished by the final norm or before a pipeline stage
sends the residual. Checked on the CPU reference ops against a chain of ``layer_forward`` calls
(the learner's), bitwise, with the activation taps: Qwen2, Qwen3-MoE and DeepSeek-V3 (a dense and a
MoE layer). On CUDA the unreduced deltas are a split GEMM's partials (tests/gpu/test_triton_kernels.py);
here a stand-in ``linear_unreduced`` returns the reference's own segment partials, which the
dispatch sums as the reference linear does, so the plumbing is what is tested."""

from __future__ import annotations

import types

import pytest
import torch

import kernels
from kernels.models import qwen3_dsv3 as ref
from kernels.models import trace

QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "intermediate_size": 96}
QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 50, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "norm_topk_prob": True}
DSV3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 50,
        "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "n_shared_experts": 1, "kv_lora_rank": 32, "q_lora_rank": None,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True}


def _mlp_shapes(prefix: str, H: int, inter: int) -> dict:
    return {prefix + "gate_proj.weight": (inter, H), prefix + "up_proj.weight": (inter, H),
            prefix + "down_proj.weight": (H, inter)}


def _layer_shapes(c: ref.ArchConfig, i: int) -> dict:
    H = c.hidden_size
    s = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    if c.mla:
        s.update({"self_attn.q_proj.weight": (c.num_heads * c.qk_head_dim, H),
                  "self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, H),
                  "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
                  "self_attn.kv_b_proj.weight": (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                  "self_attn.o_proj.weight": (H, c.num_heads * c.v_head_dim)})
    else:
        D = c.head_dim
        for n, rows in (("q", c.num_heads * D), ("k", c.num_kv_heads * D), ("v", c.num_kv_heads * D)):
            s[f"self_attn.{n}_proj.weight"] = (rows, H)
            if c.family.qkv_bias:
                s[f"self_attn.{n}_proj.bias"] = (rows,)
        if c.family.qk_norm:
            s["self_attn.q_norm.weight"] = s["self_attn.k_norm.weight"] = (D,)
        s["self_attn.o_proj.weight"] = (H, c.num_heads * D)
    if not c.moe_layers[i]:
        s.update(_mlp_shapes("mlp.", H, c.intermediate_size))
        return s
    s["mlp.gate.weight"] = (c.num_experts, H)
    if c.has_expert_bias:
        s["mlp.gate.e_score_correction_bias"] = (c.num_experts,)
    for e in range(c.num_experts):
        s.update(_mlp_shapes(f"mlp.experts.{e}.", H, c.moe_intermediate_size))
    if c.n_shared_experts:
        s.update(_mlp_shapes("mlp.shared_experts.", H, c.moe_intermediate_size * c.n_shared_experts))
    return s


def _weights(c: ref.ArchConfig, dtype, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(c.num_layers):
        d = {}
        for name, shape in _layer_shapes(c, i).items():
            if name.endswith("norm.weight"):
                t = torch.rand(shape, generator=g) + 0.5
            elif len(shape) == 1:
                t = torch.randn(shape, generator=g) * 0.5
            else:
                t = torch.randn(shape, generator=g) * shape[1] ** -0.5
            d[name] = t.to(dtype)
        layers.append(d)
    return layers


def _unreduced_stand_in(calls: list):
    """``kernels.linear_unreduced`` as on CUDA at a split-mode M, with the reference's partials."""

    def linear_unreduced(x, weight, bias=None, *, k_segments=1):
        if k_segments == 1:
            return kernels.linear(x, weight, bias)
        calls.append(tuple(weight.shape))
        return kernels.Unreduced(kernels.row_partials(x, weight, k_segments), bias, x.dtype)

    return linear_unreduced


def _chains(c, layers, h0, positions, fast_mlp=None):
    cos, sin = ref.rope_tables(c, positions)

    def attend(q, k, v):
        return kernels.attention(q, k, v, positions, c.attn_scale)

    trace.start_trace()
    h = h0
    for i, d in enumerate(layers):
        h = ref.layer_forward(c, d.__getitem__, i, h, cos, sin, attend)
    taps_ref = trace.stop_trace()
    trace.start_trace()
    hf, y = h0, None
    for i, d in enumerate(layers):
        mlp = None if fast_mlp is None else (lambda x, i=i: fast_mlp(i, x))
        hf, y = ref.layer_forward_fast(c, d.__getitem__, i, hf, y, cos, sin, attend, mlp=mlp)
    taps_fast = trace.stop_trace()
    return h, (hf, y), taps_ref, taps_fast


@pytest.mark.parametrize("config,dtype", [(QWEN2, torch.bfloat16), (QWEN2, torch.float32),
                                          (QWEN3_MOE, torch.bfloat16), (DSV3, torch.bfloat16)])
def test_fast_layer_loop_is_bitwise_the_layer_chain(config, dtype, monkeypatch):
    c = ref.arch_config(config)
    layers = _weights(c, dtype, seed=1)
    T = 7
    positions = torch.arange(T)
    h0 = (torch.randn(T, c.hidden_size, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    norm_w = (torch.rand(c.hidden_size, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    calls: list = []
    monkeypatch.setattr(kernels, "linear_unreduced", _unreduced_stand_in(calls))
    h, (hf, y), taps_ref, taps_fast = _chains(c, layers, h0, positions)
    # the stand-in was used for every o_proj (the MLPs here are the reference's, finished tensors)
    assert len(calls) == c.num_layers and isinstance(y, torch.Tensor)
    # the pending add matters (so finishing it is tested): y is not zero
    assert not torch.equal(ref.carried_residual(hf, y), hf)
    assert torch.equal(ref.carried_residual(hf, y), h)
    assert torch.equal(ref.final_norm_carried(c, norm_w, hf, y), ref.final_norm(c, norm_w, h))
    assert [n for n, _ in taps_fast] == [n for n, _ in taps_ref]
    for (n, a), (_, b) in zip(taps_ref, taps_fast):
        assert torch.equal(a, b), n


def test_fast_dense_mlp_and_forward_wiring(monkeypatch):
    """The model class's pieces: the packed dense MLP with its down_proj unreduced
    (``_fast_dense_unreduced``) in the fast loop, and ``forward``'s finishing of the carried add:
    the final norm on the last stage, the whole residual ``h`` sent from any other."""
    M = pytest.importorskip("vllm_bridge.aligned._model")
    c = ref.arch_config(QWEN2)
    dtype = torch.bfloat16
    layers = _weights(c, dtype, seed=4)
    packed = []
    for d in layers:
        m = M._packed_mlp(dtype, c.hidden_size, c.intermediate_size)
        with torch.no_grad():
            m.gate_proj.weight.copy_(d["mlp.gate_proj.weight"])
            m.up_proj.weight.copy_(d["mlp.up_proj.weight"])
            m.down_proj.weight.copy_(d["mlp.down_proj.weight"])
        packed.append(m)
    calls: list = []
    monkeypatch.setattr(kernels, "linear_unreduced", _unreduced_stand_in(calls))
    T = 5
    positions = torch.arange(T)
    h0 = torch.randn(T, c.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    h, (hf, y), taps_ref, taps_fast = _chains(
        c, layers, h0, positions, fast_mlp=lambda i, x: M.RZAlignedForCausalLM._fast_dense_unreduced(packed[i], x))
    assert isinstance(y, kernels.Unreduced) and len(calls) == 2 * c.num_layers
    assert torch.equal(ref.carried_residual(hf, y), h)
    for (n, a), (_, b) in zip(taps_ref, taps_fast):
        assert torch.equal(a, b), n
    # forward(): a stand-in fast loop returning (hf, y); the embedding is the identity on h0's rows
    norm_w = (torch.rand(c.hidden_size, generator=torch.Generator().manual_seed(6)) + 0.5).to(dtype)
    for last in (True, False):
        model = types.SimpleNamespace(
            c=c, rz_first=True, rz_last=last, rz_fast=True, embed_input_ids=lambda ids: h0[ids],
            _fast_forward=lambda h_, pos: (hf, y), model=types.SimpleNamespace(norm=types.SimpleNamespace(weight=norm_w)))
        out = M.RZAlignedForCausalLM.forward(model, torch.arange(T), positions)
        if last:
            assert torch.equal(out, ref.final_norm(c, norm_w, h))
        else:
            assert torch.equal(out["hidden_states"], h)
