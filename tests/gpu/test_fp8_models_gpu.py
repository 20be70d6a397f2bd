"""GPU: the blockwise-FP8 model path (recipe model.fp8=blockwise) on CUDA, through the Triton ops.

The plain full-sequence reference (kernels/models/qwen3_dsv3.py, the forward the aligned vLLM
class runs layer by layer) with FP8 linears, bf16, on a small Qwen3-MoE-class model: token logprobs
are batch invariant (``torch.equal``) across batch sizes, batch composition and right padding; the
learner-side fake-quant linear (master weight quantised at every call) gives the engine-side bits
(weight quantised once, cached) and its master weight gets a gradient; FP8 changes the logprobs by
an FP8-sized amount against the same model without it.

    PYTHONPATH=. python -m pytest tests/gpu/test_fp8_models_gpu.py -q -s
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

from gpu_util import need_cuda  # noqa: E402

H, L, HQ, HKV, D, E, K_TOP, I_MOE, V = 512, 2, 8, 2, 64, 8, 2, 256, 1024


def _model():
    from kernels.models.qwen3_dsv3 import ArchConfig

    c = ArchConfig(arch="qwen3_moe", hidden_size=H, num_layers=L, num_heads=HQ, num_kv_heads=HKV, vocab_size=V,
                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, head_dim=D,
                   moe_intermediate_size=I_MOE, num_experts=E, top_k=K_TOP, norm_topk_prob=True,
                   moe_layers=[True] * L, score="softmax", fp8="blockwise")
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, sc=0.05: (torch.randn(*s, device="cuda", generator=g) * sc).bfloat16()  # noqa: E731
    sd = {"model.embed_tokens.weight": r(V, H, sc=1.0), "model.norm.weight": 1 + r(H), "lm_head.weight": r(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H),
                   p + "self_attn.q_proj.weight": r(HQ * D, H), p + "self_attn.k_proj.weight": r(HKV * D, H),
                   p + "self_attn.v_proj.weight": r(HKV * D, H), p + "self_attn.o_proj.weight": r(H, HQ * D),
                   p + "self_attn.q_norm.weight": 1 + r(D), p + "self_attn.k_norm.weight": 1 + r(D),
                   p + "mlp.gate.weight": r(E, H)})
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            sd.update({q + "gate_proj.weight": r(I_MOE, H), q + "up_proj.weight": r(I_MOE, H),
                       q + "down_proj.weight": r(H, I_MOE)})
    return c, sd


def _ragged(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.ones(len(lengths), S, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, V, (n,), generator=g)
    return ids.cuda()


def test_fp8_reference_model_batch_invariant_on_cuda():
    need_cuda()
    from kernels.models.qwen3_dsv3 import reference_logprobs

    c, sd = _model()
    lengths = [37, 5, 64, 18, 64, 9, 51, 30, 2, 44, 64, 12, 27, 60, 8, 33]
    ids = _ragged(lengths, seed=1)
    full = reference_logprobs(sd, c, ids)
    n_tok = sum(n - 1 for n in lengths)
    checks = 0
    for bs in (1, 3, 7):  # other batch sizes and compositions
        for s0 in range(0, len(lengths), bs):
            rows = list(range(s0, min(len(lengths), s0 + bs)))
            S = max(lengths[r] for r in rows)
            part = reference_logprobs(sd, c, ids[rows, :S])
            for j, r in enumerate(rows):
                n = lengths[r]
                assert torch.equal(part[j, :n], full[r, :n]), f"bs={bs} row {r}"
                checks += 1
    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(2)).tolist()
    shuf = reference_logprobs(sd, c, torch.cat([ids[perm], torch.ones(16, 9, dtype=torch.long, device="cuda")], 1))
    for j, r in enumerate(perm):
        assert torch.equal(shuf[j, : lengths[r]], full[r, : lengths[r]]), f"shuffled+padded row {r}"
    ref16 = reference_logprobs(sd, dataclasses.replace(c, fp8="none"), ids)
    m = torch.zeros_like(full, dtype=torch.bool)
    for i, n in enumerate(lengths):
        m[i, 1:n] = True
    d = (full - ref16).abs()[m]
    print(f"\n[gpu fp8] reference model bf16+FP8 on CUDA: {n_tok} token logprobs, batch sizes 1/3/7/16, "
          f"shuffled + 9 extra pad columns: all torch.equal ({checks + 16} row checks); "
          f"FP8 vs bf16 without FP8: max |dlogp| {d.max().item():.4f}, mean {d.mean().item():.4f}, "
          f"bitwise {(full[m] == ref16[m]).float().mean().item():.3f}")
    assert 1e-4 < d.mean().item() < 0.2


def test_fake_quant_linear_equals_cached_engine_weight_on_cuda():
    need_cuda()
    import kernels
    from kernels.models.qwen3_dsv3 import FP8WeightCache

    g = torch.Generator(device="cuda").manual_seed(3)
    for N, K in ((512, 512), (256, 300), (1536, 512)):
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_(True)
        cache = FP8WeightCache()
        wq, ws = cache.get("w", w)
        assert cache.get("w", w)[0] is wq  # quantised once while the weight is unchanged
        for M in (1, 17, 64, 300):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16().requires_grad_(True)
            y = kernels.fake_quant_linear(x, w)  # learner: quantise the master weight now
            assert torch.equal(y, kernels.fp8_linear(x.detach(), wq, ws))  # engine: the cached copy
            y.float().square().sum().backward()
            assert w.grad is not None and torch.isfinite(w.grad.float()).all() and w.grad.abs().sum() > 0
            w.grad = None
        with torch.no_grad():
            w.mul_(1.5)  # an in-place weight update: the cache must re-quantise
        assert cache.get("w", w)[0] is not wq


def test_fp8_learner_equals_reference_on_cuda():
    """The Megatron learner (aligned, model.fp8=blockwise, one GPU) against the reference on the same
    GPU, fp32 and bf16: log-probs torch.equal before and after a train step, micro-batch invariant,
    every FP8 master weight moved. Needs megatron-core and RZ_GPU_CKPT (a tiny_moe HF checkpoint,
    see tests/gpu/learner_gpu_bootstrap.sh)."""
    need_cuda()
    import json
    import os
    from pathlib import Path

    pytest.importorskip("megatron.core")
    ckpt = os.environ.get("RZ_GPU_CKPT")
    if not ckpt or not (Path(ckpt) / "config.json").exists():
        pytest.skip("set RZ_GPU_CKPT to a tiny_moe HF checkpoint")
    from safetensors.torch import load_file

    from megatron_rz.learner.learner import Learner
    from megatron_rz.learner.parallel_check import fixed_batch, reinforce_loss
    from megatron_rz.recipe import load_recipe
    from kernels.models.qwen3_dsv3 import reference_logprobs

    root = Path(__file__).resolve().parents[2]
    cfg = dict(json.loads((Path(ckpt) / "config.json").read_text()), rz_fp8="blockwise")
    for dtype in ("float32", "bfloat16"):
        r = load_recipe(str(root / "recipes/tiny_moe.yaml"), ["model.fp8=blockwise", f"model.dtype={dtype}"])
        learner = Learner(r.model, r.parallel, r.algo, ckpt, seed=0, mode="aligned")
        ids, mask, adv = fixed_batch(r.model.vocab_size)
        m = mask.bool()

        def ref(sd):
            sd = {k: v.to(getattr(torch, dtype)).cuda() for k, v in sd.items()}
            return reference_logprobs(sd, cfg, ids.cuda()).cpu()

        before = learner.logprobs(ids)
        assert torch.equal(learner.logprobs(ids, micro_batch_size=1), before)
        ref_before = ref(load_file(str(Path(ckpt) / "model.safetensors")))
        keys = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
        w0 = {n: p.detach().clone() for n, p in learner.model.named_parameters() if any(k in n for k in keys)}
        out = learner.train_step(ids, reinforce_loss, micro_batch_size=2, loss_mask=mask, advantages=adv)
        moved = sum(not torch.equal(w0[n], p.detach()) for n, p in learner.model.named_parameters() if n in w0)
        after = learner.logprobs(ids)
        ref_after = ref({k: v.detach() for k, v in learner.export_hf_weights()})
        print(f"\n[gpu fp8 learner {dtype}] vs reference before {(before[m] == ref_before[m]).float().mean().item():.3f} "
              f"after {(after[m] == ref_after[m]).float().mean().item():.3f} bitwise; grad_norm {out['grad_norm']:.4f}; "
              f"FP8 master weights moved {moved}/{len(w0)}")
        assert torch.equal(before[m], ref_before[m]) and torch.equal(after[m], ref_after[m])
        assert moved > 0 and not torch.equal(after[m], before[m])
        del learner
