"""`rz check` over a grid of sampling settings on ONE engine and ONE learner.

    .venv/bin/python benchmarks/sampling_grid.py RECIPE OUT.json [key=value overrides] [--prompts N]
        [--samples G] [--grid full|small]

Each grid point is checked exactly as `rz check RECIPE rollout.temperature=T rollout.top_p=P
rollout.top_k=K` would (concurrent batch + one sequence at a time, learner micro-batches 1 / 5 / all
/ padded), without a new engine per point. Prints one line per point and writes the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TEMPS = (0.6, 1.0, 1.3)
FULL = ([{"temperature": t, "top_p": p} for p in (0.5, 0.9, 0.99) for t in TEMPS]
        + [{"temperature": t, "top_k": k} for k in (1, 5, 20) for t in TEMPS]
        + [{"temperature": 0.7, "top_k": 20, "top_p": 0.9}, {"temperature": 1.3, "top_k": 5, "top_p": 0.5},
           {"temperature": 1.0, "top_k": 1, "top_p": 0.99}])
SMALL = [{"temperature": 0.6, "top_p": 0.9}, {"temperature": 1.3, "top_k": 5},
         {"temperature": 1.0, "top_k": 20, "top_p": 0.5}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("out")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--grid", choices=("full", "small"), default="full")
    a = ap.parse_args(argv)
    from megatron_rz.tools.check import run_check
    from megatron_rz.recipe import load_recipe

    recipe = load_recipe(a.recipe, a.overrides)
    report = run_check(recipe, a.prompts, a.samples, sampling_grid=FULL if a.grid == "full" else SMALL)
    for g in report["grid"]:
        sc = g["scenarios"].values()
        tokens = sum(s["tokens"] for s in sc)
        bitwise = sum(s["frac_bitwise"] * s["tokens"] for s in sc) / max(tokens, 1)
        worst = max(s["max_abs_dlogp"] for s in sc)
        outside = sum(s.get("tokens_outside_kept", 0) for s in sc)
        zero = sum(s.get("frac_rollout_logprob_zero", 0) * s["tokens"] for s in sc) / max(tokens, 1)
        print(f"{json.dumps(g['sampling'])}: {100 * bitwise:.2f}% bitwise of {tokens} token scores "
              f"({100 * zero:.0f}% with logprob exactly 0: one kept token), max |dlogp| {worst:.3g}, "
              f"outside the learner's kept set {outside}", flush=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({"all_bitwise_equal": report["all_bitwise_equal"], "mode": report["mode"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
