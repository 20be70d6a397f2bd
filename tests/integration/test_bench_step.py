"""`rz bench step`: the whole RL step, aligned vs fast, from one base model, each mode a real
training run in its own process; the JSON's split is what the runs' metrics say."""

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHORT = ["schedule.steps=3", "schedule.eval_every=0", "warm_start.steps=300", "task.eval_prompts=24",
         "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "logging.progress=false"]


def test_bench_step_runs_both_modes_from_one_base_and_reports_the_split(tmp_path, shared_base_model):
    run_dir = tmp_path / "run"
    # the base model the bench would make (same recipe hash), shared with the other e2e tests
    shutil.copytree(shared_base_model(ROOT / "recipes" / "tiny_moe.yaml", SHORT), run_dir / "bench_step" / "base_model")
    cmd = [sys.executable, "-m", "megatron_rz.cli", "bench", "step", str(ROOT / "recipes" / "tiny_moe.yaml"),
           f"logging.run_dir={run_dir}", *SHORT]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env={**os.environ, "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "RL step, aligned / fast" in out.stdout
    res = json.loads((run_dir / "bench_step" / "run1" / "bench_step.json").read_text())
    assert res["steps"] == 3 and res["max_lag"] == 0
    for mode in ("aligned", "fast"):
        leg = run_dir / "bench_step" / "run1" / mode
        rows = [json.loads(x) for x in (leg / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "max_abs_dlogp" in r]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert json.loads((leg / "summary.json").read_text())["mode"] == mode
        # lag 0: aligned scores exactly what vLLM sampled; fast does not
        if mode == "aligned":
            assert all(r["frac_bitwise"] == 1.0 for r in rows), rows
        else:
            assert all(r["max_abs_dlogp"] > 0 for r in rows), rows
        assert res[mode]["updates"] == 3 and res[mode]["updates_timed"] == 2  # the first update left out
        for part in ("time_rollout", "time_learner", "time_sync", "time_step"):
            assert res[mode][part]["median"] == statistics.median(r[part] for r in rows[1:])
    for part in ("rollout", "learner", "sync", "step"):
        want = res["aligned"][f"time_{part}"]["median"] / res["fast"][f"time_{part}"]["median"]
        assert abs(res["aligned_over_fast"][part] - want) < 1e-12
