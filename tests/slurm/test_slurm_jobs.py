"""`rz submit` against a real local SLURM (two slurmd, so the heterogeneous job can start).

One job (each job start costs minutes here, so one job carries every claim) with the asynchronous
trainer (max_lag 1: its producer runs on the learner side and drives node2's server):
1. It runs as a heterogeneous job (learner on node1, rollout on node2); its vLLM engine is
   `vllm serve` on node2 (python -m vllm_bridge.serve), which the learner drives over HTTP for every
   generate and weight update (vllm_bridge.server_client); every update's weights go through the
   filesystem transport and are verified on the server (rollout.verify_sync, every update).
2. Preemption: the warning signal (USR1 to the batch script) makes the learner checkpoint and exit,
   the job requeues itself, and the requeued job resumes from that checkpoint and finishes: every
   update appears once in metrics.jsonl, in order (continued, not restarted), and the resumed rollout
   loop starts from the checkpoint's weights; it leaves its metrics and final checkpoint.
The synchronous trainer's use of the same servers is tested in tests/integration/test_remote_rollout.py
(the client) and the loops are shared (megatron_rz/loop/trainer.py).
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


def test_heterogeneous_job_is_preempted_requeues_and_resumes(local_slurm, tmp_path):
    steps = 8  # the warning comes after update 1, the checkpoint at the end of the update under way
    job, run_dir, log = _submit(tmp_path, f"schedule.steps={steps}", "schedule.max_lag=1",
                                "rollout.verify_sync=true", "rollout.verify_every=1")
    # Both components are allocated at once, on different nodes.
    _wait(lambda: _job(job).get("JobState") in ("RUNNING", "COMPLETED"), "the job to start", log, 60)
    lines = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout.splitlines()
    assert len(lines) == 2, lines  # learner + rollout component
    nodes = [dict(kv.split("=", 1) for kv in ln.split() if "=" in kv)["NodeList"] for ln in lines]
    assert sorted(nodes) == ["node1", "node2"], nodes
    _wait(lambda: len(_train_rows(run_dir)) >= 1, "the first update", log, 480)
    # What SLURM does before the time limit (--signal=B:USR1@secs): USR1 to the batch script only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)

    # The job requeues itself; SLURM starts it again once the killed instance's credential expires
    # (AuthInfo=cred_expire=10 in slurm/start_local.sh). Releasing it earlier by hand
    # (scontrol update StartTime=now) races that expiry: slurmd then kills it ("credential revoked").
    _wait(lambda: _job(job).get("Restarts") == "1", "the job to requeue", log, 180)

    state = _wait(lambda: _finished(job), "the requeued job to finish", log, 480)
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
    assert all(r["lag_max"] <= 1 for r in rows)
    # both runs drove node2's server (a fresh `vllm serve` per job start), the second one from the
    # checkpoint's weights
    assert len(re.findall(r"\[rz\] rollout on 1 vLLM server\(s\): node2 ", text)) == 2, text[-4000:]
    assert len(re.findall(r"\[rz serve\] node2: ready at ", text)) == 2
    assert rows[k]["submit_version"] >= k  # the first batch after the resume: weights version k
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps - k
    assert "learner exited with 0" in text
    # The vLLM engine ran on the rollout component: `vllm serve` started by node2's slurmd
    # (SLURMD_NODENAME=node2) recorded itself once its /health answered; the learner drove it.
    server = json.loads((run_dir / "rollout" / "servers" / "node2.json").read_text())
    assert server["node"] == "node2" and server["url"].startswith("http://") and server["pid"], server
    assert (run_dir / "rollout" / "model_dir").read_text().strip().startswith(str(run_dir))
    assert "[rz serve] node2: starting vllm serve" in text and f"[rz serve] node2: ready at {server['url']}" in text
    assert "1 rollout server(s) ready after" in text
    assert f"[rz] rollout on 1 vLLM server(s): node2 ({server['url']})" in text  # the requeued job's server
    assert all(r["time_sync"] > 0 for r in rows)
    # every update's weights reached the server through the filesystem transport, verified there
    for v in range(1, steps + 1):
        assert f"[rz] weights version {v} on node2:" in text, (v, text[-4000:])
    assert not list((run_dir / "rollout" / "weights").glob("v*"))  # bucket files released
    assert (run_dir / "checkpoints" / f"step_{steps:06d}" / "__0_0.distcp").exists()
