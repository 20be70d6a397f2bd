"""Layout-changing resume through Megatron dist_checkpointing (real megatron-core 0.16.1, CPU, gloo).

A checkpoint written at TP=2/EP=2 (two ranks) resumes at TP=1/EP=1 (one rank) and the reverse:
- the resumed learner's parameters, gathered to Hugging Face tensors, are torch.equal to the saved
  learner's;
- re-saving right after the load gives a checkpoint whose every tensor (model weights, Adam
  exp_avg / exp_avg_sq, fp32 main params of the distributed optimizer), read back whole under its
  global name, is torch.equal to the original checkpoint's, and its common state (Adam step, param
  groups, version, step) is equal: the optimizer state carried over exactly;
- the next update's loss and the logprobs it used are equal (==, torch.equal) to those the saving
  layout computed (the aligned learner's logprobs are layout-invariant bitwise).
Old per-rank checkpoints and an optimizer-kind change are refused with one line.

Run: .venv/bin/python -m pytest tests/integration/test_ckpt_layout.py -q -s
This file is also the two-rank worker (python -m torch.distributed.run ... this file --worker).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/tiny_moe.yaml"


def _recipe(tp: int, ep: int, world: int, distopt: bool):
    from megatron_rz.recipe import load_recipe

    return load_recipe(str(RECIPE), [f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.dp={world // tp}",
                                     f"parallel.distributed_optimizer={str(distopt).lower()}"])


def _learner(hf_dir, tp: int, ep: int, world: int, distopt: bool = False):
    from megatron_rz.learner.learner import Learner

    r = _recipe(tp, ep, world, distopt)
    return Learner(r.model, r.parallel, r.algo, str(hf_dir), seed=0, mode="aligned"), r


def _step(learner, r):
    from megatron_rz.learner.parallel_check import fixed_batch, reinforce_loss

    ids, mask, adv = fixed_batch(r.model.vocab_size)
    out = learner.train_step(ids, reinforce_loss, micro_batch_size=2, loss_mask=mask, advantages=adv)
    return {"loss": out["loss"], "logprobs": out["logprobs"], "grad_norm": out["grad_norm"]}


def _weights(learner) -> dict:
    """Full HF-named tensors on rank 0 ({} elsewhere): every rank walks the bucket stream."""
    from megatron_rz.loop.weights import hf_buckets

    return {k: v.clone() for bucket in hf_buckets(learner, 1 << 16) for k, v in bucket.items()}


def _run(learner, r, load=None, pre: int = 0, save=None, post: int = 1) -> dict:
    """[load] -> pre updates -> [save] -> post updates; what each point saw."""
    out = {"step": learner.load_checkpoint(load) if load else None}
    out["weights_loaded"] = _weights(learner)
    for _ in range(pre):
        _step(learner, r)
    if save:
        learner.save_checkpoint(save, step=learner.version)
        out["weights_saved"] = _weights(learner)
    out["metrics"] = [_step(learner, r) for _ in range(post)]
    return out


def worker(argv=None) -> None:
    """One job (the arguments below), or with --jobs FILE each job in FILE (a JSON list of argument
    lists) in order, in this launch: each builds its own Learner (init_parallel rebuilds Megatron's
    groups when the layout changes), so a job computes what it would in a launch of its own."""
    import json

    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--jobs")
    ap.add_argument("--hf")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--distopt", action="store_true")
    ap.add_argument("--load")
    ap.add_argument("--save")
    ap.add_argument("--pre", type=int, default=0)
    ap.add_argument("--post", type=int, default=1)
    ap.add_argument("--out")
    first = ap.parse_args(argv)
    jobs = [ap.parse_args(j) for j in json.loads(Path(first.jobs).read_text())] if first.jobs else [first]
    for a in jobs:
        learner, r = _learner(a.hf, a.tp, a.ep, int(os.environ["WORLD_SIZE"]), a.distopt)
        out = _run(learner, r, a.load, a.pre, a.save, a.post)
        if dist.get_rank() == 0:
            torch.save(out, a.out)
        del learner, out
        dist.barrier()
    dist.destroy_process_group()


def _launch(tmp_path, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", __file__,
           "--worker", *map(str, args)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _torchrun(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{name}.pt"
    _launch(tmp_path, "--out", out, *args)
    return torch.load(out, weights_only=False)


def _tensors(ckpt_dir, tmp_path) -> dict:
    """Every entry of a dist_checkpointing checkpoint, whole, under its global key (+ common.pt)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    f = tmp_path / f"{Path(ckpt_dir).name}.whole.pt"
    dcp_to_torch_save(str(ckpt_dir), str(f))
    whole = torch.load(f, weights_only=False)
    common = torch.load(Path(ckpt_dir) / "common.pt", weights_only=False)
    return {"tensors": {k: v for k, v in whole.items() if "_extra_state" not in k and "torch_rng_state" not in k},
            "optimizer": common["optimizer"], "rz": common["rz"]}


def _assert_same_checkpoint(a_dir, b_dir, tmp_path) -> int:
    a, b = _tensors(a_dir, tmp_path), _tensors(b_dir, tmp_path)
    assert set(a["tensors"]) == set(b["tensors"])
    bad = [k for k in a["tensors"] if not torch.equal(a["tensors"][k], b["tensors"][k])]
    assert not bad, f"not bitwise equal after the layout change: {bad[:5]}"
    assert sum("exp_avg_sq." in k for k in a["tensors"]) >= 10  # the Adam moments are in it
    assert a["optimizer"] == b["optimizer"]  # Adam step, lr, betas per param group
    assert (a["rz"]["step"], a["rz"]["version"]) == (b["rz"]["step"], b["rz"]["version"])
    assert a["rz"]["layout"] != b["rz"]["layout"]
    return len(a["tensors"])


def _equal_weights(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _same_update(m: dict, ref: dict) -> bool:
    return m["loss"] == ref["loss"] and torch.equal(m["logprobs"], ref["logprobs"])


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from megatron_rz.learner.tiny_models import make_random_checkpoint

    d = tmp_path_factory.mktemp("hf")
    make_random_checkpoint(_recipe(1, 1, 1, False), d, seed=0)
    return d


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, hf) -> dict:
    """The two tests' first two-rank runs (independent: both start from the HF checkpoint), in ONE
    torchrun (the ranks' start-up paid once): TP=2/EP=2 with a plain optimizer and dp=2 x EP=2 with
    the distributed optimizer, each 1 update, checkpoint, 1 more update (the reference). The
    two-rank resumes that follow a one-rank save run in launches of their own, in the tests."""
    import json

    tmp = tmp_path_factory.mktemp("two_ranks")
    jobs = {"tp2ep2": ["--tp", 2, "--ep", 2], "dp2ep2_distopt": ["--tp", 1, "--ep", 2, "--distopt"]}
    argv = [[str(x) for x in ["--hf", hf, *layout, "--pre", 1, "--save", tmp / name, "--post", 1, "--out",
                              tmp / f"{name}.pt"]] for name, layout in jobs.items()]
    (tmp / "jobs.json").write_text(json.dumps(argv))
    _launch(tmp, "--jobs", tmp / "jobs.json")
    return {name: (torch.load(tmp / f"{name}.pt", weights_only=False), tmp / name) for name in jobs}


def test_tp2_ep2_checkpoint_resumes_at_tp1_and_back(tmp_path, hf, two_ranks):
    from megatron_rz.manifest import verify_checkpoint

    t0 = time.time()
    a2, c, c2 = (tmp_path / n for n in ("a_resaved_tp1", "c_tp1", "c_resaved_tp2ep2"))

    # TP=2/EP=2 on two ranks: 1 update, checkpoint A, 1 more update (the reference)
    two, a = two_ranks["tp2ep2"]
    assert verify_checkpoint(a) is None and sorted(p.name for p in a.glob("__*.distcp"))[0].startswith("__0_")
    assert {p.name.split("_")[2] for p in a.glob("__*.distcp")} == {"0", "1"}  # both ranks wrote shards

    # TP=1/EP=1 in this process: load A, gather, re-save (A'), the next update, then checkpoint C
    learner, r = _learner(hf, 1, 1, 1)
    one = _run(learner, r, load=a, save=a2, post=1)
    assert one["step"] == 1 and learner.version == 2
    assert _equal_weights(one["weights_loaded"], two["weights_saved"])
    n = _assert_same_checkpoint(a, a2, tmp_path)
    m, ref = one["metrics"][0], two["metrics"][0]
    assert _same_update(m, ref), (m["loss"], ref["loss"])
    learner.save_checkpoint(c, step=2)
    w_c = _weights(learner)
    ref_c = _step(learner, r)

    # ... and back: TP=2/EP=2 loads C, re-saves it (C'), its next update equals the TP=1 one
    back = _torchrun(tmp_path, "back", "--hf", hf, "--tp", 2, "--ep", 2, "--load", c, "--save", c2, "--post", 1)
    assert back["step"] == 2
    assert _equal_weights(back["weights_loaded"], w_c)
    _assert_same_checkpoint(c, c2, tmp_path)
    assert _same_update(back["metrics"][0], ref_c), (back["metrics"][0]["loss"], ref_c["loss"])
    print(f"\n[ckpt layout] tp2/ep2 -> tp1 -> tp2/ep2: {n} tensors bitwise, next-update loss "
          f"{m['loss']!r} / {ref_c['loss']!r} equal, logprobs torch.equal; {time.time() - t0:.0f} s")


def test_distributed_optimizer_checkpoint_reshards_and_refusals(tmp_path, hf, two_ranks):
    """parallel.distributed_optimizer=true at dp=2 x ep=2 (both parameter families sharded ZeRO-1)
    resumes at one rank with its fp32 main params and moments (every tensor bitwise after a re-save);
    a plain-optimizer learner and an old per-rank checkpoint are refused with one line."""
    t0 = time.time()
    a2 = tmp_path / "d_resaved_tp1"
    two, a = two_ranks["dp2ep2_distopt"]  # dp=2 x EP=2, distributed optimizer: 1 update, checkpoint A, 1 more
    learner, r = _learner(hf, 1, 1, 1, distopt=True)
    one = _run(learner, r, load=a, save=a2, post=1)
    assert _equal_weights(one["weights_loaded"], two["weights_saved"])
    tensors = _tensors(a, tmp_path)["tensors"]
    assert any(k.split(".")[3] == "param" for k in tensors if k.startswith("chained_"))  # fp32 main params
    _assert_same_checkpoint(a, a2, tmp_path)
    m, ref = one["metrics"][0], two["metrics"][0]
    # the logprobs the update used are bitwise those of dp=2; its loss is their sum, added per dp
    # rank then across ranks at dp=2 (another float64 order), so equal to rounding only
    assert torch.equal(m["logprobs"], ref["logprobs"]) and abs(m["loss"] - ref["loss"]) < 1e-6 * abs(ref["loss"])

    plain, _ = _learner(hf, 1, 1, 1, distopt=False)
    with pytest.raises(ValueError, match="parallel.distributed_optimizer=False: set it back"):
        plain.load_checkpoint(a)
    old = tmp_path / "old_step"
    old.mkdir()
    (old / "rank00000.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"old_step is a per-rank torch.save checkpoint .*model.pretrained"):
        plain.load_checkpoint(old)
    print(f"\n[ckpt layout] distributed optimizer dp2/ep2 -> 1 rank bitwise; refusals; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.path.insert(0, str(REPO))
        worker(sys.argv[1:])
