"""benchmarks/rollout_gpu.py's DeepSeek-V4 checkpoints (``dsv4_2l`` / ``dsv4_4l``), at tiny dims.

The GPU benchmark times stock vLLM 0.26's DeepseekV4ForCausalLM, which on CUDA needs DeepSeek's
block-FP8 form (e4m3 ``X.weight`` + ``X.scale``, ``quantization_config``), beside the aligned engine,
which reads the same checkpoint by dequantising it (docs/gpu.md "Stock DeepSeek-V4"). Here, the same
generator (the configs' own fields, dims shrunk) on the CPU:

* the FP8 form holds exactly the aligned reference's tensor names with the FP8 linears in e4m3 plus
  one fp32 scale per 128 x 128 block, and declares the quantisation the way stock reads it;
* the power-of-two block quantiser is within e4m3's rounding of the weight and its dequantised
  values are exact in bf16; the bf16 form is the FP8 form dequantised, bitwise;
* the FP8 form loads into the aligned reference (kernels.models.dsv4.load_state_dict) with no
  missing or unexpected tensor and gives the bf16 form's log-probs, bitwise.
"""

from __future__ import annotations

import json

import pytest
import torch

import benchmarks.rollout_gpu as rg
from helpers import DSV4_TINY
from kernels.models import dsv4 as R

TINY = DSV4_TINY


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv4_tiny")
    fp8 = rg.make_ckpt("dsv4_4l", str(d / "fp8"), seed=3, overrides=TINY, device="cpu")
    bf16 = rg.make_ckpt("dsv4_4l", str(d / "bf16"), seed=3, overrides=TINY, device="cpu", form="bf16")
    return {"fp8": d / "fp8", "bf16": d / "bf16", "cfg8": fp8, "cfg16": bf16}


def _tensors(d) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_configs_carry_v4_flash_shapes():
    for name, layers in (("dsv4_2l", 2), ("dsv4_4l", 4)):
        c = {**rg.COMMON, **rg.CONFIGS[name]}
        cv = R.v4_config(c)
        assert (cv.hidden_size, cv.num_heads, cv.head_dim, cv.rope_dim, cv.q_lora_rank) == (4096, 64, 512, 64, 1024)
        assert (cv.o_groups, cv.o_lora_rank, cv.index_n_heads, cv.index_head_dim, cv.index_topk) == (8, 1024, 64, 128, 512)
        assert (cv.num_experts, cv.top_k, cv.moe_intermediate_size, cv.n_shared_experts) == (256, 6, 2048, 1)
        assert (cv.vocab_size, cv.sliding_window, cv.hc_mult, cv.num_layers) == (129280, 128, 4, layers)
        assert set(cv.compress_ratios) == {4, 128}  # both compressed kinds, as the real model's 20 x4 + 23 x128
        assert not R.fp8_problems(cv)  # its shapes also run the aligned class's own blockwise FP8


def test_fp8_form_layout(ckpts):
    d = ckpts["fp8"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["model_type"] == "deepseek_v4"
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    assert cfg["expert_dtype"] == "fp8" and cfg["topk_method"] == "noaux_tc" and cfg["hidden_act"] == "silu"
    c = R.v4_config(str(d))
    want = {}
    kinds = {"model": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}
    n_fp8 = 0
    for name, (shape, kind) in R.parameter_shapes(c).items():
        rel = name.split(".", 2)[2] if name.startswith("layers.") else name
        if kind == "model" and R.FP8_LINEARS.match(rel):
            n_fp8 += 1
            want[name] = (tuple(shape), torch.float8_e4m3fn)
            want[name[: -len(".weight")] + ".scale"] = ((-(-shape[0] // 128), -(-shape[1] // 128)), torch.float32)
        else:
            want[name] = (tuple(shape), kinds[kind])
    sd = _tensors(d)
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == want
    # per layer: wq_a wq_b wkv wo_a wo_b, 8 routed + 1 shared expert x 3, and the indexer's wq_b in x4 layers
    assert n_fp8 == 4 * (5 + 9 * 3) + 2
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    # every scale a power of two
    for k, v in sd.items():
        if k.endswith(".scale"):
            m, _ = torch.frexp(v)
            assert bool((m == 0.5).all()), k
    # the hash table: top_k distinct experts per token id; routers' biases zero
    t = sd["layers.0.ffn.gate.tid2eid"]
    assert t.shape == (96, 2) and all(len(set(r)) == 2 for r in t.tolist()) and 0 <= t.min() and t.max() < 8
    assert "layers.0.ffn.gate.bias" not in sd and torch.equal(sd["layers.1.ffn.gate.bias"], torch.zeros(8))


def test_pow2_quantiser_error_and_exact_bf16():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 0.02
    w[:128, :128] *= 1e-3  # a block of tiny values (e4m3 subnormals)
    w[128:256, 128:] *= 50.0  # and a large one
    w[256:, :128] = 0.0  # an all-zero (partial) block
    w = w.to(torch.bfloat16)
    q, s = rg.quantize_pow2_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (3, 2)
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    amax = (w.float().abs() / full)
    assert float(amax.max()) <= 448.0
    deq = R.dequantize_block_fp8(q, s)
    assert torch.equal(deq, q.float() * full)  # the broadcast and the general form agree
    # e4m3 keeps 3 mantissa bits: half a step is 2**-4 relative for normals (|w / s| >= 2**-6), 2**-10
    # of the scale below that (subnormal step 2**-9)
    err = (deq - w.float()).abs()
    bound = torch.maximum(w.float().abs() * 2.0 ** -4, full * 2.0 ** -10)
    assert bool((err <= bound).all())
    assert torch.equal(deq.to(torch.bfloat16).float(), deq)  # exact in bf16: power-of-two scales
    assert torch.equal(deq[256:, :128], torch.zeros(44, 128))


def test_bf16_form_is_the_fp8_form_dequantised(ckpts):
    deq = R.load_state_dict(str(ckpts["fp8"]))
    plain = _tensors(ckpts["bf16"])
    assert sorted(deq) == sorted(plain) == sorted(R.parameter_shapes(R.v4_config(str(ckpts["bf16"]))))
    for k, v in plain.items():
        assert deq[k].dtype == v.dtype and torch.equal(deq[k], v), k
    assert "quantization_config" not in ckpts["cfg16"] and "expert_dtype" not in ckpts["cfg16"]


def test_dequantized_weights_pairs_any_order_and_refuses_orphans():
    q, s = rg.quantize_pow2_blockwise(torch.randn(130, 64) * 0.02)
    b = torch.ones(3)
    for order in ([("a.weight", q), ("a.scale", s), ("n", b)], [("a.scale", s), ("n", b), ("a.weight", q)]):
        got = dict(R.dequantized_weights(order, dtype=torch.bfloat16))
        assert sorted(got) == ["a.weight", "n"] and got["a.weight"].dtype == torch.bfloat16
        assert torch.equal(got["a.weight"].float(), R.dequantize_block_fp8(q, s)) and got["n"] is b
    with pytest.raises(ValueError, match="without"):
        list(R.dequantized_weights([("a.weight", q)]))
    with pytest.raises(ValueError, match="without"):
        list(R.dequantized_weights([("a.scale", s), ("b.weight", torch.zeros(2, 2))]))
    with pytest.raises(ValueError, match="one per"):
        list(R.dequantized_weights([("a.weight", q), ("a.scale", s[:1])]))


def test_fp8_form_runs_the_aligned_reference(ckpts):
    c = R.v4_config(str(ckpts["fp8"]))
    ids = torch.randint(2, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    f32 = lambda sd: {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}  # noqa: E731
    lp8 = R.reference_logprobs(f32(R.load_state_dict(str(ckpts["fp8"]))), c, ids)
    lp16 = R.reference_logprobs(f32(R.load_state_dict(str(ckpts["bf16"]))), c, ids)
    assert torch.equal(lp8, lp16) and bool(torch.isfinite(lp8).all()) and float(lp8[:, 1:].abs().min()) > 0
