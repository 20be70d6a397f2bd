"""Kimi Delta Attention reference numerics (kernels/models/kda.py).

Bitwise claims (torch.equal): chunked prefill == token-by-token recurrence for any chunk size,
outputs and fp32 final state; prefill + decode carrying the (conv, recurrent) state == one prefill;
a sequence alone == the same sequence inside a batch. Closeness claims: the layer against
transformers' ``KimiLinearDeltaAttention`` (its pure-torch fallbacks on CPU: ``F.conv1d``, the
WY-form ``chunk_kimi_delta_attention`` without a cache, ``recurrent_kimi_delta_attention`` for
cached decode) and against our own float64 evaluation.
"""

from __future__ import annotations

import pytest
import torch

from kernels.models import kda

HIDDEN, HEADS, HEAD_DIM, KERNEL = 32, 2, 16, 4
P = HEADS * HEAD_DIM


def _cfg(**over):
    base = dict(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, conv_kernel=KERNEL, rms_norm_eps=1e-5)
    base.update(over)
    return kda.KDAConfig(**base)


def _weights(seed=0, dtype=torch.float32, full_rank_gate=False, split_conv=False):
    """Random weights with transformers' kimi_linear names (A_log / dt_bias drawn like its init)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.3):
        return (torch.randn(*shape, generator=gen) * s).to(dtype)

    w = {
        "q_proj.weight": r(P, HIDDEN), "k_proj.weight": r(P, HIDDEN), "v_proj.weight": r(P, HIDDEN),
        "forget_gate.f_a_proj.weight": r(HEAD_DIM, HIDDEN), "forget_gate.f_b_proj.weight": r(P, HEAD_DIM),
        "forget_gate.dt_bias": r(P, s=1.0),
        "forget_gate.A_log": torch.empty(1, 1, HEADS, 1).uniform_(1.0, 16.0, generator=gen).log().to(dtype),
        "b_proj.weight": r(HEADS, HIDDEN),
        "o_norm.weight": (1.0 + r(HEAD_DIM, s=0.1).float()).to(dtype),
        "o_proj.weight": r(HIDDEN, P),
    }
    conv = r(3 * P, 1, KERNEL, s=0.5)
    if split_conv:
        for i, n in enumerate("qkv"):
            w[f"{n}_conv1d.weight"] = conv[i * P:(i + 1) * P].clone()
    else:
        w["conv1d.weight"] = conv
    if full_rank_gate:
        w["g_proj.weight"] = r(P, HIDDEN)
    else:
        w["g_a_proj.weight"] = r(HEAD_DIM, HIDDEN)
        w["g_b_proj.weight"] = r(P, HEAD_DIM)
    return w


def _qkvgb(B, T, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(B, T, HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(B, T, HEADS, HEAD_DIM, generator=gen)
    g = -torch.rand(B, T, HEADS, HEAD_DIM, generator=gen) * 0.7
    beta = torch.rand(B, T, HEADS, generator=gen)
    return q, k, v, g, beta


# ------------------------------------------------------------------ (a) chunked == recurrent, bitwise


@pytest.mark.parametrize("T", [37, 16, 5])
def test_chunked_equals_recurrent_bitwise(T):
    q, k, v, g, beta = _qkvgb(2, T)
    S0 = torch.randn(2, HEADS, HEAD_DIM, HEAD_DIM, generator=torch.Generator().manual_seed(7)) * 0.1
    for init in (None, S0):
        o_ref, s_ref = kda.kda_recurrent(q, k, v, g, beta, init)
        for cs in (1, 3, 16, T, T + 5):
            o, s = kda.kda_chunked(q, k, v, g, beta, init, chunk_size=cs)
            assert torch.equal(o, o_ref), (T, cs)
            assert torch.equal(s, s_ref), (T, cs)
            assert s.dtype == torch.float32


@pytest.mark.parametrize("full_rank_gate,lower_bound", [(False, None), (True, -5.0)])
def test_layer_chunked_equals_recurrent_bitwise(full_rank_gate, lower_bound):
    cfg = _cfg(gate_lower_bound=lower_bound)
    w = _weights(full_rank_gate=full_rank_gate)
    x = torch.randn(2, 29, HIDDEN, generator=torch.Generator().manual_seed(3))
    out_ref, st_ref = kda.kda_layer_forward(x, w, cfg)
    for cs in (1, 3, 16, 29):
        out, st = kda.kda_layer_forward(x, w, cfg, chunk_size=cs)
        assert torch.equal(out, out_ref), cs
        assert torch.equal(st["recurrent"], st_ref["recurrent"]) and torch.equal(st["conv"], st_ref["conv"])


# ------------------------------------------------------- (b) prefill + decode == one prefill, bitwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_equals_full_prefill_bitwise(dtype):
    cfg = _cfg()
    w = _weights(dtype=dtype)
    T = 23
    x = torch.randn(1, T, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    full, st_full = kda.kda_layer_forward(x, w, cfg, chunk_size=16)
    assert full.dtype == dtype and st_full["recurrent"].dtype == torch.float32 and st_full["conv"].dtype == dtype
    # prompt of 11 in one prefill, then one token at a time
    out, st = kda.kda_layer_forward(x[:, :11], w, cfg, chunk_size=16)
    pieces = [out]
    for t in range(11, T):
        o, st = kda.kda_layer_forward(x[:, t:t + 1], w, cfg, st)
        pieces.append(o)
    assert torch.equal(torch.cat(pieces, 1), full)
    assert torch.equal(st["recurrent"], st_full["recurrent"]) and torch.equal(st["conv"], st_full["conv"])
    # scheduler-style chunked prefill with pieces shorter than the conv window (1, 2 tokens)
    pieces, st = [], None
    for s, e in ((0, 1), (1, 3), (3, 10), (10, 12), (12, T)):
        o, st = kda.kda_layer_forward(x[:, s:e], w, cfg, st, chunk_size=4)
        pieces.append(o)
    assert torch.equal(torch.cat(pieces, 1), full)
    assert torch.equal(st["recurrent"], st_full["recurrent"]) and torch.equal(st["conv"], st_full["conv"])
    # an explicit zero state == no state
    o0, _ = kda.kda_layer_forward(x, w, cfg, kda.empty_state(cfg, 1, dtype), chunk_size=16)
    assert torch.equal(o0, full)


# ------------------------------------------------------------------------ (c) batch invariance, bitwise


def test_batch_invariance_bitwise():
    cfg = _cfg(gate_lower_bound=-5.0)
    w = _weights(seed=5, full_rank_gate=True)
    gen = torch.Generator().manual_seed(6)
    T = 19
    xs = torch.randn(5, T, HIDDEN, generator=gen)
    alone, st_alone = kda.kda_layer_forward(xs[2:3], w, cfg)
    for rows in ([0, 1, 2], [2, 4], [3, 2, 0, 1, 4]):
        out, st = kda.kda_layer_forward(xs[rows], w, cfg, chunk_size=7)
        i = rows.index(2)
        assert torch.equal(out[i:i + 1], alone), rows
        assert torch.equal(st["recurrent"][i:i + 1], st_alone["recurrent"])
        assert torch.equal(st["conv"][i:i + 1], st_alone["conv"])
    # decode: the row's next token alone vs in a batch whose other rows carry other histories
    nxt = torch.randn(5, 1, HIDDEN, generator=gen)
    _, st_b = kda.kda_layer_forward(xs, w, cfg)
    o_alone, _ = kda.kda_layer_forward(nxt[2:3], w, cfg, st_alone)
    o_b, _ = kda.kda_layer_forward(nxt, w, cfg, st_b)
    assert torch.equal(o_b[2:3], o_alone)


def test_checkpoint_name_variants_bitwise():
    """vLLM's Kimi checkpoint names (q/k/v_conv1d, gates without forget_gate.) give the same bits."""
    cfg = _cfg()
    w = _weights(seed=8)
    w_split = _weights(seed=8, split_conv=True)
    for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
        w_split[n] = w_split.pop("forget_gate." + n)
    w_split["A_log"] = w_split["A_log"].reshape(HEADS)
    x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(9))
    a, sa = kda.kda_layer_forward(x, w, cfg)
    b, sb = kda.kda_layer_forward(x, w_split.__getitem__, cfg)  # a getter works too
    assert torch.equal(a, b) and torch.equal(sa["recurrent"], sb["recurrent"])


def test_kda_config_from_checkpoint_dict():
    c = kda.kda_config({"hidden_size": 64, "rms_norm_eps": 1e-6, "linear_attn_config": {
        "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "use_full_rank_gate": True}})
    assert (c.num_heads, c.head_dim, c.conv_kernel, c.gate_lower_bound, c.rms_norm_eps) == (4, 16, 4, -5.0, 1e-6)


# ------------------------------------------------------------ (d) against transformers and float64


def _hf_module():
    from transformers.models.kimi_linear import modeling_kimi_linear as mk
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    hf_cfg = KimiLinearConfig(
        hidden_size=HIDDEN, linear_num_heads=HEADS, linear_head_dim=HEAD_DIM, linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"], rms_norm_eps=1e-5,
        vocab_size=64, num_attention_heads=2, num_key_value_heads=2,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    m = mk.KimiLinearDeltaAttention(hf_cfg, 0).eval()
    w = _weights(seed=11)
    missing, unexpected = m.load_state_dict(w, strict=True)
    return mk, hf_cfg, m, w


def test_recurrence_matches_transformers():
    """Our recurrence vs transformers' pure-torch ``recurrent_kimi_delta_attention`` and WY-form
    ``chunk_kimi_delta_attention`` (chunk 64), T=37, B=2, fp32. Measured max |diff|: outputs 3.7e-8
    (recurrent) / 1.0e-7 (chunk) at max |o| 0.33; final state 8.9e-8 / 4.2e-7 at max |S| 1.06.
    Asserted: 1e-6 (outputs) / 2e-6 (state) relative to the max."""
    mk, _, _, _ = _hf_module()
    q, k, v, g, beta = _qkvgb(2, 37)
    o, s = kda.kda_recurrent(q, k, v, g, beta)
    o1, s1 = mk.recurrent_kimi_delta_attention(q, k, v, g, beta, None, True, use_qk_l2norm_in_kernel=True)
    o2, s2 = mk.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=None, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
    for oo, ss in ((o1, s1), (o2, s2)):
        assert (oo - o).abs().max() <= 1e-6 * o.abs().max()
        assert (ss - s).abs().max() <= 2e-6 * s.abs().max()


def test_layer_matches_transformers_and_float64():
    """Layer vs transformers' ``KimiLinearDeltaAttention`` (CPU fallbacks), fp32, B=2.

    Measured max |diff| (this box, fixed seeds), max |out| = 4.16:
      * no-cache forward over 37 tokens (transformers' WY chunk form): 2.0e-5 (4.8e-6 relative);
      * cached prefill 20 + decode 5 (transformers' recurrent form + conv update): 1.2e-5;
      * final recurrent state vs transformers' cache: 2.4e-7 at max |S| 1.2;
      * our fp32 vs our float64 evaluation: 1.7e-6 (4.1e-7 relative); transformers' fp32 vs our
        float64: 2.0e-5 -- the difference to transformers is its own fp32 rounding (F.conv1d, BLAS
        sums, the WY re-association), amplified by the per-head output RMSNorm where a head's
        output is small.
    Asserted: 1e-5 relative to max |out| against transformers, 2e-6 relative against float64.
    """
    from transformers.cache_utils import DynamicCache

    _, hf_cfg, m, w = _hf_module()
    cfg = kda.kda_config(hf_cfg)
    assert (cfg.num_heads, cfg.head_dim, cfg.conv_kernel, cfg.gate_lower_bound) == (HEADS, HEAD_DIM, KERNEL, None)
    x = torch.randn(2, 37, HIDDEN, generator=torch.Generator().manual_seed(12))
    w64 = {n: t.double() for n, t in w.items()}
    with torch.no_grad():
        hf = m(x)
        cache = DynamicCache(config=hf_cfg)
        pieces = [m(x[:, :20], cache_params=cache)] + [m(x[:, t:t + 1], cache_params=cache) for t in range(20, 25)]
        hf_dec = torch.cat(pieces, 1)
        S_hf = cache.layers[0].recurrent_states[0]
    ours, st = kda.kda_layer_forward(x, w, cfg, chunk_size=16)
    ours64, st64 = kda.kda_layer_forward(x.double(), w64, cfg)
    ours_dec, st_dec = kda.kda_layer_forward(x[:, :25], w, cfg)
    scale = ours64.abs().max().item()
    d_hf = (hf - ours).abs().max().item()
    d_dec = (hf_dec - ours_dec).abs().max().item()
    d_64 = (ours.double() - ours64).abs().max().item()
    assert d_hf <= 1e-5 * scale, (d_hf, scale)
    assert d_dec <= 1e-5 * scale, (d_dec, scale)
    assert d_64 <= 2e-6 * scale, (d_64, scale)
    assert (S_hf - st_dec["recurrent"]).abs().max() <= 2e-6 * st_dec["recurrent"].abs().max()
    assert (st["recurrent"].double() - st64["recurrent"]).abs().max() <= 2e-6 * st64["recurrent"].abs().max()


def test_update_order_is_pinned():
    """The state update / readout reduce over the key dim with ``kernels.tree_sum`` (pinned here:
    the engine class and the learner must reproduce exactly this order; a torch matmul / einsum
    readout is not guaranteed to, and at these shapes it already differs in the last bits)."""
    from kernels import tree_sum

    q, k, v, g, beta = _qkvgb(3, 4, seed=13)
    o, s = kda.kda_recurrent(q, k, v, g, beta)
    qn = q / torch.sqrt(tree_sum(q * q, dim=-1, keepdim=True) + 1e-6) * (1.0 / HEAD_DIM ** 0.5)
    kn = k / torch.sqrt(tree_sum(k * k, dim=-1, keepdim=True) + 1e-6)
    S = torch.zeros(3, HEADS, HEAD_DIM, HEAD_DIM)
    outs = []
    for t in range(4):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        mem = tree_sum(S * kn[:, t].unsqueeze(-1), dim=-2)
        S = S + kn[:, t].unsqueeze(-1) * ((v[:, t] - mem) * beta[:, t].unsqueeze(-1)).unsqueeze(-2)
        outs.append(tree_sum(S * qn[:, t].unsqueeze(-1), dim=-2))
    assert torch.equal(o, torch.stack(outs, 1)) and torch.equal(s, S)
