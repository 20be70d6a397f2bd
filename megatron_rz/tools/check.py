"""`rz check`: does the learner compute the logprob vLLM reported, for every sampled token?

vLLM generates under several batchings (many concurrent sequences of mixed lengths, then each
prompt alone); the learner recomputes every sampled token's logprob on the same weights, with
several micro-batch sizes. In `aligned` mode the claim is bitwise equality everywhere; in `fast`
mode the report shows what the mismatch is. When tokens differ (aligned mode), megatron_rz.tools.localise
replays one mismatching sequence through vLLM alone, the learner and the kernels-only reference
forward with activation taps, and names the first layer and op where each side leaves the
reference.

`inject_fault` ("vllm:NAME" or "learner:NAME"; one or a list, e.g. one per side) scales one
parameter on one side by 1 + 2**-8 before the check: the localiser's self-test (the report must
then name that parameter's op, on each side independently).
"vllm:sampling.KEY=VALUE" / "learner:sampling.KEY=VALUE" (KEY temperature, top_k or top_p) makes
that side sample / score with one sampling parameter changed: the report must then name the
sampling stage.

Both sides use the recipe's sampling contract (rollout.temperature, top_k, top_p;
kernels/sampling.py): vLLM reports the processed logprob of the distribution it sampled from and
the learner computes the same one. `run_check(..., sampling_grid=[...])` checks several settings
on one engine and one learner (benchmarks/sampling_grid.py).
"""

from __future__ import annotations

import json
import random

import torch
import torch.distributed as dist

from megatron_rz.rl.diagnostics import mismatch_stats
from megatron_rz.recipe import Recipe
from megatron_rz.learner.ranks import broadcast_object, rank
from megatron_rz.launch.rundir import prepare_base_model
from megatron_rz.loop.trainer import RolloutSide, build_batch


PREFIX_BLOCK = 16  # agentic check: KV block size, so that earlier turns fill blocks the prefix cache reuses


def _episode_scenarios(side: RolloutSide, recipe: Recipe, num_prompts: int, samples: int, sampling: dict) -> dict:
    """Agentic task: the same episodes (same seeds) run all at once and one at a time, prefix cache
    on; each turn's prompt is the conversation so far (megatron_rz.rl.agentic)."""
    from megatron_rz.loop.rollout import BlockingGenerator
    from megatron_rz.rl.agentic import make_generator

    problems = side.task.sample(random.Random(recipe.schedule.seed + 7), num_prompts)
    ids = side.encode(problems)
    kw = dict(max_new_tokens=recipe.rollout.max_new_tokens, **sampling)
    gen = make_generator(BlockingGenerator(side.engine), side, recipe)
    gen.submit(ids, samples, seed=11, problems=problems, tag="batch", **kw)
    batch = sorted((s for g in gen.drain() for s in g.samples), key=lambda s: (s.group, s.index_in_group))
    alone = []
    for i, (p, x) in enumerate(zip(problems, ids)):
        for j in range(samples):  # episode j of prompt i alone, with the seed it had in the batch
            gen.submit([x], 1, seed=11 + i * samples + j, problem=p, tag="alone", **kw)
            (s,) = gen.drain()[0].samples
            s.group, s.index_in_group = i, j
            alone.append(s)
    return {f"{num_prompts} concurrent x {samples} episodes": batch, "one episode at a time": alone}


def _prefix_cache_hits(engine, conversations: list[list[int]]) -> int:
    """Tokens vLLM's prefix cache serves when the finished conversations are asked for again (what
    their turns left in the cache)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=c) for c in conversations],
                               SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return int(sum(o.num_cached_tokens or 0 for o in outs))


def _episode_report(side, samples_: list, batch, temperature: float) -> dict:
    """What the agentic scenarios add: environment tokens (excluded, counted), turns and tool calls,
    and every model token's rollout logprob against vLLM re-scoring the whole conversation in one
    prefill (engine.score, torch.equal)."""
    m = batch.loss_mask.bool()
    rescored = side.engine.score([s.prompt_ids + s.response_ids for s in samples_], temperature=temperature)
    S = batch.input_ids.shape[1]
    one = torch.zeros_like(batch.old_logprobs)
    for i, row in enumerate(rescored):
        one[i, 1 : len(row)] = torch.tensor(row[1:], dtype=torch.float32)[: S - 1]
    return {"model_tokens": int(m.sum()), "env_tokens_excluded": sum(s.info["env_tokens"] for s in samples_),
            "episodes": len(samples_), "turns": sum(s.info["turns"] for s in samples_),
            "tool_calls": sum(s.info["tool_calls"] for s in samples_),
            "tool_faults": sum(s.info["tool_errors"] + s.info["tool_timeouts"] + s.info["tool_truncated"]
                               for s in samples_),
            "malformed_calls": sum(s.info["malformed_calls"] for s in samples_),
            "multi_turn_episodes": sum(s.info["turns"] > 1 for s in samples_),
            "one_prefill_bitwise": bool(torch.equal(one[m], batch.old_logprobs[m])),
            "one_prefill_frac_bitwise": (one[m] == batch.old_logprobs[m]).double().mean().item() if m.any() else 1.0}


def _scenarios(side: RolloutSide, recipe: Recipe, num_prompts: int, samples: int, sampling: dict) -> dict[str, list]:
    from megatron_rz.rl.agentic import environment_of

    if environment_of(side.task) is not None:
        return _episode_scenarios(side, recipe, num_prompts, samples, sampling)
    rng = random.Random(recipe.schedule.seed + 7)
    problems = side.task.sample(rng, num_prompts)
    # Mixed lengths: drop a random number of leading prompt characters from some prompts.
    ids = side.encode(problems)
    ids = [p[rng.randint(0, max(0, len(p) - 2)) :] if i % 3 == 1 else p for i, p in enumerate(ids)]
    kw = dict(max_new_tokens=recipe.rollout.max_new_tokens, **sampling)
    out = {f"{num_prompts} concurrent x {samples}": side.engine.generate(ids, n=samples, seed=11, **kw)}
    alone = []
    for i, p in enumerate(ids):
        for s in side.engine.generate([p], n=1, seed=1000 + i, **kw):
            s.group = i
            alone.append(s)
    out["one sequence at a time"] = alone
    return out


FAULT_FACTOR = 1.0 + 2.0**-8


def _sampling_fault(fault: str | None) -> tuple[dict, dict]:
    """``vllm:sampling.KEY=VALUE`` / ``learner:sampling.KEY=VALUE``: that side samples / scores with
    one sampling parameter changed (the localiser must then name the sampling stage).
    Returns (vLLM overrides, learner overrides)."""
    from megatron_rz.recipe import load_yaml

    if not fault:
        return {}, {}
    where, _, name = fault.partition(":")
    if not name.startswith("sampling."):
        return {}, {}
    key, eq, raw = name.removeprefix("sampling.").partition("=")
    if not eq or key not in ("temperature", "top_k", "top_p"):
        raise ValueError(f"--inject-fault {fault!r}: expected SIDE:sampling.KEY=VALUE with KEY temperature, top_k "
                         "or top_p, e.g. vllm:sampling.top_p=0.8")
    over = {key: load_yaml(raw)}  # a repeated key refused (megatron_rz.recipe.load_yaml)
    if where == "vllm":
        return over, {}
    if where == "learner":
        return {}, over
    raise ValueError(f"--inject-fault must start with vllm: or learner:, not {fault!r}")


def _inject(fault: str, learner, side) -> None:
    where, _, name = fault.partition(":")
    if name.startswith("sampling."):
        return  # a sampling-parameter fault: applied per call (_sampling_fault)
    if where == "vllm":
        if side is not None:
            side.engine.perturb_parameter(name, FAULT_FACTOR)
    elif where == "learner":
        params = dict(learner.model.named_parameters())
        if name not in params and learner.spec == "te":  # a local-spec name: the TE learner's one
            from megatron_rz.learner.te_spec import local_to_te

            name = local_to_te(name, learner.model_cfg)
        if name not in params:
            raise ValueError(f"--inject-fault: no learner parameter {name!r}; e.g. {next(iter(params))}")
        with torch.no_grad():
            params[name].mul_(FAULT_FACTOR)
    else:
        raise ValueError(f"--inject-fault must be vllm:PARAM or learner:PARAM, not {fault!r}")


def _with_sampling(recipe: Recipe, setting: dict | None) -> Recipe:
    if not setting:
        return recipe
    data = recipe.model_dump()
    data["rollout"].update(setting)
    return Recipe.model_validate(data)  # the contract checks apply to every grid point


def run_check(recipe: Recipe, num_prompts: int = 16, samples: int = 4, inject_fault: str | list[str] | None = None,
              sampling_grid: list[dict] | None = None) -> dict:
    """One learner and one engine. ``inject_fault``: one fault or a list (e.g. one per side: each
    side's localisation is independent, both are reported). ``sampling_grid``: rollout sampling settings (e.g.
    ``[{"top_p": 0.9, "temperature": 0.7}, {"top_k": 5}]``) checked one after another on the same
    engine; the report then has one entry per setting under "grid". A setting may carry its own
    ``"inject_fault": "vllm:sampling.top_p=0.8"`` (sampling faults only)."""
    if sampling_grid is not None and any(
            not str(g.get("inject_fault", "x:sampling.")).partition(":")[2].startswith("sampling.")
            for g in sampling_grid):
        raise ValueError("a grid point's inject_fault must be a sampling fault (SIDE:sampling.KEY=VALUE)")
    from megatron_rz.learner.learner import Learner
    from megatron_rz.learner.model import init_parallel

    init_parallel(recipe.parallel, seed=recipe.schedule.seed)
    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    base = prepare_base_model(recipe, run_dir)
    learner = Learner(recipe.model, recipe.parallel, recipe.algo, hf_dir=str(base), seed=recipe.schedule.seed,
                      mode=recipe.mode, train=False, te=recipe.runtime.te)
    # model.fp8: the engine learns it from its checkpoint's config.json (key rz_fp8); the base model
    # may have been made without it, so the engine gets a view of it that declares it.
    rollout_dir = base
    if rank() == 0 and recipe.model.fp8 != "none":
        from vllm_bridge.engine import fp8_checkpoint

        rollout_dir = fp8_checkpoint(base, recipe.model.fp8, run_dir / f"base_model_fp8_{recipe.model.fp8}")
    from megatron_rz.rl.agentic import environment_of
    from megatron_rz.rl.tasks import make_task

    probe = make_task(recipe.task)
    agentic = environment_of(probe) is not None
    for obj in (probe, environment_of(probe)):
        getattr(obj, "close", lambda: None)()
    extra = {"block_size": PREFIX_BLOCK, "enable_prefix_caching": True} if agentic else None
    side = RolloutSide(recipe, rollout_dir, engine_extra=extra) if rank() == 0 else None
    faults = [inject_fault] if isinstance(inject_fault, str) else list(inject_fault or [])
    vllm_fault, learner_fault = {}, {}
    for fault in faults:
        _inject(fault, learner, side)
        v, lf = _sampling_fault(fault)
        vllm_fault.update(v)
        learner_fault.update(lf)
    report: dict = {"mode": recipe.mode, "learner_spec": learner.spec, "arch": recipe.model.arch,
                    "dtype": recipe.model.dtype, "fp8": recipe.model.fp8, "layout": recipe.parallel.model_dump()}
    if sampling_grid is None:
        report.update(_check_setting(recipe, learner, side, rollout_dir, num_prompts, samples, vllm_fault, learner_fault))
    else:
        report["grid"] = []
        for setting in sampling_grid:
            setting = dict(setting)
            fault = setting.pop("inject_fault", None)  # a sampling fault for this grid point only
            vf, lf = _sampling_fault(fault) if fault else (vllm_fault, learner_fault)
            rec = _with_sampling(recipe, setting)
            one = _check_setting(rec, learner, side, rollout_dir, num_prompts, samples, vf, lf)
            report["grid"].append({**one, **({"inject_fault": fault} if fault else {})})
        report["all_bitwise_equal"] = all(g["all_bitwise_equal"] for g in report["grid"])
    if side:
        side.close_task()
        side.engine.close()
    return report


def _check_setting(recipe: Recipe, learner, side, rollout_dir, num_prompts: int, samples: int, vllm_fault: dict,
                   learner_fault: dict) -> dict:
    """Every scenario of one sampling setting: {"sampling", "scenarios", "all_bitwise_equal"[, "localisation"]}."""
    vllm_kw = {**recipe.rollout.sampling_kwargs(), **vllm_fault}
    learner_kw = {**recipe.rollout.sampling_contract(), **learner_fault}
    scenarios = broadcast_object(_scenarios(side, recipe, num_prompts, samples, vllm_kw) if side else None)
    report: dict = {"sampling": recipe.rollout.sampling_contract(), "scenarios": {}}
    if vllm_fault or learner_fault:  # an injected sampling fault: what each side really ran with
        report.update(vllm_sampling=vllm_kw, learner_sampling=learner_kw)
    all_equal = True
    first_bad_prompt = None  # a prompt whose sample mismatched: the localiser replays it
    episodes = {}
    for name, samples_ in scenarios.items():
        batch = build_batch(samples_, pad_id=0)
        if samples_ and "model_mask" in samples_[0].info and side is not None:  # agentic episodes
            episodes[name] = _episode_report(side, samples_, batch, learner_kw.get("temperature", 1.0))
        B, S = batch.input_ids.shape
        variants = {f"micro-batch {m}": (m, 0) for m in sorted({B, 5, 1})}
        variants["micro-batch 5, 7 extra pad columns"] = (5, 7)  # another padded length
        for label, (mbs, extra) in variants.items():
            ids = torch.nn.functional.pad(batch.input_ids, (0, extra), value=0)
            logp = learner.logprobs(ids, micro_batch_size=mbs, **learner_kw)[:, :S]
            stats = mismatch_stats(logp, batch.old_logprobs, batch.loss_mask)
            # a token alone in its kept set has logprob exactly 0 on both sides whatever the numerics:
            # the share of such tokens says how much of "bitwise" is trivially so
            sel = batch.loss_mask.bool()
            stats["frac_rollout_logprob_zero"] = (batch.old_logprobs[sel] == 0).double().mean().item() if sel.any() else 0.0
            report["scenarios"][f"{name}; learner {label}"] = stats
            all_equal &= stats["frac_bitwise"] == 1.0
            if first_bad_prompt is None and stats["frac_bitwise"] < 1.0:
                m = batch.loss_mask.bool()
                bad_rows = ((logp != batch.old_logprobs) & m).any(dim=1).nonzero()
                first_bad_prompt = list(samples_[int(bad_rows[0])].prompt_ids)
    episodes = broadcast_object(episodes)
    if episodes:
        a, b = list(scenarios.values())
        same = all(x.response_ids == y.response_ids and x.logprobs == y.logprobs for x, y in zip(a, b))
        report["episodes"] = {"scenarios": episodes, "block_size": PREFIX_BLOCK,
                              "identical_alone_vs_batch": same and len(a) == len(b),
                              "prefix_cache_hit_tokens": broadcast_object(
                                  _prefix_cache_hits(side.engine, [s.prompt_ids + s.response_ids for s in a])
                                  if side else None)}
        all_equal &= same and all(e["one_prefill_bitwise"] for e in episodes.values())
    report["all_bitwise_equal"] = all_equal
    if not all_equal and recipe.mode == "aligned":
        from megatron_rz.tools.localise import localise

        report["localisation"] = localise(learner, side, rollout_dir, recipe, first_bad_prompt,
                                          vllm_sampling=vllm_kw, learner_sampling=learner_kw)
    return report


def print_report(report: dict) -> None:
    from rich.console import Console

    for one in report.get("grid") or [report]:
        _print_setting(report, one)
    verdict = "ALL sampled-token logprobs bitwise equal" if report["all_bitwise_equal"] else "logprobs differ"
    Console().print(f"[bold]{verdict}[/bold]")


def _print_setting(report: dict, one: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    fp8 = f" fp8={report['fp8']}" if report.get("fp8", "none") != "none" else ""
    sampling = " ".join(f"{k}={v}" for k, v in one.get("sampling", {}).items())
    layers = f" learner layers={report['learner_spec']}" if report.get("learner_spec") else ""
    t = Table(title=f"rz check: {report['arch']} {report['dtype']}{fp8} mode={report['mode']}{layers} "
                    f"layout={report['layout']} sampling: {sampling}")
    for col in ("scenario", "tokens", "bitwise equal", "max |dlogp|", "D3", "KL k1"):
        t.add_column(col, justify="right" if col != "scenario" else "left")
    for name, s in one["scenarios"].items():
        outside = f" ({s['tokens_outside_kept']} outside the learner's kept set)" if s.get("tokens_outside_kept") else ""
        t.add_row(name, f"{s['tokens']}{outside}", f"{100 * s['frac_bitwise']:.2f}%", f"{s['max_abs_dlogp']:.3g}",
                  f"{s['d3']:.3g}", f"{s['kl_k1']:.3g}")
    c = Console()
    c.print(t)
    if one.get("episodes"):
        e = one["episodes"]
        for name, x in e["scenarios"].items():
            c.print(f"episodes, {name}: {x['episodes']} episodes, {x['turns']} turns ({x['multi_turn_episodes']} "
                    f"multi-turn), {x['tool_calls']} tool calls ({x['tool_faults']} faults), {x['malformed_calls']} "
                    f"malformed; {x['model_tokens']} model tokens checked, {x['env_tokens_excluded']} environment "
                    f"tokens excluded; re-scored in one prefill: {100 * x['one_prefill_frac_bitwise']:.2f}% bitwise")
        c.print(f"episodes alone == in the batch (tokens and logprobs): {e['identical_alone_vs_batch']}; prefix cache "
                f"(block {e['block_size']}) served {e['prefix_cache_hit_tokens']} tokens of the finished conversations")
    if one.get("localisation"):
        loc = one["localisation"]
        c.print(f"[bold]localisation[/bold]: {loc['summary']}")
        for who in ("vllm", "learner"):  # a family with its own learner module: vLLM against the learner only
            if who in loc:
                label = f"{who} vs the learner" if loc.get("against") == "learner" else f"{who} vs the reference"
                shown = {k: v for k, v in loc[who].items() if k != "input_row"}  # the row: check.json only
                c.print(f"  {label}: {json.dumps(shown)}")


def main_check(recipe: Recipe, num_prompts: int, samples: int, inject_fault: str | list[str] | None = None) -> int:
    report = run_check(recipe, num_prompts, samples, inject_fault)
    if rank() == 0:
        (recipe.run_dir / "check.json").write_text(json.dumps(report, indent=2))  # first: a report is never lost
        print_report(report)
        print(json.dumps({"all_bitwise_equal": report["all_bitwise_equal"], "mode": report["mode"],
                          "learner_spec": report["learner_spec"]}))
    if dist.is_initialized():
        dist.barrier()
    return 1 if recipe.mode == "aligned" and not report["all_bitwise_equal"] else 0
