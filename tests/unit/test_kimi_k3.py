"""Kimi-Linear / Kimi-K3 class reference numerics (kernels/models/kimi_k3.py).

Bitwise claims (torch.equal, fp32): prefill chunked at odd boundaries + token-by-token decode ==
one full prefill (logits, logprobs, the final KDA conv / recurrent states and the MLA compressed
KV); the KDA chunk size changes no bit; a sequence alone == the same sequence inside a batch.
Each for a Kimi-Linear model (transformers' names and init) and a K3-class model (Kimi checkpoint
names, q-LoRA MLA with the sigmoid output gate, latent MoE with its RMSNorm, SiTU activation,
block attention residuals, KDA with the full-rank gate and gate_lower_bound).

Closeness claims: the whole Kimi-Linear model against transformers' ``KimiLinearForCausalLM``
(its CPU fallbacks; eager attention / experts), prefill and cached decode; the NoPE MLA against
an independent float64 evaluation (plain torch) for both the Kimi-Linear and the gated K3 form.
K3-only parts have no transformers counterpart: the latent MoE, the SiTU activation and the
AttnRes mix are checked against float64 evaluations (our code in float64, or plain torch) and for
bitwise consistency with the shared kernels ops where they coincide.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kernels
from kernels.models import kimi_k3 as kk

H, V, L = 64, 128, 4

K3_DICT = {
    "hidden_size": H, "num_hidden_layers": L, "vocab_size": V, "rms_norm_eps": 1e-5,
    "num_attention_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True, "mla_use_output_gate": True,
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 8.0,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2,
    "num_shared_experts": 1, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
    "num_expert_group": 2, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_expert_hidden_size": 24,
    "latent_moe_use_norm": True, "attn_res_block_size": 2, "tie_word_embeddings": False,
    "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 2, "head_dim": 16,
                           "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
}


def k3_weights(c: kk.KimiConfig, seed: int = 0, dtype=torch.float32) -> dict:
    """Random K3-class weights with the Kimi checkpoint names vLLM loads."""
    gen = torch.Generator().manual_seed(seed)

    def lin(n, k, gain=1.0):
        return (torch.randn(n, k, generator=gen) * (gain / math.sqrt(k))).to(dtype)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    w = {"model.embed_tokens.weight": torch.randn(V, H, generator=gen).to(dtype),
         "model.norm.weight": norm(H), "lm_head.weight": lin(V, H, 2.0),
         "model.output_attn_res_norm.weight": norm(H), "model.output_attn_res_proj.weight": lin(1, H, 2.0)}
    kc = c.kda
    P, D = kc.proj_dim, kc.head_dim
    nh = c.num_heads
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        for kind in ("self_attention", "mlp"):
            w[p + f"{kind}_res_norm.weight"] = norm(H)
            w[p + f"{kind}_res_proj.weight"] = lin(1, H, 2.0)
        a = p + "self_attn."
        if c.layer_types[i] == "kda":
            for n in "qkv":
                w[a + f"{n}_proj.weight"] = lin(P, H)
                w[a + f"{n}_conv1d.weight"] = (torch.randn(P, 1, kc.conv_kernel, generator=gen) * 0.5).to(dtype)
            w[a + "f_a_proj.weight"] = lin(D, H)
            w[a + "f_b_proj.weight"] = lin(P, D)
            w[a + "dt_bias"] = torch.randn(P, generator=gen).to(dtype)
            w[a + "A_log"] = torch.empty(kc.num_heads).uniform_(1.0, 16.0, generator=gen).log().to(dtype)
            w[a + "b_proj.weight"] = lin(kc.num_heads, H)
            w[a + "g_proj.weight"] = lin(P, H)
            w[a + "o_norm.weight"] = norm(D)
            w[a + "o_proj.weight"] = lin(H, P)
        else:
            w[a + "q_a_proj.weight"] = lin(c.q_lora_rank, H)
            w[a + "q_a_layernorm.weight"] = norm(c.q_lora_rank)
            w[a + "q_b_proj.weight"] = lin(nh * c.qk_head_dim, c.q_lora_rank, 3.0)
            w[a + "kv_a_proj_with_mqa.weight"] = lin(c.kv_lora_rank + c.qk_rope_head_dim, H, 3.0)
            w[a + "kv_a_layernorm.weight"] = norm(c.kv_lora_rank)
            w[a + "kv_b_proj.weight"] = lin(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, 3.0)
            w[a + "g_proj.weight"] = lin(nh * c.v_head_dim, H)
            w[a + "o_proj.weight"] = lin(H, nh * c.v_head_dim)
        if c.mlp_types[i] == "dense":
            m = p + "mlp."
            w[m + "gate_proj.weight"] = lin(c.intermediate_size, H)
            w[m + "up_proj.weight"] = lin(c.intermediate_size, H)
            w[m + "down_proj.weight"] = lin(H, c.intermediate_size)
        else:
            m = p + "block_sparse_moe."
            Lt, I = c.latent_size, c.moe_intermediate_size
            w[m + "gate.weight"] = lin(c.num_experts, H, 2.0)
            w[m + "gate.e_score_correction_bias"] = (0.05 * torch.randn(c.num_experts, generator=gen)).float()
            for e in range(c.num_experts):
                w[m + f"experts.{e}.w1.weight"] = lin(I, Lt, 2.0)
                w[m + f"experts.{e}.w3.weight"] = lin(I, Lt, 2.0)
                w[m + f"experts.{e}.w2.weight"] = lin(Lt, I)
            Is = I * c.num_shared_experts
            w[m + "shared_experts.gate_proj.weight"] = lin(Is, H, 2.0)
            w[m + "shared_experts.up_proj.weight"] = lin(Is, H, 2.0)
            w[m + "shared_experts.down_proj.weight"] = lin(H, Is)
            w[m + "routed_expert_down_proj.weight"] = lin(Lt, H)
            w[m + "routed_expert_norm.weight"] = norm(Lt)
            w[m + "routed_expert_up_proj.weight"] = lin(H, Lt)
    return w


def _hf_config():
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    return KimiLinearConfig(
        hidden_size=H, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=L,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, q_lora_rank=None, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        vocab_size=V, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_local_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        attn_implementation="eager", experts_implementation="eager")


@pytest.fixture(scope="module")
def hf_model():
    """A tiny KimiLinearForCausalLM (KDA, MLA, KDA, MLA; dense + 3 MoE layers, 8 experts in 2 groups),
    transformers' init with the linears scaled x4, random norm weights and score-correction bias."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

    cfg = _hf_config()
    torch.manual_seed(0)
    m = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2 and "embed" not in n:
                p.mul_(4.0)
        for n, b in m.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return m, cfg, sd


@pytest.fixture(scope="module")
def k3():
    c = kk.kimi_config(K3_DICT)
    return c, k3_weights(c)


def _hf_kimi(cfg) -> kk.KimiConfig:
    """Our config for transformers' model: its MLA latent norms use eps 1e-6 (RMSNorm default),
    not rms_norm_eps as vLLM's do."""
    return dataclasses.replace(kk.kimi_config(cfg.to_dict()), mla_norm_eps=1e-6)


def _ids(B, T, seed):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------- config


def test_config_schedules():
    c = kk.kimi_config(K3_DICT)
    assert c.layer_types == ["kda", "mla", "kda", "mla"] and c.mlp_types == ["dense", "moe", "moe", "moe"]
    assert (c.latent_size, c.latent_norm, c.attn_res_block_size, c.hidden_act) == (24, True, 2, "situ")
    assert (c.num_groups, c.topk_group, c.top_k, c.num_shared_experts, c.mla_output_gate) == (2, 1, 2, 1, True)
    assert c.kda.gate_lower_bound == -5.0 and c.attn_scale == 24 ** -0.5
    nested = kk.kimi_config({"text_config": K3_DICT, "model_type": "kimi_k3"})
    assert nested.layer_types == c.layer_types
    d = dict(K3_DICT, first_k_dense_replace=0, moe_layer_freq=2, num_hidden_layers=6)
    d["linear_attn_config"] = dict(K3_DICT["linear_attn_config"], kda_layers=[1, 2, 3, 5, 6], full_attn_layers=[4])
    c6 = kk.kimi_config(d)
    assert c6.layer_types == ["kda", "kda", "kda", "mla", "kda", "kda"]
    assert c6.mlp_types == ["moe", "dense", "moe", "dense", "moe", "dense"]
    dflt = kk.kimi_config({k: v for k, v in K3_DICT.items() if k != "linear_attn_config"} | {"num_hidden_layers": 9,
                           "linear_attn_config": {"num_heads": 2, "head_dim": 16}})
    assert [i for i, t in enumerate(dflt.layer_types) if t == "mla"] == [4, 8]  # transformers' default


# --------------------------------------------------------------- (a) against transformers (Kimi-Linear)


def test_model_matches_transformers(hf_model):
    """Whole-model fp32 logits vs transformers' ``KimiLinearForCausalLM`` (B=2, T=37; KDA in its
    WY-chunk CPU fallback, eager MLA, eager experts), and cached decode (prefill 20 + 5 steps).

    Measured on this box (fixed seeds): max |logit| 2.71; max |diff| 1.16e-5 (prefill) and
    1.03e-5 (cached decode) = 4.3e-6 relative; logprobs 3.8e-6. That is fp32 rounding: our fp32
    vs our float64-weights evaluation differs by 9.0e-6, transformers' fp32 vs it by 1.1e-5 (the
    float64 run keeps our fp32 attention and routing). Needed for it: the MLA latent norms at eps
    1e-6 (:func:`_hf_kimi`); with vLLM's rms_norm_eps (1e-5) the difference is 4.5e-5.
    Asserted: 1e-5 relative to max |logit| (logits), 2e-5 absolute (logprobs).
    """
    from transformers.cache_utils import DynamicCache

    m, cfg, sd = hf_model
    c = _hf_kimi(cfg)
    assert c.layer_types == ["kda", "mla", "kda", "mla"] and c.mlp_types == ["dense", "moe", "moe", "moe"]
    assert (c.num_groups, c.topk_group, c.num_experts, c.top_k, c.norm_topk_prob) == (2, 1, 8, 2, True)
    ids = _ids(2, 37, 2)
    with torch.no_grad():
        hf = m(ids).logits
        cache = DynamicCache(config=cfg)
        pieces = [m(ids[:, :20], past_key_values=cache, use_cache=True).logits]
        for t in range(20, 25):
            pieces.append(m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        hf_dec = torch.cat(pieces, 1)
    ours = kk.reference_logits(sd, c, ids)
    scale = ours.abs().max().item()
    d_pre = (hf - ours).abs().max().item()
    d_dec = (hf_dec - ours[:, :25]).abs().max().item()
    assert d_pre <= 1e-5 * scale, (d_pre, scale)
    assert d_dec <= 1e-5 * scale, (d_dec, scale)
    lp = kk.reference_logprobs(sd, c, ids)
    lp_hf = torch.log_softmax(hf[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (lp[:, 1:] - lp_hf).abs().max() <= 2e-5
    assert torch.equal(lp[:, 0], torch.zeros(2))


def _mla64(c, get, x):
    """Independent float64 NoPE MLA (plain torch, full causal softmax), optional q-LoRA and gate."""
    x = x.double()
    g = lambda n: get(n).double()  # noqa: E731
    B, T, _ = x.shape
    nh, nope, rope, dv, r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank

    def rms(t, w):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + c.mla_eps) * w

    if c.q_lora_rank is None:
        q = x @ g("q_proj.weight").T
    else:
        q = rms(x @ g("q_a_proj.weight").T, g("q_a_layernorm.weight")) @ g("q_b_proj.weight").T
    q = q.view(B, T, nh, -1)
    ckv = x @ g("kv_a_proj_with_mqa.weight").T
    lat = rms(ckv[..., :r], g("kv_a_layernorm.weight"))
    kv = (lat @ g("kv_b_proj.weight").T).view(B, T, nh, -1)
    k = torch.cat([kv[..., :nope], ckv[..., r:, None].transpose(-1, -2).expand(B, T, nh, rope)], -1)
    v = kv[..., nope:]
    s = torch.einsum("bthd,bshd->bhts", q, k) * (nope + rope) ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, -1)
    if get("g_proj.weight") is not None:
        o = o * torch.sigmoid(x @ g("g_proj.weight").T)
    return o @ g("o_proj.weight").T


@pytest.mark.parametrize("which", ["kimi_linear", "k3"])
def test_mla_vs_float64_and_transformers(which, hf_model, k3):
    """NoPE MLA layer (fp32) vs an independent float64 evaluation; Kimi-Linear form also vs
    transformers' ``KimiLinearAttention`` (its latent-norm eps 1e-6). Measured: Kimi-Linear: ours
    6.6e-8, transformers 1.1e-7 (max |out| 0.55); K3 (q-LoRA + sigmoid output gate, sharper
    attention): ours 2.6e-6 (max |out| 5.96, 4.4e-7 relative). Asserted: 1e-6 relative
    (Kimi-Linear), 2e-6 relative (K3)."""
    if which == "kimi_linear":
        m, cfg, sd = hf_model
        c = _hf_kimi(cfg)
        mod = m.model.layers[1].self_attn
    else:
        c, sd = k3
        mod = None
    get = kk._sub(kk._model_getter(sd), "model.layers.1.self_attn.")
    x = torch.randn(2, 19, H, generator=torch.Generator().manual_seed(4))
    ours, cache = kk.mla_nope_forward(c, get, x)
    ref = _mla64(c, get, x)
    scale = ref.abs().max().item()
    tol = 1e-6 if which == "kimi_linear" else 2e-6
    assert (ours.double() - ref).abs().max().item() <= tol * scale
    assert cache["latent"].shape == (2, 19, c.kv_lora_rank) and cache["k_pe"].shape == (2, 19, c.qk_rope_head_dim)
    if mod is not None:
        mask = torch.full((19, 19), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            hf = mod(x, attention_mask=mask)[0]
        assert (hf.double() - ref).abs().max().item() <= tol * scale


# ---------------------------------------------------- (b) prefill + decode == full prefill, bitwise


def _model(which, hf_model, k3):
    if which == "kimi_linear":
        _, cfg, sd = hf_model
        return kk.kimi_config(cfg.to_dict()), sd
    return k3


def _assert_states_equal(a, b):
    assert a["pos"] == b["pos"]
    for sa, sb in zip(a["layers"], b["layers"]):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("which", ["kimi_linear", "k3"])
def test_prefill_chunks_then_decode_equal_full_prefill_bitwise(which, hf_model, k3):
    c, w = _model(which, hf_model, k3)
    ids = _ids(2, 23, 5)
    full, st_full = kk.forward(w, c, ids, chunk_size=64)
    lp_full = kk.logprobs_of(full, ids)
    assert torch.equal(lp_full, kk.reference_logprobs(w, c, ids))
    # KDA chunk size and the recurrence form change no bit
    for cs in (None, 5):
        alt, st_alt = kk.forward(w, c, ids, chunk_size=cs)
        assert torch.equal(alt, full), cs
        _assert_states_equal(st_alt, st_full)
    # prompt split at odd boundaries (7, 4, 1, 3), then one token at a time
    state = kk.empty_state(c, 2)
    pieces, t = [], 0
    for n in (7, 4, 1, 3):
        lg, state = kk.decode_step(w, c, ids[:, t:t + n], state, chunk_size=3)
        pieces.append(lg)
        t += n
    while t < ids.shape[1]:
        lg, state = kk.decode_step(w, c, ids[:, t:t + 1], state)
        pieces.append(lg)
        t += 1
    inc = torch.cat(pieces, dim=1)
    assert torch.equal(inc, full)
    assert torch.equal(kk.logprobs_of(inc, ids), lp_full)
    _assert_states_equal(state, st_full)


# ------------------------------------------------------------------------- (c) batch invariance


@pytest.mark.parametrize("which", ["kimi_linear", "k3"])
def test_batch_invariance_bitwise(which, hf_model, k3):
    c, w = _model(which, hf_model, k3)
    ids = _ids(4, 17, 6)
    alone, st_alone = kk.forward(w, c, ids[2:3])
    batch, st_batch = kk.forward(w, c, ids)
    assert torch.equal(batch[2:3], alone)
    # decode: the same sequence decoded alone and in the batch
    nxt = _ids(4, 1, 7)
    d_alone, _ = kk.decode_step(w, c, nxt[2:3], st_alone)
    d_batch, _ = kk.decode_step(w, c, nxt, st_batch)
    assert torch.equal(d_batch[2:3], d_alone)


# ---------------------------------------------------------------------- K3-only parts vs float64


def test_shared_ops_bitwise():
    """Where our explicit code meets a kernels op it gives the op's bits (fp32)."""
    c = kk.kimi_config(dict(K3_DICT, hidden_act="silu"))
    gen = torch.Generator().manual_seed(9)
    g, u = torch.randn(37, 32, generator=gen) * 3, torch.randn(37, 32, generator=gen)
    assert torch.equal(kk.glu(c, g, u), kernels.swiglu(g, u))
    x = torch.randn(37, H, generator=gen)
    wg, wu, wd = (torch.randn(32, H, generator=gen) * 0.2, torch.randn(32, H, generator=gen) * 0.2,
                  torch.randn(H, 32, generator=gen) * 0.2)
    assert torch.equal(kk._mlp(c, x, wg, wu, wd), kernels.expert_mlp(x, wg, wu, wd))
    y, wt = torch.randn(37, 3, H, generator=gen), torch.rand(37, 3, generator=gen)
    sh = torch.randn(37, H, generator=gen)
    assert torch.equal(kk._fold_combine(y, wt, sh, torch.float32), kernels.moe_combine(y, wt, sh))


def test_latent_moe_and_situ_vs_float64(k3):
    """K3 latent MoE (down-proj, routed SiTU experts in the latent, combine, RMSNorm, up-proj, +
    shared) in fp32 vs the same code on float64 weights / inputs (routing in fp32 in both: same ids).
    Measured: 1.3e-6 at max |out| 9.1 (1.5e-7 relative; 8 experts used). Asserted 1e-6 relative.
    Plus row invariance of the block. SiTU vs plain float64: 3.4e-6 at 31.7 (1.1e-7 relative)."""
    c, w = k3
    get = kk._sub(kk._model_getter(w), "model.layers.2.block_sparse_moe.")
    get64 = lambda n: None if get(n) is None else get(n).double()  # noqa: E731
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(10))
    out, aux = kk.kimi_moe_forward(c, get, x)
    out64, aux64 = kk.kimi_moe_forward(c, get64, x.double())
    assert torch.equal(aux["ids"], aux64["ids"])
    assert aux["ids"].unique().numel() > 3
    scale = out64.abs().max().item()
    assert (out.double() - out64).abs().max().item() <= 1e-6 * scale
    one, _ = kk.kimi_moe_forward(c, get, x[11:12])
    assert torch.equal(one, out[11:12])
    # situ vs a plain float64 formula (beta 4, linear_beta 8)
    gen = torch.Generator().manual_seed(11)
    g, u = torch.randn(50, 16, generator=gen) * 6, torch.randn(50, 16, generator=gen) * 12
    ref = 4 * torch.tanh(g.double() / 4) * torch.sigmoid(g.double()) * (8 * torch.tanh(u.double() / 8))
    assert (kk.glu(c, g, u).double() - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_attn_res_mix_vs_float64():
    """AttnRes mix vs plain float64 (``softmax_i(proj(rms_norm_n(v_i))) . v``): measured 8.2e-7 at
    max 9.5 (8.6e-8 relative), asserted 1e-6 relative; one source returns it exactly; rows alone."""
    gen = torch.Generator().manual_seed(12)
    srcs = [torch.randn(13, H, generator=gen) * (1 + i) for i in range(4)]
    nw, pw = 1 + 0.1 * torch.randn(H, generator=gen), torch.randn(1, H, generator=gen) * 0.5
    out = kk.attn_res_mix(srcs, nw, pw, 1e-5)
    s64 = torch.stack([s.double() for s in srcs], 0)
    nrm = s64 / torch.sqrt((s64 * s64).mean(-1, keepdim=True) + 1e-5) * nw.double()
    a = (nrm @ pw.double().T).softmax(0)
    ref = (a * s64).sum(0)
    assert (out.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert torch.equal(kk.attn_res_mix(srcs[:1], nw, pw, 1e-5), srcs[0])
    assert torch.equal(kk.attn_res_mix([s[5:6] for s in srcs], nw, pw, 1e-5), out[5:6])


def test_k3_model_vs_float64(k3):
    """The whole K3-class model (AttnRes, gated q-LoRA MLA, latent MoE, SiTU, K3 KDA) in fp32 vs the
    same functions on float64 weights (attention and routing stay fp32 inside kernels ops).
    Measured: 1.8e-4 at max |logit| 7.98 (2.3e-5 relative: this random model's attention is sharp).
    Asserted: 5e-5 relative."""
    c, w = k3
    ids = _ids(2, 23, 5)
    lg = kk.reference_logits(w, c, ids)
    lg64 = kk.reference_logits({k: v.double() for k, v in w.items()}, c, ids)
    assert lg64.dtype == torch.float64
    scale = lg64.abs().max().item()
    assert (lg.double() - lg64).abs().max().item() <= 5e-5 * scale
