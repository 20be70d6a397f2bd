"""Remote rollout transport on one machine, no SLURM: a real `python -m megatron_rz.rollout_host`
process serving a real vLLM engine (tiny random Qwen3-MoE checkpoint), driven by
vllm_bridge.remote.RemoteRolloutEngine.

One test, in order (one vLLM start-up): the host records its json and refuses a wrong key; the
client starts the engine there, generates (seeded: reproducible), pushes new weights (verify_sync
passes on them and fails on the old ones, naming the node), gets an error raised inside the host
back with the node's name (and the host keeps serving); a stopped host (SIGSTOP) is reported gone
after the heartbeat timeout instead of hanging; a new connection reaches the same engine; a killed
host (SIGKILL) is reported gone at once.

Run: .venv/bin/python -m pytest tests/integration/test_remote_rollout.py -q -s
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_bridge.engine import RolloutEngineError, WeightSyncError  # noqa: E402
from vllm_bridge.remote import RemoteRolloutEngine, RolloutHostError, read_hosts, write_authkey  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NODE = "testnode"
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3]]


def _kill(pid: int, sig=signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def test_remote_rollout_host(tmp_path):
    from megatron_rz.recipe import load_recipe
    from megatron_rz.tiny_models import make_random_checkpoint

    ckpt = tmp_path / "ckpt"
    make_random_checkpoint(load_recipe(None, []), ckpt)
    run_dir = tmp_path / "run"
    key = write_authkey(run_dir)
    assert (key.stat().st_mode & 0o777) == 0o600
    log = open(tmp_path / "host.log", "w")
    env = {**os.environ, "SLURMD_NODENAME": NODE, "RZ_NODE_ADDR": "127.0.0.1", "RZ_ROLLOUT_HEARTBEAT_S": "0.5",
           "PYTHONPATH": str(ROOT)}
    host = subprocess.Popen([sys.executable, "-m", "megatron_rz.rollout_host", str(run_dir)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    engine_pids: list[int] = []
    timings = {}
    try:
        t0 = time.perf_counter()
        client = RemoteRolloutEngine.from_run_dir(run_dir, expected=1, wait_s=60, heartbeat_timeout_s=5)
        timings["host_ready_s"] = time.perf_counter() - t0
        (info,) = read_hosts(run_dir)
        assert info["node"] == NODE and info["pid"] == host.pid and info["addr"] == "127.0.0.1"

        with pytest.raises(RolloutEngineError, match=f"node {NODE}.*refused the connection"):
            RemoteRolloutEngine([info], b"not the key", connect_timeout_s=10)

        t0 = time.perf_counter()
        (started,) = client.start(str(ckpt), max_num_seqs=16, max_model_len=128, kv_cache_gb=0.25, seed=0)
        timings["engine_start_s"] = time.perf_counter() - t0
        engine_pids = started["engine_pids"] + started["worker_pids"]
        assert started["node"] == NODE and started["host_pid"] == host.pid
        assert json.loads((run_dir / "rollout" / f"{NODE}.json").read_text())["engine"]["engine_pids"] == started["engine_pids"]

        # generate: grouped like the local engine, seeded = reproducible
        a = client.generate(PROMPTS, 2, temperature=1.0, max_new_tokens=8, seed=3)
        b = client.generate(PROMPTS, 2, temperature=1.0, max_new_tokens=8, seed=3)
        assert [s.group for s in a] == [0, 0, 1, 1, 2, 2]
        assert [s.prompt_ids for s in a[::2]] == PROMPTS
        assert [(s.response_ids, s.logprobs) for s in a] == [(s.response_ids, s.logprobs) for s in b]
        assert all(math.isfinite(x) and x <= 0 for s in a for x in s.logprobs)
        assert all(v == 0 for s in a for v in s.versions)

        # update_weights: new tensors reach the engine (verify passes on them, fails on the old ones)
        from safetensors.torch import load_file

        old = load_file(str(ckpt / "model.safetensors"))
        new = {k: v * 1.5 if v.is_floating_point() else v for k, v in old.items()}
        t0 = time.perf_counter()
        sync = client.update_weights(new.items(), version=1)
        timings["sync_s"] = time.perf_counter() - t0
        timings["sync_mb"] = sync["bytes"] / 1e6
        assert sync["num_tensors"] == len(new) and client.weight_version == 1
        assert client.remote_weight_versions() == [1]
        checked = client.verify_sync(new.items())
        assert checked["checked"] and checked["max_rel_err"] <= 1e-6
        with pytest.raises(WeightSyncError, match=f"node {NODE}"):
            client.verify_sync(old.items())
        c = client.generate(PROMPTS, 2, temperature=1.0, max_new_tokens=8, seed=3)
        assert all(v == 1 for s in c for v in s.versions)
        assert [s.logprobs for s in c] != [s.logprobs for s in a]

        # an error inside the host comes back naming the node; the host keeps serving
        with pytest.raises(RolloutHostError, match=f"rollout host on node {NODE} failed: ValueError: score: temperature"):
            client.score([[1, 2, 3]], temperature=0.0)
        assert len(client.score([[5, 6, 7, 8]])[0]) == 4

        # a stopped host: the heartbeat timeout says it is gone instead of hanging
        os.kill(host.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        try:
            with pytest.raises(RolloutEngineError, match=f"rollout host on node {NODE} is gone: no answer and no heartbeat"):
                client.generate(PROMPTS, 1, max_new_tokens=4, seed=0)
        finally:
            os.kill(host.pid, signal.SIGCONT)
        timings["stopped_detect_s"] = time.perf_counter() - t0
        assert timings["stopped_detect_s"] < 15
        with pytest.raises(RolloutEngineError, match="is gone"):  # the client stays failed
            client.remote_weight_versions()
        client.close()

        # a new connection reaches the same engine (weights still version 1)
        client2 = RemoteRolloutEngine.from_run_dir(run_dir, expected=1, wait_s=10, heartbeat_timeout_s=5)
        assert client2.remote_weight_versions() == [1]
        assert len(client2.generate(PROMPTS[:1], 1, max_new_tokens=4, seed=0)) == 1

        # a killed host: gone at once (connection closed), not a hang
        host.kill()
        host.wait(10)
        t0 = time.perf_counter()
        with pytest.raises(RolloutEngineError, match=f"rollout host on node {NODE} is gone"):
            client2.generate(PROMPTS, 1, max_new_tokens=4, seed=0)
        timings["killed_detect_s"] = time.perf_counter() - t0
        assert timings["killed_detect_s"] < 5
        with pytest.raises(RolloutEngineError, match=f"rollout host on node {NODE} is gone: cannot connect"):
            RemoteRolloutEngine([info], key.read_text().strip().encode(), connect_timeout_s=5)
        client2.close()
        text = (tmp_path / "host.log").read_text()
        assert f"[rz rollout] {NODE}: generate: 3 prompt(s) x 2 -> 6 samples" in text
        assert f"[rz rollout] {NODE}: weights: version 1" in text
        print("\nremote rollout timings:", json.dumps({k: round(v, 3) for k, v in timings.items()}))
    finally:
        if host.poll() is None:
            host.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.wait(30)
            if host.poll() is None:
                host.kill()
        for pid in engine_pids:  # vLLM processes orphaned by the SIGKILL above
            _kill(pid)
        log.close()


def test_engine_spanning_two_rollout_hosts(tmp_path):
    """An engine wider than a node (rollout.tensor_parallel_size > GPUs per node): tensor parallel 2
    over two rollout hosts, as `rz submit` starts them (RZ_ENGINE_NODES=2, SLURM_NODEID 0 and 1),
    here two processes of this machine with one CPU each. The first serves the engine (vLLM's
    multi-node executor, node_rank 0) and publishes its settings; the second runs the engine's
    second worker from them. Samples match a one-process engine's; weight updates reach it."""
    from megatron_rz.recipe import load_recipe
    from megatron_rz.tiny_models import make_random_checkpoint
    from vllm_bridge.engine import RolloutEngine

    ckpt = tmp_path / "ckpt"
    make_random_checkpoint(load_recipe(None, []), ckpt)
    run_dir = tmp_path / "run"
    write_authkey(run_dir)
    hosts, logs = [], []
    for rank, node in enumerate(("nodeA", "nodeB")):
        logs.append(tmp_path / f"{node}.log")
        env = {**os.environ, "SLURMD_NODENAME": node, "SLURM_NODEID": str(rank), "RZ_ENGINE_NODES": "2",
               "RZ_NODE_ADDR": "127.0.0.1", "VLLM_CPU_OMP_THREADS_BIND": str(rank), "PYTHONPATH": str(ROOT)}
        hosts.append(subprocess.Popen([sys.executable, "-m", "megatron_rz.rollout_host", str(run_dir)], cwd=ROOT,
                                      env=env, stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT))
    kw = dict(max_num_seqs=16, max_model_len=128, kv_cache_gb=0.25, seed=0)
    try:
        client = RemoteRolloutEngine.from_run_dir(run_dir, expected=1, wait_s=60, heartbeat_timeout_s=60)
        assert client.nodes == ["nodeA"]  # nodeB runs workers only: it serves nothing
        worker = json.loads((run_dir / "rollout" / "nodeB.json").read_text())
        assert worker["role"] == "engine workers" and worker["engine"] == 0 and worker["engine_node_rank"] == 1
        (started,) = client.start(str(ckpt), tensor_parallel_size=2, **kw)
        settings = json.loads((run_dir / "rollout" / "engines" / "engine-0.json").read_text())
        assert settings["kwargs"]["nnodes"] == 2 and settings["kwargs"]["tensor_parallel_size"] == 2
        a = client.generate(PROMPTS, 2, temperature=1.0, max_new_tokens=8, seed=3)
        from safetensors.torch import load_file

        old = load_file(str(ckpt / "model.safetensors"))
        new = {k: v * 1.5 if v.is_floating_point() else v for k, v in old.items()}
        client.update_weights(new.items(), version=1)
        assert client.verify_sync(new.items())["checked"]  # tensors replicated on both workers
        c = client.generate(PROMPTS, 2, temperature=1.0, max_new_tokens=8, seed=3)
        assert all(v == 1 for s in c for v in s.versions) and [s.logprobs for s in c] != [s.logprobs for s in a]
        client.close()
        deadline = time.monotonic() + 60
        while "workers of engine 0 exited" not in logs[1].read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "starting the workers of engine 0 (node_rank 1)" in logs[1].read_text()
        assert "workers of engine 0 exited" in logs[1].read_text()  # the head's close ends them
    finally:
        (run_dir / "LEARNER_EXITED").touch()
        for h in hosts:
            try:
                h.wait(60)
            except subprocess.TimeoutExpired:
                h.kill()
    # the same model in one process (tensor parallel 1): same samples, logprobs to fp32 reduction order
    with RolloutEngine(str(ckpt), **kw) as one:
        b = one.generate(PROMPTS, 2, temperature=1.0, max_new_tokens=8, seed=3)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.logprobs, t.logprobs)) < 1e-4
