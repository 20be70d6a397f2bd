"""`rz check`: does the learner compute the logprob vLLM reported, for every sampled token?

vLLM generates under several batchings (many concurrent sequences of mixed lengths, then each
prompt alone); the learner recomputes every sampled token's logprob on the same weights, with
several micro-batch sizes. In `aligned` mode the claim is bitwise equality everywhere; in `fast`
mode the report shows what the mismatch is. When tokens differ (aligned mode), megatron_rz.localise
replays one mismatching sequence through vLLM alone, the learner and the kernels-only reference
forward with activation taps, and names the first layer and op where each side leaves the
reference.

`inject_fault` ("vllm:NAME" or "learner:NAME") scales one parameter on one side by 1 + 2**-8
before the check: the localiser's self-test (the report must then name that parameter's op).
"""

from __future__ import annotations

import json
import random

import torch
import torch.distributed as dist

from megatron_rz.diagnostics import mismatch_stats
from megatron_rz.recipe import Recipe
from megatron_rz.trainer import RolloutSide, _broadcast, _rank, build_batch, prepare_base_model


def _scenarios(side: RolloutSide, recipe: Recipe, num_prompts: int, samples: int) -> dict[str, list]:
    rng = random.Random(recipe.schedule.seed + 7)
    problems = side.task.sample(rng, num_prompts)
    # Mixed lengths: drop a random number of leading prompt characters from some prompts.
    ids = side.encode(problems)
    ids = [p[rng.randint(0, max(0, len(p) - 2)) :] if i % 3 == 1 else p for i, p in enumerate(ids)]
    r = recipe.rollout
    kw = dict(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    out = {f"{num_prompts} concurrent x {samples}": side.engine.generate(ids, n=samples, seed=11, **kw)}
    alone = []
    for i, p in enumerate(ids):
        for s in side.engine.generate([p], n=1, seed=1000 + i, **kw):
            s.group = i
            alone.append(s)
    out["one sequence at a time"] = alone
    return out


FAULT_FACTOR = 1.0 + 2.0**-8


def _inject(fault: str, learner, side) -> None:
    where, _, name = fault.partition(":")
    if where == "vllm":
        if side is not None:
            side.engine.perturb_parameter(name, FAULT_FACTOR)
    elif where == "learner":
        params = dict(learner.model.named_parameters())
        if name not in params:
            raise ValueError(f"--inject-fault: no learner parameter {name!r}; e.g. {next(iter(params))}")
        with torch.no_grad():
            params[name].mul_(FAULT_FACTOR)
    else:
        raise ValueError(f"--inject-fault must be vllm:PARAM or learner:PARAM, not {fault!r}")


def run_check(recipe: Recipe, num_prompts: int = 16, samples: int = 4, inject_fault: str | None = None) -> dict:
    from megatron_rz.learner import Learner
    from megatron_rz.model import init_parallel

    init_parallel(recipe.parallel, seed=recipe.schedule.seed)
    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    base = prepare_base_model(recipe, run_dir)
    learner = Learner(recipe.model, recipe.parallel, recipe.algo, hf_dir=str(base), seed=recipe.schedule.seed,
                      mode=recipe.mode, train=False)
    # model.fp8: the engine learns it from its checkpoint's config.json (key rz_fp8); the base model
    # may have been made without it, so the engine gets a view of it that declares it.
    rollout_dir = base
    if _rank() == 0 and recipe.model.fp8 != "none":
        from vllm_bridge.engine import fp8_checkpoint

        rollout_dir = fp8_checkpoint(base, recipe.model.fp8, run_dir / f"base_model_fp8_{recipe.model.fp8}")
    side = RolloutSide(recipe, rollout_dir) if _rank() == 0 else None
    if inject_fault:
        _inject(inject_fault, learner, side)
    scenarios = _broadcast(_scenarios(side, recipe, num_prompts, samples) if side else None)
    T = recipe.rollout.temperature
    report: dict = {"mode": recipe.mode, "arch": recipe.model.arch, "dtype": recipe.model.dtype, "fp8": recipe.model.fp8,
                    "layout": recipe.parallel.model_dump(), "scenarios": {}}
    all_equal = True
    first_bad_prompt = None  # a prompt whose sample mismatched: the localiser replays it
    for name, samples_ in scenarios.items():
        batch = build_batch(samples_, pad_id=0)
        B, S = batch.input_ids.shape
        variants = {f"micro-batch {m}": (m, 0) for m in sorted({B, 5, 1})}
        variants["micro-batch 5, 7 extra pad columns"] = (5, 7)  # another padded length
        for label, (mbs, extra) in variants.items():
            ids = torch.nn.functional.pad(batch.input_ids, (0, extra), value=0)
            logp = learner.logprobs(ids, temperature=T, micro_batch_size=mbs)[:, :S]
            stats = mismatch_stats(logp, batch.old_logprobs, batch.loss_mask)
            report["scenarios"][f"{name}; learner {label}"] = stats
            all_equal &= stats["frac_bitwise"] == 1.0
            if first_bad_prompt is None and stats["frac_bitwise"] < 1.0:
                m = batch.loss_mask.bool()
                bad_rows = ((logp != batch.old_logprobs) & m).any(dim=1).nonzero()
                first_bad_prompt = list(samples_[int(bad_rows[0])].prompt_ids)
    report["all_bitwise_equal"] = all_equal
    if not all_equal and recipe.mode == "aligned":
        from megatron_rz.localise import localise

        report["localisation"] = localise(learner, side, rollout_dir, recipe, first_bad_prompt)
    if side:
        side.engine.close()
    return report


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    fp8 = f" fp8={report['fp8']}" if report.get("fp8", "none") != "none" else ""
    t = Table(title=f"rz check: {report['arch']} {report['dtype']}{fp8} mode={report['mode']} layout={report['layout']}")
    for col in ("scenario", "tokens", "bitwise equal", "max |dlogp|", "D3", "KL k1"):
        t.add_column(col, justify="right" if col != "scenario" else "left")
    for name, s in report["scenarios"].items():
        t.add_row(name, str(s["tokens"]), f"{100 * s['frac_bitwise']:.2f}%", f"{s['max_abs_dlogp']:.3g}",
                  f"{s['d3']:.3g}", f"{s['kl_k1']:.3g}")
    c = Console()
    c.print(t)
    if report.get("localisation"):
        loc = report["localisation"]
        c.print(f"[bold]localisation[/bold]: {loc['summary']}")
        for who in ("vllm", "learner"):
            c.print(f"  {who}: {json.dumps(loc[who])}")
    verdict = "ALL sampled-token logprobs bitwise equal" if report["all_bitwise_equal"] else "logprobs differ"
    c.print(f"[bold]{verdict}[/bold]")


def main_check(recipe: Recipe, num_prompts: int, samples: int, inject_fault: str | None = None) -> int:
    report = run_check(recipe, num_prompts, samples, inject_fault)
    if _rank() == 0:
        print_report(report)
        (recipe.run_dir / "check.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({"all_bitwise_equal": report["all_bitwise_equal"], "mode": report["mode"]}))
    if dist.is_initialized():
        dist.barrier()
    return 1 if recipe.mode == "aligned" and not report["all_bitwise_equal"] else 0
