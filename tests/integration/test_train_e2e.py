"""End to end through the real CLI: Megatron-Core learner + vLLM rollout + weight sync, a few updates.

The aligned run of `test_train_tiny_moe_end_to_end` is also the uninterrupted reference of the
kill-and-resume test (one run instead of two: a training run is mostly process and engine start-up)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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


def _check_run(run_dir: Path, out: subprocess.CompletedProcess, aligned: bool = True, steps: int = 3):
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "max_abs_dlogp" in r]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
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
    assert [r["weight_version"] for r in train_rows] == list(range(1, steps + 1))
    assert 0.0 <= summary["eval_reward_before"] <= 1.0 and 0.0 <= summary["eval_reward_after"] <= 1.0
    assert (run_dir / "checkpoints" / "step_000002").is_dir() and (run_dir / "checkpoints" / f"step_{steps:06d}").is_dir()
    assert (run_dir / "hf_final" / "model.safetensors").is_file()
    for png in ("reward.png", "kl.png", "mismatch.png", "step_time.png"):
        assert (run_dir / "plots" / png).stat().st_size > 1000
    assert (run_dir / "wandb").is_dir()
    return summary


# The aligned end-to-end run, four updates with an evaluation every two: also the reference of
# the kill-and-resume test below, which runs the same command.
REF = ("schedule.steps=4", "schedule.eval_every=2")


@pytest.fixture(scope="module")
def aligned_run(tmp_path_factory, base):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    return run_dir, _rz_train(run_dir, *REF, base=base)


def test_train_tiny_moe_end_to_end(aligned_run):
    run_dir, out = aligned_run
    summary = _check_run(run_dir, out, steps=4)
    assert "[rz] warm start done" not in out.stdout  # the shared base model was taken as this run's
    assert summary["steps"] == 4 and summary["mismatch_frac_bitwise"] == 1.0
    evals = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval_reward" in r]
    assert evals == [0, 2, 4], evals


# Bookkeeping that legitimately differs between two runs of the same recipe.
VOLATILE = ("time_", "throughput", "_s")


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(k.startswith(p) or k.endswith(p) for p in VOLATILE)} for r in rows]


def _logged_since(run_dir: Path, t0: float, n: int) -> bool:
    """metrics.jsonl rewritten after t0 and holding at least n complete rows."""
    f = run_dir / "metrics.jsonl"
    try:
        return f.stat().st_mtime > t0 and f.read_text().count("\n") >= n
    except FileNotFoundError:
        return False


def _engine_cores(pid: int) -> list[int]:
    import psutil

    out = []
    for c in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()):
                out.append(c.pid)
        except psutil.Error:
            pass
    return out


def _popen(run_dir: Path, *overrides: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_rz.cli", "train", str(ROOT / "recipes" / "tiny_moe.yaml"),
           f"logging.run_dir={run_dir}", *SHORT, *REF, *overrides]
    return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "WANDB_MODE": "offline"}, start_new_session=True)


def test_killed_run_resumes_to_the_same_metrics(tmp_path, base, aligned_run):
    """SIGKILL a training run after a checkpoint, resume it, SIGKILL the resumed run's vLLM engine
    core mid-run (the trainer starts a new engine with the current weights and re-runs the call:
    RolloutEngine notices the dead core even inside LLM.generate), and get the uninterrupted run's
    metrics: same prompts, same samples, same updates, each once (aligned mode on CPU is
    deterministic). One run for both faults (they cost the same two training runs)."""
    ref, _ = aligned_run
    run = tmp_path / "killed"
    shutil.copytree(base, run / "base_model")
    proc = _popen(run)
    marker = run / "checkpoints" / "step_000002" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), f"no checkpoint at step 2 (rc={proc.poll()})"
    os.killpg(proc.pid, signal.SIGKILL)  # the learner and its vLLM engine processes, no clean-up
    proc.wait(timeout=60)
    assert not (run / "summary.json").exists()

    t_resume = time.time()
    proc = _popen(run, "checkpoint.load=latest", stdout=subprocess.PIPE)
    try:
        deadline = time.time() + 600
        # the resumed run cuts metrics.jsonl back to steps 1-2; once it has logged step 3, kill its
        # engine core (during step 4's weight sync or rollout)
        while time.time() < deadline and proc.poll() is None and not _logged_since(run, t_resume, 3):
            time.sleep(0.1)
        cores = _engine_cores(proc.pid)
        assert cores, f"no vLLM engine core under the resumed run (rc={proc.poll()})"
        os.kill(cores[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    assert "resumed from" in stdout and "step_000002" in stdout
    assert "[rz] rollout engine died during update" in stdout and "restart 1 of 2" in stdout, stdout[-3000:]
    ref_rows, run_rows = _rows(ref), _rows(run)
    assert [r["step"] for r in run_rows] == [r["step"] for r in ref_rows]
    assert any(r.get("grad_norm", 0) > 0 for r in ref_rows)  # updates had a gradient: a wrong resume shows
    for a, b in zip(ref_rows, run_rows):
        assert a == b, (a, b)
    ref_sum = json.loads((ref / "summary.json").read_text())
    run_sum = json.loads((run / "summary.json").read_text())
    assert run_sum["eval_reward_after"] == ref_sum["eval_reward_after"]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    out = _rz_train(tmp_path / "r", f"checkpoint.load={tmp_path / 'nope'}")
    assert out.returncode != 0
    assert "no such directory" in (out.stdout + out.stderr) and "checkpoint.load=latest" in (out.stdout + out.stderr)


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
