"""The GPU fast path's packed weights (vllm_bridge.aligned._model): HF-named parameters are views
into packed tensors, loading writes through them, and a parameter whose storage a loader replaced is
copied back and re-pointed (the layout is device independent: checked here on CPU)."""

import types

import torch
from torch import nn

from vllm_bridge.aligned import _model as M


def _fake_model():
    torch.manual_seed(0)
    layer = nn.Module()
    pack, leaves = M.packed_rows(torch.float32, 8, {"q_proj": 6, "k_proj": 2, "v_proj": 2})
    layer.self_attn = nn.Module()
    for n, leaf in leaves.items():
        setattr(layer.self_attn, n, leaf)
    layer.self_attn.rz_packs = {"qkv": (pack, ("q_proj", "k_proj", "v_proj"))}
    layer.mlp = nn.Module()
    layer.mlp.experts, layer.mlp.rz_stacks = M._packed_experts(torch.float32, 3, 8, 4)
    layer.mlp.shared_experts = M._packed_mlp(torch.float32, 8, 4)
    # one pipeline stage holding layer 0 (rz_start / rz_end: the stage's layers, RZAlignedForCausalLM)
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[layer]), rz_start=0, rz_end=1)
    model._stage_layers = types.MethodType(M.RZAlignedForCausalLM._stage_layers, model)
    return model, layer


def test_parameters_are_views_and_loading_fills_the_packs():
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    model, layer = _fake_model()
    a, ex, se = layer.self_attn, layer.mlp.experts, layer.mlp.shared_experts
    q, k, v = torch.randn(6, 8), torch.randn(2, 8), torch.randn(2, 8)
    for leaf, w in ((a.q_proj, q), (a.k_proj, k), (a.v_proj, v)):
        default_weight_loader(leaf.weight, w)
    assert torch.equal(a.rz_packs["qkv"][0], torch.cat([q, k, v]))
    g = [torch.randn(4, 8) for _ in range(3)]
    for e in range(3):
        default_weight_loader(ex[e].gate_proj.weight, g[e])
    assert torch.equal(layer.mlp.rz_stacks["gate_proj"], torch.stack(g))
    gu = torch.randn(8, 8)
    default_weight_loader(se.gate_proj.weight, gu[:4])
    default_weight_loader(se.up_proj.weight, gu[4:])
    assert torch.equal(se.rz_packs["gate_up"][0], gu)
    # named_parameters (what a weight sync reads back) sees the HF names, no pack
    names = {n for n, _ in layer.named_parameters()}
    assert "self_attn.q_proj.weight" in names and "mlp.experts.2.down_proj.weight" in names
    assert not any("rz_" in n for n in names)


def test_pack_check_repoints_replaced_storage():
    model, layer = _fake_model()
    a, ex = layer.self_attn, layer.mlp.experts
    new_k = torch.randn(2, 8)
    a.k_proj.weight.data = new_k.clone()  # a loader that re-allocated the parameter
    new_d = torch.randn(8, 4)
    ex[1].down_proj.weight.data = new_d.clone()
    pack, stacks = a.rz_packs["qkv"][0], layer.mlp.rz_stacks
    assert a.k_proj.weight.data_ptr() != pack[6:8].data_ptr()
    with torch.no_grad():
        M.RZAlignedForCausalLM._rz_pack_check(model)
    assert a.k_proj.weight.data_ptr() == pack[6:8].data_ptr() and torch.equal(pack[6:8], new_k)
    assert ex[1].down_proj.weight.data_ptr() == stacks["down_proj"][1].data_ptr()
    assert torch.equal(stacks["down_proj"][1], new_d)
    # already aliasing: nothing moves
    ptrs = [p.data_ptr() for p in layer.parameters()]
    with torch.no_grad():
        M.RZAlignedForCausalLM._rz_pack_check(model)
    assert ptrs == [p.data_ptr() for p in layer.parameters()]
