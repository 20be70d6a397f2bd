"""Kill a training run with SIGKILL after a checkpoint, resume it, SIGKILL the resumed run's vLLM
engine core mid-run (the trainer starts a new engine with the current weights and re-runs the call:
RolloutEngine notices the dead core even inside LLM.generate), and get the uninterrupted run's
metrics: same prompts, same samples, same updates, each once (aligned mode on CPU is deterministic).
One shared run for both faults (they cost the same two training runs)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN = [
    "schedule.steps=4",
    "schedule.eval_every=2",
    "warm_start.steps=300",  # mixed rewards in groups: updates have a gradient, so a wrong resume shows
    "task.eval_prompts=24",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "checkpoint.every=2",
    "logging.progress=false",
    "logging.plots=false",
]
# Bookkeeping that legitimately differs between two runs of the same recipe.
VOLATILE = ("time_", "throughput", "_s")


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rz.cli", "train", str(ROOT / "recipes" / "tiny_moe.yaml"),
            f"logging.run_dir={run_dir}", *RUN, *extra]


def _env() -> dict:
    return {**os.environ, "WANDB_MODE": "offline"}


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


def test_killed_run_resumes_to_the_same_metrics(tmp_path, shared_base_model):
    ref, run = tmp_path / "uninterrupted", tmp_path / "killed"
    # One base model for both runs (the session's shared warm start of these settings)
    base = shared_base_model(ROOT / "recipes" / "tiny_moe.yaml", RUN)
    shutil.copytree(base, ref / "base_model")
    shutil.copytree(base, run / "base_model")
    out = subprocess.run(_cmd(ref), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert any(r.get("grad_norm", 0) > 0 for r in _rows(ref))

    proc = subprocess.Popen(_cmd(run), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT, start_new_session=True)
    marker = run / "checkpoints" / "step_000002" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), f"no checkpoint at step 2 (rc={proc.poll()})"
    os.killpg(proc.pid, signal.SIGKILL)  # the learner and its vLLM engine processes, no clean-up
    proc.wait(timeout=60)
    assert not (run / "summary.json").exists()

    t_resume = time.time()
    proc = subprocess.Popen(_cmd(run, "checkpoint.load=latest"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=ROOT, start_new_session=True)
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
    for a, b in zip(ref_rows, run_rows):
        assert a == b, (a, b)
    ref_sum = json.loads((ref / "summary.json").read_text())
    run_sum = json.loads((run / "summary.json").read_text())
    assert run_sum["eval_reward_after"] == ref_sum["eval_reward_after"]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    out = subprocess.run(_cmd(tmp_path / "r", f"checkpoint.load={tmp_path / 'nope'}"), capture_output=True,
                         text=True, env=_env(), cwd=ROOT, timeout=300)
    assert out.returncode != 0
    assert "no such directory" in (out.stdout + out.stderr) and "checkpoint.load=latest" in (out.stdout + out.stderr)
