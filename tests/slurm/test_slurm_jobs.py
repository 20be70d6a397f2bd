"""`rz submit` against a real local SLURM (two slurmd, so the heterogeneous job can start).

1. The tiny recipe runs as a heterogeneous job (learner on node1, rollout on node2) to completion
   and leaves its metrics and final checkpoint; its vLLM engine runs in the rollout host on node2
   (megatron_rz.rollout_host), which serves every generate and weight update over TCP.
2. Preemption, with the asynchronous trainer (max_lag 1: its rollout loop runs inside the rollout
   host on node2): the warning signal (USR1 to the batch script) makes the learner checkpoint and
   exit, the job requeues itself, and the requeued job resumes from that checkpoint and finishes:
   every update appears once in metrics.jsonl, in order (continued, not restarted), and the
   resumed rollout loop starts from the checkpoint's weights.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Small enough for ~1 minute per job start on 2 cores: fast kernels, a short warm start, few prompts.
TINY = [
    "mode=fast",
    "warm_start.steps=50",
    "rollout.prompts_per_step=4",
    "task.eval_prompts=16",
    "schedule.eval_every=0",
    "rollout.verify_sync=false",
    "logging.wandb=false",
    "logging.plots=false",
    "logging.progress=false",
    f"cluster.python={sys.executable}",  # the interpreter running the tests, on both "nodes"
    "cluster.time_limit=00:20:00",
    "cluster.signal_warning_s=120",
]


def _submit(tmp: Path, *overrides: str) -> tuple[str, Path, Path]:
    cmd = [sys.executable, "-m", "megatron_rz.cli", "submit", "recipes/tiny_moe.yaml", *TINY,
           f"cluster.log_dir={tmp}/logs", f"cluster.run_root={tmp}/runs", *overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.search(r"submitted job (\d+)", res.stdout)
    assert m, res.stdout
    job = m.group(1)
    return job, tmp / "runs" / f"tiny_moe-{job}", tmp / "logs" / f"rz-tiny_moe-{job}.out"


def _job(job: str) -> dict[str, str]:
    """scontrol's view of the job (no accounting here, so no sacct): key=value fields."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    first = out.splitlines()[0] if out.strip() else ""  # the het leader's line
    return dict(kv.split("=", 1) for kv in first.split() if "=" in kv)


def _wait(pred, what: str, log: Path, timeout: float):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(1)
    tail = log.read_text()[-4000:] if log.exists() else "(no log)"
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; job log:\n{tail}")


def _finished(job: str):
    state = _job(job).get("JobState")
    return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") else None


def _train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "max_abs_dlogp" in r]


def test_tiny_recipe_runs_as_heterogeneous_job(local_slurm, tmp_path):
    # verify_sync on: the learner checks the remote engine's weights (checksums over the wire) every step
    job, run_dir, log = _submit(tmp_path, "schedule.steps=3", "rollout.verify_sync=true", "rollout.verify_every=1")
    # Both components are allocated at once, on different nodes.
    _wait(lambda: _job(job).get("JobState") in ("RUNNING", "COMPLETED"), "the job to start", log, 60)
    lines = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout.splitlines()
    assert len(lines) == 2, lines  # learner + rollout component
    nodes = [dict(kv.split("=", 1) for kv in ln.split() if "=" in kv)["NodeList"] for ln in lines]
    assert sorted(nodes) == ["node1", "node2"], nodes

    state = _wait(lambda: _finished(job), "the job to finish", log, 240)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert "learner exited with 0" in text
    # The vLLM engine ran on the rollout component: the host that node2's slurmd started
    # (SLURMD_NODENAME=node2) built it, served every generate and took every weight update.
    host = json.loads((run_dir / "rollout" / "node2.json").read_text())
    assert host["node"] == "node2" and host["job"] and host["port"], host
    eng = host["engine"]
    assert eng and eng["host_pid"] == host["pid"] and eng["engine_pids"], host
    assert "rollout host(s) ready" in text
    assert f"[rz] rollout engines on the rollout nodes: node2 (host pid {host['pid']}" in text
    assert "[rz rollout] node2: engine started" in text
    # 3 steps x 4 prompts x 8 samples, plus the evaluations before and after (n=1)
    assert len(re.findall(r"\[rz rollout\] node2: generate: 4 prompt\(s\) x 8 -> 32 samples", text)) == 3, text[-4000:]
    assert len(re.findall(r"\[rz rollout\] node2: generate: 16 prompt\(s\) x 1 ", text)) == 2
    assert re.search(r"\[rz rollout\] node2: weights: version 3,", text)
    assert "[rz rollout] node2: done" in text
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2, 3]
    assert all(r["time_sync"] > 0 for r in _train_rows(run_dir))
    assert (run_dir / "checkpoints" / "step_000003" / "COMPLETE").exists()
    assert (run_dir / "checkpoints" / "step_000003" / "rank00000.pt").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_warning_signal_checkpoints_requeues_and_resumes(local_slurm, tmp_path):
    steps = 20
    job, run_dir, log = _submit(tmp_path, f"schedule.steps={steps}", "schedule.max_lag=1")
    _wait(lambda: len(_train_rows(run_dir)) >= 1, "the first update", log, 240)
    # What SLURM does before the time limit (--signal=B:USR1@secs): USR1 to the batch script only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)

    # The job requeues itself; SLURM starts it again once the killed instance's credential expires
    # (AuthInfo=cred_expire=10 in slurm/start_local.sh). Releasing it earlier by hand
    # (scontrol update StartTime=now) races that expiry: slurmd then kills it ("credential revoked").
    _wait(lambda: _job(job).get("Restarts") == "1", "the job to requeue", log, 180)

    state = _wait(lambda: _finished(job), "the requeued job to finish", log, 300)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    m = re.search(r"\[rz\] preempted: checkpoint \S+ written at step (\d+)", text)
    assert m, text[-4000:]
    k = int(m.group(1))
    assert 1 <= k < steps
    assert "requeueing job" in text and "restart 1: run dir" in text
    assert f"resumed from {run_dir}/checkpoints/step_{k:06d} (step {k})" in text
    assert (run_dir / "checkpoints" / f"step_{k:06d}" / "COMPLETE").exists()
    assert (run_dir / "checkpoints" / f"step_{steps:06d}" / "COMPLETE").exists()
    # Continued, not restarted: every update once, in order, across the two runs.
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["lag_max"] <= 1 and r["rollout_hosts"] == 1 for r in rows)
    # both runs' rollout loops ran on node2, the second one from the checkpoint's weights
    assert len(re.findall(r"\[rz rollout\] node2: rollout: started", text)) == 2, text[-4000:]
    assert "async rollout on the rollout nodes: node2" in text
    assert rows[k]["submit_version"] >= k  # the first batch after the resume: weights version k
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps - k
