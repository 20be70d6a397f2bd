"""Run the learner on a fixed batch under one parallel layout and save what it computed.

    python -m torch.distributed.run --nproc-per-node 2 -m megatron_rz.learner.parallel_check \\
        --hf-dir D --tp 2 --ep 1 --out F.pt [--mode aligned] [--set model.arch=deepseek_v3 ...]

Builds the learner (dp = world size / tp), computes log-probs of a fixed batch, runs two
optimizer steps with a fixed REINFORCE-style loss (two micro batches each), then computes the
log-probs again and exports the Hugging Face weights. Rank 0 saves
{"logprobs_before", "logprobs_after", "metrics", "weights", "layout"} to --out. Comparing the
files of two layouts (e.g. TP=2 against TP=1) checks that parallelism does not change the result.
`run_check` is the same thing as a function (world size 1 runs in-process). `--mode aligned` uses the
aligned learner (megatron_rz.learner.aligned_spec), whose log-probs must then be torch.equal across layouts.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron_rz.recipe import load_recipe


def fixed_batch(vocab_size: int, batch: int = 6, seq: int = 11, seed: int = 1234):
    """Token ids (no pad/eos ids 0-1), right-padded rows, a response mask and advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab_size, (batch, seq), generator=g)
    lengths = torch.tensor([seq - (i % 3) for i in range(batch)])
    mask = torch.zeros(batch, seq)
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 1  # right padding with the pad id
        mask[i, 3:n] = 1.0  # "response" tokens after a 3-token prompt
    adv = torch.linspace(-1.0, 1.0, batch)
    return ids, mask, adv


def reinforce_loss(logp: torch.Tensor, rows: dict):
    """Sum over rows of -advantage * sum_t logp * mask (a fixed policy-gradient surrogate)."""
    tok = (logp * rows["loss_mask"]).sum(dim=1)
    loss_sum = -(rows["advantages"] * tok).sum()
    return loss_sum, {"logp_sum": tok.detach().sum(), "tokens": rows["loss_mask"].sum()}


def run_check(hf_dir: str, tp: int, ep: int, overrides: list[str] = (), world_size: int = 1, steps: int = 2,
              mode: str = "fast", recipe_path: str | None = None, save_after: int | None = None,
              save_dir: str | None = None, load_dir: str | None = None) -> dict:
    """``save_after=k, save_dir=D``: write a learner checkpoint to D after step k; ``load_dir=D``:
    start from such a checkpoint (then ``steps`` more steps)."""
    from megatron_rz.learner.learner import Learner

    dp = world_size // tp
    recipe = load_recipe(recipe_path, list(overrides) + [f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.dp={dp}"])
    # the local layers unless runtime.te is set (--set runtime.te=on: the same check on TE layers)
    te = recipe.runtime.te if "te" in recipe.runtime.model_fields_set else "off"
    learner = Learner(recipe.model, recipe.parallel, recipe.algo, hf_dir, seed=0, mode=mode, te=te)
    if load_dir:
        learner.load_checkpoint(load_dir)
    ids, mask, adv = fixed_batch(recipe.model.vocab_size)
    before = learner.logprobs(ids)
    metrics = []
    for i in range(steps):
        metrics.append(learner.train_step(ids, reinforce_loss, micro_batch_size=2, loss_mask=mask, advantages=adv))
        if save_after == i + 1:
            learner.save_checkpoint(save_dir)
    after = learner.logprobs(ids)
    # the weights as the trainer streams them to the rollout (Learner.export_hf_weights, a collective
    # every rank walks to the end), kept on rank 0 only
    weights = {k: v.detach().clone() for k, v in learner.export_hf_weights()}
    if dist.get_rank() != 0:
        weights = {}
    return {
        "logprobs_before": before,
        "logprobs_after": after,
        "metrics": metrics,
        "weights": weights,
        "layout": {"tp": tp, "ep": ep, "dp": dp, "mode": mode, "learner_spec": learner.spec},
        "optimizers": [type(o).__name__ for o in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="recipe override key.path=value (repeatable)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mode", choices=["fast", "aligned"], default="fast")
    ap.add_argument("--recipe", default=None, help="recipe YAML (default: the embedded default recipe)")
    ap.add_argument("--save-after", type=int, default=None, help="write a checkpoint to --save-dir after this step")
    ap.add_argument("--save-dir", default=None)
    ap.add_argument("--load", default=None, help="start from this learner checkpoint")
    args = ap.parse_args(argv)
    import os

    world = int(os.environ.get("WORLD_SIZE", 1))
    result = run_check(args.hf_dir, args.tp, args.ep, args.set, world, args.steps, args.mode, args.recipe,
                       save_after=args.save_after, save_dir=args.save_dir, load_dir=args.load)
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
