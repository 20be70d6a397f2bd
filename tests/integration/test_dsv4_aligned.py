"""Aligned DeepSeek-V4: our functions match transformers, and vLLM == Megatron learner bitwise.

A small DeepSeek-V4-class config (every layer kind: compressed sparse with an indexer whose top-k is
smaller than the number of entries, heavily compressed x128, sliding window 16; hash-routed and
sqrt-softplus-routed MoE; hyper-connections) so sequences of ~150 tokens run every attention path in
seconds. The stock-vLLM (fast) side of the tiny recipe is tests/integration/test_dsv4_fast.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import V4_SMALL

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM (needs >= 5.19)", allow_module_level=True)

from kernels.models import dsv4 as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = V4_SMALL


def _hf_model():
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=96, hidden_size=64, num_hidden_layers=4, compress_ratios=[4, 128, 0, 4], num_hash_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
        o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        scoring_func="sqrtsoftplus", hc_mult=4, sliding_window=16, index_n_heads=16, index_head_dim=16, index_topk=3,
        max_position_embeddings=512)
    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # transformers leaves many weights at 0/1: randomise all, and the tables
        for _, p in m.named_parameters():
            p.normal_(0, 0.3 if p.dim() < 2 else 0.15)
        for n, b in m.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(96)]))
            elif n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return cfg, m


def test_functions_match_transformers_and_decode_equals_prefill(tmp_path):
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    cfg, m = _hf_model()
    from megatron_rz.learner.tiny_models import deepseek_v4_original_state_dict

    sd = deepseek_v4_original_state_dict(m)
    ids = torch.randint(0, 96, (2, 150))
    with torch.no_grad():
        ref = m(ids).logits.float()
    # transformers keeps the compressed entries unquantised: our "model" entries format
    c_model = dataclasses.replace(R.v4_config(cfg), kv_entries="model")
    ours = R.reference_logits(sd, c_model, ids)
    # measured 8.6e-7 (fp32, different op order). 16 indexer heads: an entry scores exactly 0 only if
    # all 16 ReLU'd dots are <= 0, and among such ties torch.topk's pick is arbitrary (ours: lowest
    # index); with 4 heads ties were common and the two picks differed (0.25 at one position).
    assert (ours - ref).abs().max().item() < 1e-5
    # the default (stock's fp8 entries) attends over quantised entries: close to, not equal to, them
    c = R.v4_config(cfg)
    assert c.kv_entries == "fp8"
    ours8 = R.reference_logits(sd, c, ids)
    d8 = (ours8 - ref).abs().max().item()
    print(f"\nfp8 entries vs transformers (unquantised): max |dlogit| {d8:.3g}")
    assert 0 < d8 < 1.0

    # original names are what transformers loads: HF -> original -> HF is exact
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    cfg.save_pretrained(tmp_path)
    back = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k

    # token-by-token decode over a growing payload history == the full-sequence forward, bitwise (both
    # entries formats)
    import kernels

    seq = ids[1, :40]
    for cc, full in ((c, ours8), (c_model, ours)):
        caches = [torch.empty(0, cc.payload_width(i)) for i in range(cc.num_layers)]
        rows = []
        for t in range(len(seq)):
            one, pos = seq[t : t + 1], torch.tensor([t])
            st = R.embed(cc, sd["embed.weight"], one)
            for i in range(cc.num_layers):
                w = lambda n, i=i: sd[f"layers.{i}." + n]

                def attend(state, i=i, w=w, cc=cc):
                    caches[i] = torch.cat([caches[i], state["payload"]])
                    return R.attend_sequence(cc, w, i, state, pos, caches[i])

                st = R.layer_forward(cc, w, i, st, one, pos, attend)
            rows.append(kernels.lm_head_logits(R.final_hidden(cc, sd.__getitem__, st), sd["head.weight"],
                                               out_dtype=torch.float32))
        assert torch.equal(torch.cat(rows), R.reference_logits(sd, cc, seq[None])[0]), cc.kv_entries
        # ... and batch composition does not matter
        assert torch.equal(R.reference_logits(sd, cc, ids[1:2])[0], full[1]), cc.kv_entries


def test_selection_ignores_entries_not_ready():
    import kernels

    scores = torch.tensor([[3.0, 1.0, 2.0, 9.0, 9.0]])
    keep = kernels.select_entries(scores, torch.tensor([3]), topk=2)
    assert keep.tolist() == [[True, False, True, False, False]]
    # the same query with fewer entries in its history picks the same ones
    assert torch.equal(kernels.select_entries(scores[:, :3], torch.tensor([3]), topk=2), keep[:, :3])


@pytest.fixture(scope="module")
def check_dir(tmp_path_factory) -> Path:
    """One run directory (one warm start) for both rz check runs below."""
    return tmp_path_factory.mktemp("dsv4_check")


def _rz_check(run_dir: Path, *extra: str, prompts: int = 4):
    import json

    cmd = [sys.executable, "-m", "megatron_rz.cli", "check", str(ROOT / "recipes" / "tiny_dsv4.yaml"),
           f"logging.run_dir={run_dir}", "warm_start.steps=5", "rollout.max_new_tokens=6", "logging.progress=false",
           *SMALL, "--prompts", str(prompts), "--samples", "2", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env={**os.environ, "WANDB_MODE": "offline"})
    report = json.loads((run_dir / "check.json").read_text()) if (run_dir / "check.json").exists() else None
    return out, report


def test_rz_check_aligned_dsv4_is_bitwise(check_dir):
    """Real vLLM (our aligned class) vs the real Megatron learner on the tiny recipe shrunk to SMALL:
    prompts carry 32 solved examples (~300 tokens), past the window and the x128 compression."""
    out, report = _rz_check(check_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert report["all_bitwise_equal"] is True
    for name, s in report["scenarios"].items():
        assert s["tokens"] > 0 and s["frac_bitwise"] == 1.0, name


def test_rz_check_dsv4_localises_a_vllm_fault_against_the_learner(check_dir):
    """V4's learner is its own module (no Megatron GPTModel to hook): the localiser records both
    sides' taps (the same kernels.models.dsv4 layer code) and names where vLLM first leaves the
    learner. Fault: layer 1's FFN norm weight scaled in vLLM only, so every tap before layer1.mlp_norm
    must be equal and that one must differ."""
    out, report = _rz_check(check_dir, "--inject-fault", "vllm:layers.1.ffn_norm.weight", prompts=2)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-5000:]
    loc = report["localisation"]
    assert loc["against"] == "learner", loc
    assert loc["vllm"]["first_diverging_tap"] == "layer1.mlp_norm", loc
    # layer 0 (compressed sparse): attn_norm, attn_rope, attn_q_a, attn_q_res, attn_q_b, attn_q, attn_kv,
    # attn_idx_q, attn_idx_w, attention, attn_out, mlp_norm, mlp, output; layer 1 (heavily compressed,
    # no indexer): attn_norm, attn_rope, attn_q_a, attn_q_res, attn_q_b, attn_q, attn_kv, attention, attn_out
    assert loc["vllm"]["taps_equal_before"] == 23 and loc["vllm"]["max_abs_diff"] > 0, loc
    assert "vLLM leaves the learner first at layer1.mlp_norm" in out.stdout


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    from megatron_rz.recipe import load_recipe
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    d = tmp_path_factory.mktemp("dsv4_small")
    make_random_checkpoint(load_recipe(str(ROOT / "recipes" / "tiny_dsv4.yaml"), SMALL), d, seed=0)
    return d


def test_learner_round_trip_and_matches_transformers(small_ckpt, tmp_path):
    """HF checkpoint -> Megatron learner -> exported weights is exact, and the learner's forward on
    those weights matches transformers' fp32 DeepseekV4ForCausalLM (150 tokens: every layer kind)."""
    from transformers import DeepseekV4ForCausalLM

    from megatron_rz.learner.learner import Learner
    from megatron_rz.recipe import load_recipe

    r = load_recipe(str(ROOT / "recipes" / "tiny_dsv4.yaml"), SMALL)
    learner = Learner(r.model, r.parallel, r.algo, hf_dir=str(small_ckpt), train=False, mode="aligned")
    sd = R.load_state_dict(str(small_ckpt))
    out = {k: v.clone() for k, v in learner.export_hf_weights()}
    assert sorted(out) == sorted(sd)
    assert all(out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k]) for k in sd)

    hf = DeepseekV4ForCausalLM.from_pretrained(str(small_ckpt), dtype=torch.float32).eval()
    ids = torch.randint(2, 96, (2, 150), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    # the checkpoint's default entries are stock's fp8 ones; transformers keeps them unquantised, which
    # a checkpoint declares with rz_kv_entries=model (a copy of small_ckpt that does)
    got8 = learner.logprobs(ids)[:, 1:]
    plain = tmp_path / "model_entries"
    shutil.copytree(small_ckpt, plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**cfg, R.KV_ENTRIES_KEY: "model"}))
    learner = Learner(r.model, r.parallel, r.algo, hf_dir=str(plain), train=False, mode="aligned")
    got = learner.logprobs(ids)[:, 1:]
    assert (got - ref).abs().max().item() < 1e-4
    d8 = (got8 - ref).abs().max().item()
    print(f"\nlearner, fp8 entries vs transformers: max |dlogp| {d8:.3g}")
    assert 1e-4 < d8 < 1.0


def test_learner_ep2_equals_ep1(small_ckpt, tmp_path):
    """Megatron learner, expert parallel over 2 ranks (each holds 4 of the 8 experts; dp=2) vs one
    rank: log-probs torch.equal before training; after 2 optimizer steps the weights agree to
    rounding (the two ranks' gradients are summed by DDP in another order)."""
    from megatron_rz.learner.parallel_check import run_check
    from kernels.models.dsv4 import reference_logprobs

    sets = [s for s in SMALL if not s.startswith("mode=")]
    recipe = str(ROOT / "recipes" / "tiny_dsv4.yaml")
    out = tmp_path / "ep2.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megatron_rz.learner.parallel_check",
           "--hf-dir", str(small_ckpt), "--ep", "2", "--out", str(out), "--mode", "aligned", "--recipe", recipe]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ep2 = torch.load(out, weights_only=False)
    ep1 = run_check(str(small_ckpt), 1, 1, sets, world_size=1, steps=2, mode="aligned", recipe_path=recipe)
    from megatron_rz.learner.parallel_check import fixed_batch

    ids, _, _ = fixed_batch(96)
    assert torch.equal(ep1["logprobs_before"], reference_logprobs(str(small_ckpt), str(small_ckpt), ids))
    assert torch.equal(ep2["logprobs_before"], ep1["logprobs_before"])
    assert sorted(ep2["weights"]) == sorted(ep1["weights"])  # every expert exported, by global id
    wd = max((ep2["weights"][k].float() - ep1["weights"][k].float()).abs().max().item() for k in ep1["weights"])
    assert 0 < max(m["grad_norm"] for m in ep1["metrics"]) and wd < 1e-4, wd


def test_train_end_to_end_stays_bitwise(tmp_path):
    """`rz train` on the shrunk tiny DSV4 recipe: real vLLM rollouts (aligned class), Megatron
    learner updates, weight sync each step, and the rollout logprobs equal the learner's bitwise on
    every step. The updates need a non-zero advantage: overlong shaping over the whole response
    (algo.overlong_buffer=7 of 8 new tokens: every response length its own reward) turns length
    differences inside a group into reward differences, and after a 40-step warm start the model
    ends its answers at varying lengths (measured: mean response length 2.5-3.6 tokens, grad norm
    0.88-1.10 on every update), so 64 samples per step make a non-zero update all but certain
    without the 400-step warm start that solving sums took (~100 s of the test)."""
    import json

    cmd = [sys.executable, "-m", "megatron_rz.cli", "train", str(ROOT / "recipes" / "tiny_dsv4.yaml"), *SMALL,
           f"logging.run_dir={tmp_path}", "logging.progress=false", "schedule.steps=3", "task.kwargs.few_shot=0",
           "warm_start.steps=40", "warm_start.batch_size=64", "rollout.prompts_per_step=16",
           "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "algo.overlong_buffer=7"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200,
                         env={**os.environ, "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "frac_bitwise" in r]
    assert len(train) == 3
    assert all(r["frac_bitwise"] == 1.0 and r["max_abs_dlogp"] == 0.0 for r in train)
    # an update happened before the last rollout (so the bitwise match covers synced weights)
    assert max(r["grad_norm"] for r in train[:-1]) > 0
