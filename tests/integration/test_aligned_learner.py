"""The aligned Megatron-Core learner (recipe `mode: aligned`) against the kernels-only reference
forward (kernels.models.qwen3_dsv3.reference_logprobs) and against itself under batching,
micro-batching, right padding, TP=2, TP=4 and EP=2 (real megatron-core 0.16.1 on CPU over gloo).
Every row-parallel o_proj / down_proj follows the fixed 8-segment contract (docs/tp.md), whatever TP.

The claim tested is bitwise (torch.equal), not approximate: for the same weights and tokens,
Learner.logprobs in aligned mode == reference_logprobs, whatever the batch / layout.

Run: .venv/bin/python -m pytest tests/integration/test_aligned_learner.py -q -s
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_rz.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = {"qwen3_moe": REPO / "recipes/tiny_moe.yaml", "deepseek_v3": REPO / "recipes/tiny_dsv3.yaml"}
ARCHS = list(RECIPES)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from megatron_rz.learner.tiny_models import make_random_checkpoint

    out = {}
    for arch, path in RECIPES.items():
        d = tmp_path_factory.mktemp(arch)
        recipe = load_recipe(str(path))
        make_random_checkpoint(recipe, d, seed=0)
        if arch == "deepseek_v3":  # transformers initialises the noaux_tc bias to zeros
            sd = load_file(str(d / "model.safetensors"))
            g = torch.Generator().manual_seed(7)
            for k in sd:
                if k.endswith("e_score_correction_bias"):
                    sd[k] = torch.randn(sd[k].shape, generator=g) * 0.05
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[arch] = (d, recipe)
    return out


@pytest.fixture(scope="module")
def reference():
    """reference_logprobs, following the row-parallel K rule of megatron_rz.learner.aligned_spec.

    Transitional: if qwen3_dsv3.py does not (yet) split the K reduction of o_proj / down_proj into
    ROW_PARALLEL_K_SEGMENTS segments, its two per-layer helpers are replaced here (in this test
    process only) by versions that do; everything else is the reference's own code."""
    import kernels
    from megatron_rz.learner.aligned_spec import ROW_PARALLEL_K_SEGMENTS as KS
    from kernels.models import qwen3_dsv3 as R

    patched = "k_segments" not in inspect.getsource(R)
    saved = (R.attn_output, R.dense_mlp)
    if patched:
        def attn_output(c, w, o):
            return kernels.linear(o.reshape(o.shape[0], -1), w("self_attn.o_proj.weight"), k_segments=KS)

        def dense_mlp(w, x, prefix="mlp."):
            g = kernels.linear(x, w(prefix + "gate_proj.weight"))
            u = kernels.linear(x, w(prefix + "up_proj.weight"))
            return kernels.linear(kernels.swiglu(g, u), w(prefix + "down_proj.weight"), k_segments=KS)

        R.attn_output, R.dense_mlp = attn_output, dense_mlp
        print(f"\n[note] qwen3_dsv3.py has no k_segments rule yet: o_proj/down_proj patched to k_segments={KS}")
    yield R.reference_logprobs
    R.attn_output, R.dense_mlp = saved


def _learner(recipe, hf_dir, mode="aligned", **algo):
    from megatron_rz.learner.learner import Learner

    a = recipe.algo.model_copy(update=algo)
    return Learner(recipe.model, recipe.parallel, a, hf_dir, seed=0, mode=mode)


def _ragged(vocab: int, lengths, seed: int = 0, pad: int = 1):
    """Right-padded rows of the given lengths (ids >= 2; pad id 1)."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.full((len(lengths), S), pad, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, vocab, (n,), generator=g)
    return ids


def _bitwise(a, b):
    return f"equal={torch.equal(a, b)} frac={(a == b).float().mean().item():.4f} max|d|={(a - b).abs().max().item():.2e}"


# ------------------------------------------------------------------ (a) equal to the reference


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_logprobs_equal_reference(ckpts, reference, arch):
    d, recipe = ckpts[arch]
    learner = _learner(recipe, d)
    ids = _ragged(recipe.model.vocab_size, [12, 7, 12, 3, 9], seed=1)
    for temperature in (1.0, 0.7):
        lp = learner.logprobs(ids, temperature=temperature)
        ref = reference(str(d), None, ids, temperature)
        print(f"\n[{arch} T={temperature}] aligned learner vs reference: {_bitwise(lp, ref)}")
        assert lp.dtype == torch.float32 and lp.shape == ids.shape
        assert torch.equal(lp, ref)


# ------------------------------------------------------------------ (b) batch invariance


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_batch_and_micro_batch_invariance(ckpts, arch):
    d, recipe = ckpts[arch]
    learner = _learner(recipe, d)
    lengths = [5, 17, 9, 20, 3, 12, 14, 7, 20, 11, 6, 16, 8, 19, 4, 13]
    batch = _ragged(recipe.model.vocab_size, lengths, seed=2)
    full = learner.logprobs(batch, micro_batch_size=16)
    mb3 = learner.logprobs(batch, micro_batch_size=3)
    shuffled_idx = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    shuffled = learner.logprobs(batch[shuffled_idx], micro_batch_size=5)
    unshuffled = torch.empty_like(shuffled)
    unshuffled[shuffled_idx] = shuffled
    assert torch.equal(full, mb3), _bitwise(full, mb3)
    assert torch.equal(full, unshuffled), _bitwise(full, unshuffled)
    for row in (0, 3, 4, 9):
        n = lengths[row]
        alone = learner.logprobs(batch[row : row + 1, :n])
        assert torch.equal(alone[0], full[row, :n]), f"row {row}: " + _bitwise(alone[0], full[row, :n])
    # longer right padding of the same row
    padded = torch.cat([batch[2:3], torch.ones(1, 9, dtype=torch.long)], dim=1)
    assert torch.equal(learner.logprobs(padded)[0, : lengths[2]], full[2, : lengths[2]])
    print(f"\n[{arch}] alone / batch of 16 / micro-batch 3 / shuffled micro-batch 5 / extra padding: bitwise equal")


# ------------------------------------------------------------------ (c) close to fast mode, gradients


def _nll_loss(logp, rows):
    tok = -(logp * rows["loss_mask"]).sum(dim=1)
    return tok.sum(), {"nll": tok.detach().sum(), "tokens": rows["loss_mask"].sum()}


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_close_to_fast_and_trains(ckpts, reference, arch):
    d, recipe = ckpts[arch]
    ids = _ragged(recipe.model.vocab_size, [10, 8, 10, 6, 9, 10], seed=4)
    mask = (ids != 1).float()
    mask[:, 0] = 0
    fast = _learner(recipe, d, mode="fast", lr=3e-3)
    t0 = time.perf_counter()
    lp_fast = fast.logprobs(ids)
    t_fast = time.perf_counter() - t0
    g_fast = fast.train_step(ids, _nll_loss, micro_batch_size=3, loss_mask=mask)
    del fast
    aligned = _learner(recipe, d, lr=3e-3)
    t0 = time.perf_counter()
    lp_al = aligned.logprobs(ids)
    t_al = time.perf_counter() - t0
    diff = (lp_al - lp_fast).abs().max().item()
    losses = []
    steps = []
    for _ in range(3):
        steps.append(aligned.train_step(ids, _nll_loss, micro_batch_size=3, loss_mask=mask))
        losses.append(steps[-1]["loss"])
    gn_rel = abs(steps[0]["grad_norm"] - g_fast["grad_norm"]) / g_fast["grad_norm"]
    print(f"\n[{arch}] aligned vs fast logprobs max|d| = {diff:.2e}; logprobs time fast {t_fast*1e3:.0f} ms, "
          f"aligned {t_al*1e3:.0f} ms ({t_al / t_fast:.1f}x); grad_norm fast {g_fast['grad_norm']:.6f} "
          f"aligned {steps[0]['grad_norm']:.6f} (rel {gn_rel:.1e}); loss over steps {[round(x, 4) for x in losses]}")
    assert diff < 1e-5
    assert abs(steps[0]["loss"] - g_fast["loss"]) < 1e-4
    assert gn_rel < 1e-4
    assert losses[-1] < losses[0]
    # after training, the learner still equals the reference on its exported weights (weight sync)
    weights = {k: v.detach().clone() for k, v in aligned.export_hf_weights()}
    ref = reference(weights, str(d), ids, 1.0)
    assert torch.equal(aligned.logprobs(ids), ref)


# ------------------------------------------------------------------ (d) TP=2 / EP=2


def _torchrun(recipe_path, hf_dir, tp, ep, out, nproc=2, sets=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           "-m", "megatron_rz.learner.parallel_check", "--recipe", str(recipe_path), "--mode", "aligned",
           "--hf-dir", str(hf_dir), "--tp", str(tp), "--ep", str(ep), "--out", str(out), "--steps", "1"]
    cmd += [a for kv in sets for a in ("--set", kv)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def tp1(ckpts):
    from megatron_rz.learner.parallel_check import run_check

    return {arch: run_check(str(d), 1, 1, world_size=1, steps=1, mode="aligned", recipe_path=str(RECIPES[arch]))
            for arch, (d, _) in ckpts.items()}


QWEN2 = REPO / "recipes/tiny_qwen2.yaml"


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
    """recipes/tiny_qwen2.yaml's random checkpoint with non-zero q/k/v biases (transformers
    initialises them to zero)."""
    from safetensors.torch import load_file, save_file

    from megatron_rz.learner.tiny_models import make_random_checkpoint

    d = tmp_path_factory.mktemp("qwen2")
    make_random_checkpoint(load_recipe(str(QWEN2)), d, seed=0)
    sd = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for k in sd:
        if k.endswith(".bias"):
            sd[k] = torch.randn(sd[k].shape, generator=g) * 0.5
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


LAYOUTS = {"tp2": (2, 1), "ep2": (1, 2)}


@pytest.fixture(scope="module")
def two_ranks(ckpts, qwen2_ckpt, tmp_path_factory):
    """The 2-rank learners the tests below compare, from ONE torchrun (helpers.parallel_checks; one
    launch each cost the ranks' start-up five times): each arch at TP=2 and at EP=2, and dense Qwen2
    at TP=2, one aligned train step each."""
    from helpers import parallel_checks

    jobs = [dict(hf_dir=str(ckpts[arch][0]), tp=tp, ep=ep, steps=1, mode="aligned", recipe_path=str(RECIPES[arch]))
            for arch in ARCHS for tp, ep in LAYOUTS.values()]
    jobs.append(dict(hf_dir=str(qwen2_ckpt), tp=2, ep=1, steps=1, mode="aligned", recipe_path=str(QWEN2)))
    res = parallel_checks(jobs, tmp_path_factory.mktemp("two_ranks"))
    out = {(arch, name): res[i * len(LAYOUTS) + j] for i, arch in enumerate(ARCHS) for j, name in enumerate(LAYOUTS)}
    out["qwen2"] = res[-1]
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_aligned_parallel_layout_bitwise(ckpts, tp1, two_ranks, reference, arch, layout):
    from megatron_rz.learner.parallel_check import fixed_batch

    tp, ep = LAYOUTS[layout]
    d, recipe = ckpts[arch]
    base = tp1[arch]
    got = two_ranks[(arch, layout)]
    assert (got["layout"]["tp"], got["layout"]["ep"], got["layout"]["mode"]) == (tp, ep, "aligned")
    ids, _, _ = fixed_batch(recipe.model.vocab_size)
    ref = reference(str(d), None, ids, 1.0)
    gn = abs(got["metrics"][0]["grad_norm"] - base["metrics"][0]["grad_norm"]) / base["metrics"][0]["grad_norm"]
    wd = max((got["weights"][k] - base["weights"][k]).abs().max().item() for k in base["weights"])
    print(f"\n[{arch} tp={tp} ep={ep}] logprobs vs TP=1: {_bitwise(got['logprobs_before'], base['logprobs_before'])}; "
          f"vs reference: {_bitwise(got['logprobs_before'], ref)}; grad-norm rel diff {gn:.1e}; "
          f"after 1 step: logprobs {_bitwise(got['logprobs_after'], base['logprobs_after'])}, max|dweight| {wd:.1e}")
    assert torch.equal(base["logprobs_before"], ref)
    assert torch.equal(got["logprobs_before"], base["logprobs_before"])
    assert gn < 1e-5 and wd < 1e-5


# ------------------------------------------------------------------ (e) bf16 model (forward only)


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_bf16_model_equals_reference(ckpts, reference, arch):
    """bf16 weights (the GPU configuration; CPU training in bf16 is refused by the Learner, so the
    model is driven directly): still bitwise the reference on the same bf16 weights. DeepSeek's
    e_score_correction_bias stays fp32 on both sides."""
    import kernels
    from safetensors.torch import load_file

    from megatron_rz.learner import hf_convert
    from megatron_rz.learner.model import build_gpt_model, init_parallel

    d, recipe = ckpts[arch]
    mcfg = recipe.model.model_copy(update={"dtype": "bfloat16"})
    init_parallel(recipe.parallel, 0)
    model = build_gpt_model(mcfg, recipe.parallel, mode="aligned")
    hf_convert.load_hf_into_megatron(model, d, mcfg)
    model.eval()
    ids = _ragged(recipe.model.vocab_size, [12, 7, 12, 3, 9], seed=1)
    b, s = ids.shape
    with torch.no_grad():
        logits = model(ids, torch.arange(s).expand(b, s), None)[:, : s - 1]
        lp = kernels.logprobs_from_logits(logits.reshape(b * (s - 1), -1).contiguous(), ids[:, 1:].reshape(-1))
    sd = {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16))
          for k, v in load_file(str(d / "model.safetensors")).items()}
    ref = reference(sd, str(d), ids, 1.0)[:, 1:]
    print(f"\n[{arch} bf16] aligned model vs reference: {_bitwise(lp.view(b, s - 1), ref)}")
    assert torch.equal(lp.view(b, s - 1), ref)


# ------------------------------------------------------------------ (f) dense Qwen2 at TP=2


def test_aligned_qwen2_tp2_bitwise(qwen2_ckpt, two_ranks, reference):
    """Dense Qwen2 (recipes/tiny_qwen2.yaml; q/k/v biases non-zero): the TP=1 learner equals the
    reference, the TP=2 learner (fused linear_qkv weight AND bias split by query group) equals TP=1
    bitwise; one update later the two layouts still agree to fp32 rounding (gradient reductions)."""
    from megatron_rz.learner.parallel_check import fixed_batch, run_check

    d = qwen2_ckpt
    base = run_check(str(d), 1, 1, world_size=1, steps=1, mode="aligned", recipe_path=str(QWEN2))
    got = two_ranks["qwen2"]
    assert (got["layout"]["tp"], got["layout"]["mode"]) == (2, "aligned")
    ids, _, _ = fixed_batch(64)
    ref = reference(str(d), None, ids, 1.0)
    assert torch.equal(base["logprobs_before"], ref)
    assert torch.equal(got["logprobs_before"], base["logprobs_before"]), _bitwise(got["logprobs_before"], base["logprobs_before"])
    gn = abs(got["metrics"][0]["grad_norm"] - base["metrics"][0]["grad_norm"]) / base["metrics"][0]["grad_norm"]
    wd = max((got["weights"][k] - base["weights"][k]).abs().max().item() for k in base["weights"])
    assert any(k.endswith("q_proj.bias") for k in got["weights"])
    assert gn < 1e-5 and wd < 1e-5


# ------------------------------------------------------------------ (g) TP=4: 2 of the 8 K segments per rank


def test_aligned_tp4_bitwise(tmp_path, reference):
    """Qwen3-MoE at learner TP=4 (4 gloo ranks; recipes/tiny_moe.yaml with model.num_kv_heads=4 so
    that TP=4 divides the KV heads): each rank computes 2 of the kernels.ROW_PARALLEL_K_SEGMENTS = 8
    row-parallel K segments; the log-probs are bitwise TP=1's and the reference's, and one update
    later the layouts agree to fp32 rounding (gradient reductions)."""
    import kernels
    from megatron_rz.learner.parallel_check import fixed_batch, run_check
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    assert kernels.ROW_PARALLEL_K_SEGMENTS % 4 == 0
    path, sets = RECIPES["qwen3_moe"], ["model.num_kv_heads=4"]
    d = tmp_path / "moe_kv4"
    recipe = load_recipe(str(path), sets)
    make_random_checkpoint(recipe, d, seed=0)
    t0 = time.perf_counter()
    base = run_check(str(d), 1, 1, sets, world_size=1, steps=1, mode="aligned", recipe_path=str(path))
    t1 = time.perf_counter()
    got = _torchrun(path, d, 4, 1, tmp_path / "out.pt", nproc=4, sets=sets)
    t2 = time.perf_counter()
    ids, _, _ = fixed_batch(recipe.model.vocab_size)
    ref = reference(str(d), None, ids, 1.0)
    gn = abs(got["metrics"][0]["grad_norm"] - base["metrics"][0]["grad_norm"]) / base["metrics"][0]["grad_norm"]
    wd = max((got["weights"][k] - base["weights"][k]).abs().max().item() for k in base["weights"])
    print(f"\n[qwen3_moe tp=4] logprobs vs TP=1: {_bitwise(got['logprobs_before'], base['logprobs_before'])}; "
          f"vs reference: {_bitwise(got['logprobs_before'], ref)}; grad-norm rel diff {gn:.1e}; max|dweight| {wd:.1e}; "
          f"TP=1 {t1 - t0:.0f} s, TP=4 torchrun {t2 - t1:.0f} s")
    assert got["layout"]["tp"] == 4
    assert torch.equal(base["logprobs_before"], ref)
    assert torch.equal(got["logprobs_before"], base["logprobs_before"])
    assert gn < 1e-5 and wd < 1e-5
