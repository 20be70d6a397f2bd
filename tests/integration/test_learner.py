"""The Megatron-Core learner against Hugging Face and against itself under TP/EP (real
megatron-core 0.16.1 on CPU over gloo, no mocks).

Run: .venv/bin/python -m pytest tests/integration/test_learner.py -q -s
(-s shows the measured differences). Tiny random checkpoints are made once per module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rz.recipe import load_recipe

DEEPSEEK = [
    "model.arch=deepseek_v3",
    "model.num_shared_experts=1",
    "model.router_score=sigmoid",
    "model.router_expert_bias=true",
    "model.router_num_groups=2",
    "model.router_group_topk=1",
    "model.first_k_dense=1",
    "model.head_dim=64",
]
OVERRIDES = {"qwen3_moe": [], "deepseek_v3": DEEPSEEK}
ARCHS = list(OVERRIDES)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    out = {}
    for arch, ov in OVERRIDES.items():
        d = tmp_path_factory.mktemp(arch)
        recipe = load_recipe(None, ov)
        model, _ = make_random_checkpoint(recipe, d, seed=0)
        if arch == "deepseek_v3":
            # transformers initialises the noaux_tc bias to zeros; give it values so the test sees
            # that selection uses the bias and the weights do not.
            from safetensors.torch import load_file, save_file

            sd = load_file(str(d / "model.safetensors"))
            g = torch.Generator().manual_seed(7)
            for k in sd:
                if k.endswith("e_score_correction_bias"):
                    sd[k] = torch.randn(sd[k].shape, generator=g) * 0.05
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[arch] = (d, recipe)
    return out


def _learner(recipe, hf_dir, **algo):
    from megatron_rz.learner.learner import Learner

    a = recipe.algo.model_copy(update=algo)
    return Learner(recipe.model, recipe.parallel, a, hf_dir, seed=0)


def _batch(vocab: int, b: int = 5, s: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (b, s), generator=g)  # ids 0/1 are eos/pad


# ------------------------------------------------------------------ (a) round trip


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_megatron_hf_round_trip_is_exact(ckpts, arch):
    from safetensors.torch import load_file

    from megatron_rz.learner import hf_convert
    from megatron_rz.learner.model import build_gpt_model, init_parallel

    d, recipe = ckpts[arch]
    init_parallel(recipe.parallel, 0)
    model = build_gpt_model(recipe.model, recipe.parallel)
    hf_convert.load_hf_into_megatron(model, d, recipe.model)
    original = load_file(str(d / "model.safetensors"))
    exported = dict(hf_convert.export_hf_weights(model, recipe.model))
    assert set(exported) == set(original)
    bad = [k for k in original if not torch.equal(exported[k], original[k])]
    assert not bad, f"not bitwise equal after HF -> Megatron -> HF: {bad[:5]}"


# ------------------------------------------------------------------ (b) parity with transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(ckpts, arch):
    from transformers import AutoModelForCausalLM

    d, recipe = ckpts[arch]
    learner = _learner(recipe, d)
    ids = _batch(recipe.model.vocab_size)
    ids[1, 8:] = 1  # a right-padded row
    temperature = 0.7
    lp = learner.logprobs(ids, temperature=temperature)
    hf = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=ids).logits.float() / temperature
    ref = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    diff = (lp[:, 1:] - ref).abs().max().item()
    print(f"\n[{arch}] learner vs transformers logprob max |diff| = {diff:.3e}")
    assert lp.shape == ids.shape and lp.dtype == torch.float32
    assert torch.all(lp[:, 0] == 0)
    assert diff < 1e-4
    # right padding does not change the row's real tokens
    alone = learner.logprobs(ids[1:2, :8], temperature=temperature)
    assert (alone - lp[1:2, :8]).abs().max().item() < 1e-5


# ------------------------------------------------------------------ (c) TP / EP equality


def _torchrun(hf_dir, tp, ep, out, overrides, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "megatron_rz.learner.parallel_check",
           "--hf-dir", str(hf_dir), "--tp", str(tp), "--ep", str(ep), "--out", str(out), *extra]
    for ov in overrides:
        cmd += ["--set", ov]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def baselines(ckpts):
    from megatron_rz.learner.parallel_check import run_check

    return {arch: run_check(str(d), 1, 1, OVERRIDES[arch], world_size=1) for arch, (d, _) in ckpts.items()}


LAYOUTS = {"tp2": (2, 1), "ep2": (1, 2)}
DISTOPT = ["parallel.distributed_optimizer=true"]


@pytest.fixture(scope="module")
def two_ranks(ckpts, tmp_path_factory):
    """What the 2-rank tests below compare, from ONE torchrun (helpers.parallel_checks; one launch
    per layout cost the ranks' start-up five times): every arch at TP=2 and at EP=2, then the
    distributed optimizer's two steps at dp=2 x ep=2 with its checkpoint after step 1 (the resume
    from that checkpoint runs in a fresh launch of its own, in the test)."""
    from helpers import parallel_checks

    tmp = tmp_path_factory.mktemp("two_ranks")
    jobs = [dict(hf_dir=str(ckpts[arch][0]), tp=tp, ep=ep, overrides=OVERRIDES[arch])
            for arch in ARCHS for tp, ep in LAYOUTS.values()]
    jobs.append(dict(hf_dir=str(ckpts["qwen3_moe"][0]), tp=1, ep=2, overrides=DISTOPT, save_after=1,
                     save_dir=str(tmp / "distopt_ckpt")))
    res = parallel_checks(jobs, tmp)
    out = {(arch, name): res[i * len(LAYOUTS) + j] for i, arch in enumerate(ARCHS) for j, name in enumerate(LAYOUTS)}
    out["distopt"], out["distopt_ckpt"] = res[-1], tmp / "distopt_ckpt"
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_matches_single_process(baselines, two_ranks, arch, layout):
    tp, ep = LAYOUTS[layout]
    base = baselines[arch]
    got = two_ranks[(arch, layout)]
    assert got["layout"]["tp"] == tp and got["layout"]["ep"] == ep
    lp0 = (got["logprobs_before"] - base["logprobs_before"]).abs().max().item()
    lp1 = (got["logprobs_after"] - base["logprobs_after"]).abs().max().item()
    assert set(got["weights"]) == set(base["weights"])
    wd = max((got["weights"][k].float() - base["weights"][k].float()).abs().max().item() for k in base["weights"])
    bitwise = torch.equal(got["logprobs_after"], base["logprobs_after"]) and all(
        torch.equal(got["weights"][k], base["weights"][k]) for k in base["weights"]
    )
    gn = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(got["metrics"], base["metrics"]))
    print(f"\n[{arch} tp={tp} ep={ep}] max|dlogp| before {lp0:.2e} after 2 steps {lp1:.2e}; "
          f"max|dweight| {wd:.2e}; grad-norm rel diff {gn:.1e}; bitwise={bitwise}")
    assert lp0 < 1e-5 and lp1 < 1e-5
    assert wd < 1e-5  # an Adam step moves weights by ~lr = 1e-4: a wrong gradient shows up here
    assert gn < 1e-5
    for a, b in zip(got["metrics"], base["metrics"]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and a["tokens"] == b["tokens"]


# ------------------------------------------------------------------ (d) training


def _nll_loss(logp, rows):
    tok = -(logp * rows["loss_mask"]).sum(dim=1)
    return tok.sum(), {"nll": tok.detach().sum(), "tokens": rows["loss_mask"].sum()}


def test_train_step_lowers_loss_and_conventions(ckpts, tmp_path):
    d, recipe = ckpts["qwen3_moe"]
    learner = _learner(recipe, d, lr=3e-3)
    ids = _batch(recipe.model.vocab_size, b=6, s=10, seed=3)
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[:, 0] = 0
    # micro-batch split does not change the step: same loss and gradient norm for 1 or 3 chunks
    saved = tmp_path / "ckpt"
    learner.save_checkpoint(saved)
    before = learner.logprobs(ids)
    a = learner.train_step(ids, _nll_loss, micro_batch_size=6, loss_mask=mask)
    # train_step returns the logprobs its loss used (pre-update weights): the same values
    assert a["logprobs"].shape == before.shape and (a["logprobs"] - before).abs().max().item() < 1e-6
    after_a = learner.logprobs(ids)
    learner.load_checkpoint(saved)
    assert learner.version == 0
    b = learner.train_step(ids, _nll_loss, micro_batch_size=2, loss_mask=mask)
    after_b = learner.logprobs(ids)
    print(f"\nmicro-batch 6 vs 2: grad_norm {a['grad_norm']:.6f} vs {b['grad_norm']:.6f}, "
          f"max|dlogp| after step {(after_a - after_b).abs().max().item():.2e}")
    assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"]
    assert (after_a - after_b).abs().max().item() < 1e-4
    assert a["tokens"] == pytest.approx(9.0) and a["lr"] == pytest.approx(3e-3) and a["grad_norm"] > 0
    # loss = (sum over rows) / B, computed with the pre-step weights
    lp0 = learner.logprobs(ids)  # current (after one step) weights
    losses = [b["loss"]]
    for _ in range(4):
        losses.append(learner.train_step(ids, _nll_loss, micro_batch_size=4, loss_mask=mask)["loss"])
    expected_first = float(-(lp0 * mask).sum() / ids.shape[0])
    assert losses[1] == pytest.approx(expected_first, rel=1e-5)
    print("nll per row over steps:", [round(x, 4) for x in losses])
    assert losses[-1] < losses[0] - 0.5
    assert learner.version == 5


def test_checkpoint_round_trip(ckpts, tmp_path):
    d, recipe = ckpts["deepseek_v3"]
    learner = _learner(recipe, d, lr=1e-3)
    ids = _batch(recipe.model.vocab_size, b=4, s=8, seed=5)
    mask = torch.ones_like(ids, dtype=torch.float32)
    learner.train_step(ids, _nll_loss, micro_batch_size=4, loss_mask=mask)
    learner.save_checkpoint(tmp_path / "c", step=7)
    ref = learner.train_step(ids, _nll_loss, micro_batch_size=4, loss_mask=mask)
    ref_w = {k: v.clone() for k, v in learner.export_hf_weights()}
    assert learner.load_checkpoint(tmp_path / "c") == 7
    assert learner.version == 1
    again = learner.train_step(ids, _nll_loss, micro_batch_size=4, loss_mask=mask)
    w = dict(learner.export_hf_weights())
    # the same step from the restored model + optimizer state gives the same weights
    assert again["loss"] == ref["loss"] and again["grad_norm"] == ref["grad_norm"]
    assert all(torch.equal(w[k], ref_w[k]) for k in ref_w)


# ------------------------------------------------------------------ (d) distributed optimizer


def test_distributed_optimizer_matches_and_resumes_exactly(ckpts, baselines, two_ranks, tmp_path):
    """parallel.distributed_optimizer=true (Megatron's ZeRO-1 DistributedOptimizer on gloo): dp=2 with
    ep=2, so both the dense and the expert parameter families are sharded optimizers. Two steps
    agree with one process to fp32 reduction order; a checkpoint written after step 1 (dist_checkpointing:
    fp32 params and Adam moments in model space) and resumed for step 2, in a fresh 2-rank launch,
    gives the uninterrupted run's weights bit for bit."""
    d, _ = ckpts["qwen3_moe"]
    base = baselines["qwen3_moe"]
    ov = DISTOPT
    ck = two_ranks["distopt_ckpt"]
    full = two_ranks["distopt"]  # the two steps, with the checkpoint after step 1 (--save-after 1)
    assert full["optimizers"] == ["DistributedOptimizer", "DistributedOptimizer"], full["optimizers"]
    wd = max((full["weights"][k].float() - base["weights"][k].float()).abs().max().item() for k in base["weights"])
    assert wd < 1e-5
    from megatron_rz.learner.checkpoint import read_common

    assert (ck / "COMPLETE").exists() and (ck / "__0_0.distcp").exists()  # a dist_checkpointing checkpoint
    assert read_common(ck)["layout"]["distributed_optimizer"] is True
    resumed = _torchrun(d, 1, 2, tmp_path / "resumed.pt", ov, extra=["--load", str(ck), "--steps", "1"])
    assert all(torch.equal(resumed["weights"][k], full["weights"][k]) for k in full["weights"])
    assert torch.equal(resumed["logprobs_after"], full["logprobs_after"])
    assert resumed["metrics"][0]["grad_norm"] == full["metrics"][1]["grad_norm"]
    print(f"\n[distributed optimizer dp=2 ep=2] max|dweight| vs one process after 2 steps {wd:.2e}; "
          "resume from its step-1 dist_checkpointing checkpoint bitwise")


# ------------------------------------------------------------------ (e) FP8 block-quantised releases


def test_fp8_release_checkpoint_loads_dequantised(ckpts, baselines, tmp_path):
    """A checkpoint in DeepSeek's released FP8 format (linear weights e4m3 with a 128 x 128
    `weight_scale_inv` each; embeddings, norms, router and lm_head unquantised) loads into the learner
    dequantised: its log-probs and exported weights equal those of the same dequantised weights
    stored in fp32."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kernels.fp8 import dequantize_weight_blockwise, quantize_weight_blockwise
    from megatron_rz.learner.parallel_check import run_check

    d, _ = ckpts["deepseek_v3"]
    sd = load_file(str(d / "model.safetensors"))
    fp8, deq = {}, {}
    for k, v in sd.items():
        if v.dim() == 2 and k.endswith("proj.weight"):  # attention and MLP/expert projections
            q, s = quantize_weight_blockwise(v)
            fp8[k], fp8[k + "_scale_inv"] = q, s
            deq[k] = dequantize_weight_blockwise(q, s)
        else:
            fp8[k] = deq[k] = v
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) >= 10
    dirs = {}
    for name, tensors in (("fp8", fp8), ("deq", deq)):
        out = tmp_path / name
        shutil.copytree(d, out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        dirs[name] = out
    a = run_check(str(dirs["fp8"]), 1, 1, OVERRIDES["deepseek_v3"], world_size=1, steps=0)
    b = run_check(str(dirs["deq"]), 1, 1, OVERRIDES["deepseek_v3"], world_size=1, steps=0)
    assert torch.equal(a["logprobs_before"], b["logprobs_before"])
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in b["weights"])
    assert not torch.equal(a["logprobs_before"], baselines["deepseek_v3"]["logprobs_before"])  # it is quantised
