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


def _qwen2_attention(H=32, Hq=4, Hkv=2, D=8):
    """A Qwen2 attention block as the fast path builds it (q/k/v weights and biases packed)."""
    attn = nn.Module()
    rows = {"q_proj": Hq * D, "k_proj": Hkv * D, "v_proj": Hkv * D}
    pack, leaves, bpack = M.packed_rows(torch.float32, H, rows, bias=True)
    for n, leaf in leaves.items():
        setattr(attn, n, leaf)
    attn.rz_packs = {"qkv": (pack, tuple(rows)), "qkv_bias": (bpack, tuple(rows), "bias")}
    return attn, rows


def test_qwen2_biases_are_views_of_one_packed_vector_and_are_repointed():
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    torch.manual_seed(1)
    attn, rows = _qwen2_attention()
    ws = {n: torch.randn(r, 32) for n, r in rows.items()}
    bs = {n: torch.randn(r) for n, r in rows.items()}
    for n in rows:
        default_weight_loader(getattr(attn, n).weight, ws[n])
        default_weight_loader(getattr(attn, n).bias, bs[n])
    assert torch.equal(attn.rz_packs["qkv"][0], torch.cat(list(ws.values())))
    assert torch.equal(attn.rz_packs["qkv_bias"][0], torch.cat(list(bs.values())))
    assert {n for n, _ in attn.named_parameters()} == {f"{n}.{a}" for n in rows for a in ("weight", "bias")}
    # a loader that re-allocated the k bias: copied back into the packed vector and re-pointed
    layer = nn.Module()
    layer.self_attn, layer.mlp = attn, nn.Module()
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[layer]), rz_start=0, rz_end=1)
    model._stage_layers = types.MethodType(M.RZAlignedForCausalLM._stage_layers, model)
    new_b = torch.randn(rows["k_proj"])
    attn.k_proj.bias.data = new_b.clone()
    with torch.no_grad():
        M.RZAlignedForCausalLM._rz_pack_check(model)
    bpack = attn.rz_packs["qkv_bias"][0]
    lo = rows["q_proj"]
    assert attn.k_proj.bias.data_ptr() == bpack[lo:lo + rows["k_proj"]].data_ptr()
    assert torch.equal(bpack[lo:lo + rows["k_proj"]], new_b)


def test_qwen2_packed_qkv_is_bitwise_the_three_biased_projections():
    """The fast path's one GEMM over the packed q/k/v weight and bias == the learner's three biased
    projections (kernels.models.qwen3_dsv3.qwen2_qkv), q / k after RoPE and v, with torch.equal."""
    from kernels.models import qwen3_dsv3 as ref

    torch.manual_seed(2)
    H, Hq, Hkv, D = 32, 4, 2, 8
    c = ref.arch_config({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": H,
                         "num_hidden_layers": 1, "num_attention_heads": Hq, "num_key_value_heads": Hkv,
                         "vocab_size": 64, "intermediate_size": 48})
    assert c.family.qkv_bias and c.head_dim == D
    attn, rows = _qwen2_attention(H, Hq, Hkv, D)
    with torch.no_grad():
        for n, r in rows.items():
            getattr(attn, n).weight.copy_(torch.randn(r, H) * H ** -0.5)
            getattr(attn, n).bias.copy_(torch.randn(r))
    x = torch.randn(5, H)
    cos, sin = ref.rope_tables(c, torch.arange(5))
    params = dict(attn.named_parameters())
    want = ref.qwen2_qkv(c, lambda name: params[name.removeprefix("self_attn.")], x, cos, sin)
    layer = types.SimpleNamespace(self_attn=attn)
    got = M.RZAlignedForCausalLM._fast_qkv(types.SimpleNamespace(c=c), layer, x, cos, sin)
    for g, w_ in zip(got, want):
        assert torch.equal(g, w_)
