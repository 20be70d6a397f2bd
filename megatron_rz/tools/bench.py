"""`rz bench rollout`: rollout step time, aligned vs fast, measured alternately in one run
(`rz bench step` and `rz bench async` run whole training legs: megatron_rz.loop.trainer).

Both engines live side by side; each round generates the same prompts with the same seed on
both, in alternating order (ABBA...), after one warm-up round. The machine is noisy, so the figure
that counts is the ratio of medians measured in the same run, never an absolute time.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

from megatron_rz.recipe import Recipe
from megatron_rz.launch.rundir import prepare_base_model
from megatron_rz.loop.trainer import RolloutSide


def bench_rollout(recipe: Recipe, rounds: int = 5) -> dict:
    base = prepare_base_model(recipe, recipe.run_dir)
    sides = {m: RolloutSide(recipe.model_copy(update={"mode": m}), base) for m in ("fast", "aligned")}
    task = sides["fast"].task
    problems = task.sample(random.Random(recipe.schedule.seed), recipe.rollout.prompts_per_step)
    times: dict[str, list[float]] = {m: [] for m in sides}
    tokens: dict[str, list[int]] = {m: [] for m in sides}
    try:
        for rnd in range(rounds + 1):
            order = ["fast", "aligned"] if rnd % 2 == 0 else ["aligned", "fast"]
            for m in order:
                t0 = time.perf_counter()
                samples = sides[m].rollout(problems, seed=1234 + rnd)
                dt = time.perf_counter() - t0
                if rnd > 0:  # round 0 warms caches and allocators
                    times[m].append(dt)
                    tokens[m].append(sum(len(s.response_ids) for s in samples))
    finally:
        for s in sides.values():
            s.engine.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    ratios = sorted(a / f for a, f in zip(times["aligned"], times["fast"]))  # per round (same order pair)
    return {
        "aligned_over_fast_per_round": [round(r, 3) for r in ratios],
        "cpu_kernels": _cpu_kernels(),
        "load_average": list(os.getloadavg()),
        "arch": recipe.model.arch,
        "dtype": recipe.model.dtype,
        "prompts": len(problems),
        "samples_per_prompt": recipe.rollout.samples_per_prompt,
        "rounds": rounds,
        "step_time_median_s": med,
        "tokens_per_s": {m: statistics.median(tokens[m]) / med[m] for m in med},
        "aligned_over_fast": med["aligned"] / med["fast"],
    }


def _cpu_kernels() -> str:
    """Which exact CPU kernels the aligned side ran: the compiled ones or the torch reference."""
    from kernels import _native

    return "compiled (kernels/_native.c)" if _native.available() else f"torch reference: {_native.status()}"


def main_bench(recipe: Recipe, what: str, rounds: int, lags: tuple[int, ...] = (2,)) -> int:
    if what == "step":
        from megatron_rz.loop.trainer import bench_step

        print(json.dumps(bench_step(recipe, recipe.schedule.steps)))
        return 0
    if what == "async":
        from megatron_rz.loop.trainer import bench_async_vs_sync

        print(json.dumps(bench_async_vs_sync(recipe, recipe.schedule.steps, lags)))
        return 0
    res = bench_rollout(recipe, rounds)
    print(
        f"rollout step ({res['prompts']} prompts x {res['samples_per_prompt']}, {res['arch']} {res['dtype']}): "
        f"fast {res['step_time_median_s']['fast']:.3f}s, aligned {res['step_time_median_s']['aligned']:.3f}s, "
        f"aligned/fast = {res['aligned_over_fast']:.2f}"
    )
    print(json.dumps(res))
    return 0
