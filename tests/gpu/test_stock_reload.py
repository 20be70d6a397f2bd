"""Does stock CUDA vLLM 0.26's in-place reload really update the routed experts? (Fast mode's
weight sync relies on it.)

On the H200 (2026-12-01, recipes/gpu_moe.yaml mode=fast) every in-place reload of the stock
Qwen3-MoE class logged vLLM's "Following weights were not loaded from checkpoint:
{...experts.routed_experts.w13_weight, ...w2_weight}" for every layer, although the update carried
all expert tensors. The warning compares ``named_parameters()`` with the names ``load_weights``
returns, so it may be a naming artefact of the layerwise reload - or the stock engine may keep
rolling out with its first experts, which would inflate fast mode's mismatch. Settled here by
behaviour: the stock engine's scores after an in-place update in which only the experts change must differ from
before and match (to bf16 tolerance: stock kernels are not batch invariant, but each pass scores
the same batch) a fresh stock engine loaded from the updated checkpoint.

Reading vLLM 0.26 points to the naming artefact: ``MoERunner.load_weights`` returns the names its
``RoutedExperts.load_weights`` yields (``w13_weight``, relative to the RoutedExperts module), so
the loader records ``...mlp.experts.w13_weight`` while the parameter is
``...mlp.experts.routed_experts.w13_weight``.

Measured on the H200 (2026-12-02, moe1b, 8 x 48-token sequences): the scores moved by up to 1.49
after the expert-only update (had the experts been skipped they would not have moved at all), and
differ from the fresh engine's by up to 0.137, i.e. 9% of the move: stock bf16 kernels' noise
between two engines (not batch invariant, other CUDA graphs), well below what a skipped update
gives (the whole move). The first version of this test asked for < 0.1 absolute and failed on
that noise; the bound is now relative to the move. So the warning is a naming artefact and fast
mode's weight sync does update the routed experts.
"""

import os
import shutil

import pytest
import torch

from gpu_util import moe1b_checkpoint

pytestmark = pytest.mark.gpu
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the engine processes must not fork a CUDA parent


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return moe1b_checkpoint(tmp_path_factory)


def _scores(eng, seqs):
    return torch.tensor([[v for v in row[1:]] for row in eng.score(seqs)], dtype=torch.float64)


def test_stock_in_place_reload_updates_routed_experts(moe_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    from vllm_bridge.engine import RolloutEngine

    sd = {}
    for f in sorted(os.listdir(moe_ckpt)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(moe_ckpt, f)))
    experts = [k for k in sd if ".mlp.experts." in k]
    assert experts, "the checkpoint has no routed experts"
    # A full update (as a weight sync sends it: vLLM's layerwise reload rebuilds a layer from the
    # tensors of one reload) in which only the routed experts change.
    new = {k: (v * -1.5 if k in experts else v) for k, v in sd.items()}
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 32000, (48,), generator=g).tolist() for _ in range(8)]
    kw = dict(aligned=False, dtype="bfloat16", kv_cache_gb=4, max_model_len=256, skip_tokenizer_init=True,
              gpu_memory_utilization=0.4)
    with RolloutEngine(moe_ckpt, **kw) as eng:
        before = _scores(eng, seqs)
        eng.update_weights(new.items(), 1)
        after = _scores(eng, seqs)
    fresh_dir = tmp_path / "updated"
    shutil.copytree(moe_ckpt, fresh_dir)
    for f in [*fresh_dir.glob("*.safetensors"), *fresh_dir.glob("*.safetensors.index.json")]:
        f.unlink()  # one file with every tensor; the index would name the removed shards
    save_file(new, str(fresh_dir / "model.safetensors"))
    with RolloutEngine(str(fresh_dir), **kw) as eng:
        fresh = _scores(eng, seqs)
    moved = (after - before).abs().max().item()
    off = (after - fresh).abs().max().item()
    assert moved > 0.5, f"the stock engine's scores did not follow the expert update (max change {moved})"
    # skipped experts: off == moved; updated: off is the stock engines' bf16 noise (measured 0.137 / 1.49)
    assert off < 0.25 * moved, f"in-place reload != fresh load of the same weights (max |diff| {off}, moved {moved})"
