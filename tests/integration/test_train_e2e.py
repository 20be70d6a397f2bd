"""End to end through the real CLI: Megatron-Core learner + vLLM rollout + weight sync, a few updates."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SHORT = [
    "schedule.steps=3",
    "schedule.eval_every=0",
    "warm_start.steps=300",  # enough for mixed rewards in a group, so updates have a gradient
    "task.eval_prompts=24",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.verify_every=1",
    "checkpoint.every=2",
    "logging.progress=false",
]


@pytest.fixture(scope="module")
def base(shared_base_model):
    """The tiny_moe base model of SHORT's warm start, made once for this file's five runs."""
    return shared_base_model(ROOT / "recipes" / "tiny_moe.yaml", SHORT)


def _rz_train(run_dir: Path, *overrides: str, base: Path | None = None) -> subprocess.CompletedProcess:
    if base is not None and not (run_dir / "base_model").exists():
        shutil.copytree(base, run_dir / "base_model")
    env = {**os.environ, "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "megatron_rz.cli", "train", str(ROOT / "recipes" / "tiny_moe.yaml"),
           f"logging.run_dir={run_dir}", *SHORT, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


def _check_run(run_dir: Path, out: subprocess.CompletedProcess, aligned: bool = True):
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "max_abs_dlogp" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        # lag 0: the learner scores exactly the tokens vLLM sampled, with the weights vLLM used
        # (synced after every update): aligned mode is bitwise, fast mode close.
        if aligned:
            assert r["frac_bitwise"] == 1.0 and r["d3"] == 0.0 and r["is_w_max"] == 1.0, r
        else:
            assert 0 < r["max_abs_dlogp"] < 1e-3, r
        assert r["tokens"] > 0 and 0.0 <= r["reward_mean"] <= 1.0
        assert r["grad_norm"] >= 0  # 0 when every group's rewards are equal (no advantage)
    assert any(r["grad_norm"] > 0 for r in train_rows), train_rows
    # weights moved and vLLM followed them: version advanced once per update
    assert [r["weight_version"] for r in train_rows] == [1, 2, 3]
    assert 0.0 <= summary["eval_reward_before"] <= 1.0 and 0.0 <= summary["eval_reward_after"] <= 1.0
    assert (run_dir / "checkpoints" / "step_000002").is_dir() and (run_dir / "checkpoints" / "step_000003").is_dir()
    assert (run_dir / "hf_final" / "model.safetensors").is_file()
    for png in ("reward.png", "kl.png", "mismatch.png", "step_time.png"):
        assert (run_dir / "plots" / png).stat().st_size > 1000
    assert (run_dir / "wandb").is_dir()
    return summary


def test_train_tiny_moe_end_to_end(tmp_path, base):
    run_dir = tmp_path / "run"
    out = _rz_train(run_dir, base=base)
    summary = _check_run(run_dir, out)
    assert "[rz] warm start done" not in out.stdout  # the shared base model was taken as this run's
    assert summary["steps"] == 3 and summary["mismatch_frac_bitwise"] == 1.0


def test_train_tiny_moe_fast_mode_shows_mismatch(tmp_path, base):
    run_dir = tmp_path / "run_fast"
    # checkpoint.keep: a checkpoint after every update, the newest two kept (step 1's deleted)
    out = _rz_train(run_dir, "mode=fast", "checkpoint.every=1", "checkpoint.keep=2", base=base)
    _check_run(run_dir, out, aligned=False)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert "checkpoint.keep=2: deleted 1 older checkpoint(s) of this run (step_000001)" in out.stdout


def test_train_tiny_moe_tp2_ep2_through_torchrun(tmp_path, base):
    run_dir = tmp_path / "run_tp2"
    out = _rz_train(run_dir, "parallel.tp=2", "parallel.ep=2", base=base)
    assert "launching 2 learner ranks" in out.stdout
    _check_run(run_dir, out)


def test_async_dp2_time_limit_then_resume_through_torchrun(tmp_path, base):
    """The asynchronous trainer (max_lag=1, the rollout process) with two learner ranks (dp=2,
    ep=2, distributed optimizer) under schedule.time_limit_s: the run ends after the update that
    crossed it as a finished run does (final checkpoint with rank 1's shards, evaluation, summary,
    hf_final, plots), batches generated ahead of the stop are dropped before the final evaluation
    (on the H200 they once met it as a protocol error); checkpoint.load=latest continues it to the
    end: batch broadcast from rank 0, weights through the collective export, lag <= 1, lag-0
    tokens bitwise."""
    run_dir = tmp_path / "run_tl"
    par = ("parallel.dp=2", "parallel.ep=2", "parallel.distributed_optimizer=true", "schedule.max_lag=1")
    out = _rz_train(run_dir, "schedule.time_limit_s=0.000001", *par, base=base)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "launching 2 learner ranks" in out.stdout
    assert "schedule.time_limit_s=1e-06 reached after update 1 of 3" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["end_step"], summary["stopped_by"]) == (1, 1, "schedule.time_limit_s")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "max_abs_dlogp" in r] == [1]
    assert rows[-1]["step"] == 1 and "eval_reward" in rows[-1] and summary["eval_reward_after"] == rows[-1]["eval_reward"]
    assert (run_dir / "checkpoints" / "step_000001" / "__1_0.distcp").is_file()  # rank 1 wrote its shards
    assert (run_dir / "hf_final" / "model.safetensors").is_file()
    assert (run_dir / "plots" / "reward.png").stat().st_size > 1000
    out = _rz_train(run_dir, "checkpoint.load=latest", *par)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["end_step"], summary["stopped_by"]) == (2, 3, None)
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "lag_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["lag_max"] <= 1 for r in rows)
    assert all(r["lag0_pure_frac_bitwise"] == 1.0 for r in rows if r.get("lag0_pure_tokens")), rows
    assert (run_dir / "checkpoints" / "step_000003" / "__1_0.distcp").is_file()


def test_train_rejects_bad_recipe_before_starting_engines(tmp_path):
    out = _rz_train(tmp_path / "bad", "parallel.ep=3")
    assert out.returncode == 2
    assert "parallel" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "bad").exists()
