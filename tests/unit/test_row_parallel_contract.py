"""The row-parallel contract (docs/tp.md): every row-parallel projection reduces K in
``kernels.ROW_PARALLEL_K_SEGMENTS`` = 8 fixed segments, fp32 partials added in segment order, so a
TP=t rank holding segments r*8/t .. computes exactly the TP=1 bits for t = 1, 2, 4, 8; and every
recipe's row-parallel K is a multiple of 8 (checked here without building a model).

Run: .venv/bin/python -m pytest tests/unit/test_row_parallel_contract.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
from megatron_rz.learner.aligned_spec import check_aligned_supported, row_parallel_ks
from megatron_rz.recipe import load_recipe

SEG = kernels.ROW_PARALLEL_K_SEGMENTS
RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_contract_is_eight_fixed_segments():
    assert SEG == 8
    from megatron_rz.learner import aligned_spec

    assert aligned_spec.ROW_PARALLEL_K_SEGMENTS == SEG


def _tp_rank_partials(x, W, tp: int, rank: int) -> list[torch.Tensor]:
    """What rank ``rank`` of a TP=tp row-parallel layer computes: its K/tp columns, one fp32
    partial per contract segment it holds (SEG/tp of them)."""
    K = x.shape[-1]
    shard = K // tp
    xs, ws = x[..., rank * shard:(rank + 1) * shard], W[:, rank * shard:(rank + 1) * shard]
    width = K // SEG
    return [kernels.linear_partial(xs[..., j * width:(j + 1) * width], ws[:, j * width:(j + 1) * width])
            for j in range(SEG // tp)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [64, 256, 8 * 37])
def test_every_single_node_tp_is_bitwise_tp1(dtype, K):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(9, K, generator=g).to(dtype)
    W = torch.randn(24, K, generator=g).to(dtype)
    one_rank = kernels.linear(x, W, k_segments=SEG)
    for tp in (1, 2, 4, 8):
        gathered = [p for r in range(tp) for p in _tp_rank_partials(x, W, tp, r)]  # rank order
        assert len(gathered) == SEG
        got = kernels.finish_linear(kernels.sum_partials(gathered), None, dtype)
        assert torch.equal(got, one_rank), tp


def test_tp_dependent_segmentation_would_differ():
    """Why the segmentation is fixed: k_segments = tp (the old per-TP choice) changes the bits."""
    g = torch.Generator().manual_seed(1)
    x, W = torch.randn(16, 256, generator=g), torch.randn(64, 256, generator=g)
    outs = [kernels.linear(x, W, k_segments=s) for s in (1, 2, 4, 8)]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_row_parallel_k_divisible(path):
    r = load_recipe(str(path), [])
    ks = row_parallel_ks(r.model)
    assert ks and all(K % SEG == 0 for K in ks.values()), ks
    if r.mode == "aligned":
        if r.model.arch != "deepseek_v4":  # the V4 learner has its own check (tp=1)
            check_aligned_supported(r.model, r.parallel)
        assert SEG % r.parallel.tp == 0
        if r.model.arch == "qwen3_moe":  # the TP-sharded aligned vLLM class
            assert SEG % r.rollout.tensor_parallel_size == 0


def test_bad_k_error_names_key_and_fix():
    r = load_recipe(str(RECIPES[0].parent / "tiny_moe.yaml"), ["model.moe_ffn_hidden_size=100"])
    with pytest.raises(ValueError) as e:
        check_aligned_supported(r.model, r.parallel)
    msg = str(e.value)
    assert "\n" not in msg and "model.moe_ffn_hidden_size = 100" in msg and f"a multiple of {SEG}" in msg
    r = load_recipe(str(RECIPES[0].parent / "tiny_moe.yaml"), [])
    with pytest.raises(NotImplementedError, match=r"parallel.tp=3 .* one of \[1, 2, 4, 8\]"):
        check_aligned_supported(r.model, r.parallel.model_copy(update={"tp": 3}))
