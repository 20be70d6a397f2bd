"""Asynchronous trainer (schedule.max_lag > 0) and streaming generation, on real engines.

* streaming: a long response whose generation spans a forced weight swap records two versions,
  in order, with the swap point where vLLM's engine core paused.
* a short async run through the CLI (max_lag=2, 6 updates): every sample's lag <= 2, some tokens
  have lag > 0, metrics carry the lag fields, no vLLM process is left behind.
* w == 1 exactly on lag-0 tokens (samples generated entirely by the learner's current weights)
  in aligned mode, inside the async machinery.
* killing the rollout process makes the learner fail fast with a clear message.
* the rollout on two vLLM servers (rollout.where=servers): the first update equals the local
  rollout process's; a killed server is named within 60 s.
* (slow, RZ_SLOW=1) Ctrl-C (SIGINT to the process group) ends the run and every vLLM process.

One warm-started base model is made once per session and copied into each run dir.
Run: .venv/bin/python -m pytest tests/integration/test_async.py -x -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "schedule.eval_every=0",
    "warm_start.steps=30",
    "task.eval_prompts=24",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.verify_every=1",
    "logging.progress=false",
    "logging.wandb=false",
]
READY = re.compile(r"\[rz\] rollout process pid (\d+) ready \(vLLM pids \[([\d, ]*)\]")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pids, timeout=20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    from megatron_rz.recipe import load_recipe
    from megatron_rz.learner.tiny_models import warm_start

    out = tmp_path_factory.mktemp("async_base") / "base_model"
    recipe = load_recipe(ROOT / "recipes" / "tiny_moe.yaml", SHORT)
    warm_start(recipe, out, seed=recipe.schedule.seed, progress=False)
    return out


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rz.cli", "train", str(ROOT / "recipes" / "tiny_moe.yaml"),
            f"logging.run_dir={run_dir}", *SHORT, *overrides]


def _prep(run_dir: Path, base_model: Path) -> None:
    shutil.copytree(base_model, run_dir / "base_model")


def _env():
    return {**os.environ, "WANDB_MODE": "offline"}


# ------------------------------------------------------------------------------ streaming


def test_streaming_swap_mid_generation_records_two_versions(base_model):
    from safetensors.torch import load_file

    from vllm_bridge.engine import RolloutEngine
    from vllm_bridge.streaming import StreamingGenerator
    from vllm_bridge.weights.buckets import iter_buckets
    from vllm_bridge.weights.filesystem import FilesystemTransport

    sd = load_file(str(base_model / "model.safetensors"))
    new = {k: (v * 1.25 if k.endswith("norm.weight") else v) for k, v in sd.items()}
    # the filesystem transport's version directory, in many small buckets (one staged file each)
    update = FilesystemTransport(base_model.parent / "swap").push(iter_buckets(new.items(), 1 << 16), 1)
    assert len(update.paths) > 3
    with RolloutEngine(str(base_model), max_model_len=64, kv_cache_gb=0.25) as eng:
        gen = StreamingGenerator(eng)
        gen.submit([[5, 6, 7], [8, 9, 10, 11]], n=2, max_new_tokens=56, seed=3, ignore_eos=True, tag="long")
        done, swap = [], None
        while gen.num_in_flight():
            done += gen.step()
            prog = [t for v in gen.progress().values() for t in v]
            if swap is None and len(prog) == 4 and min(prog) >= 2:
                swap = gen.swap_weights(1, update=update)  # forced swap mid-generation
        assert swap is not None and swap["in_flight"] == 2
        assert eng.weight_version == 1
        assert eng.verify_sync(update.named_tensors())["checked"]  # every bucket reached the model
        samples = [s for fg in done for s in fg.samples]
        assert len(samples) == 4
        for s in samples:
            assert len(s.response_ids) == 56
            k = s.versions.count(0)
            # versions go 0...0 then 1...1: one switch, at least 2 tokens before (seen before the
            # swap) and tokens after it
            assert s.versions == [0] * k + [1] * (56 - k), s.versions
            assert 2 <= k < 56
        # a request submitted after the swap is generated entirely by version 1
        gen.submit([[5, 6, 7]], n=2, max_new_tokens=4, seed=1, tag="after")
        assert all(s.versions == [1] * len(s.versions) for fg in gen.drain() for s in fg.samples)

        # A vLLM without per-step weight-version labels (CUDA vLLM 0.26): no swap under requests in
        # flight (refused, nothing changes); after drain() the swap applies and every token carries
        # the version its request was submitted under.
        from vllm_bridge.engine import RolloutEngineError

        gen.in_flight_swaps = False
        gen.submit([[5, 6, 7]], n=2, max_new_tokens=8, seed=2, ignore_eos=True, tag="v1")
        gen.step()
        with pytest.raises(RolloutEngineError, match="in flight needs vLLM's per-step weight-version"):
            gen.swap_weights(2, update=update)
        assert eng.weight_version == 1
        first = gen.drain()
        assert [s.versions for fg in first for s in fg.samples] == [[1] * 8, [1] * 8]
        assert gen.swap_weights(2, update=update)["in_flight"] == 0 and eng.weight_version == 2
        gen.submit([[5, 6, 7]], n=1, max_new_tokens=3, seed=2, ignore_eos=True, tag="v2")
        assert [s.versions for fg in gen.drain() for s in fg.samples] == [[2, 2, 2]]


# ------------------------------------------------------------------------------ async run


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, base_model):
    """Aligned mode when the learner supports it (so the lag-0 w == 1 check can run), else fast."""
    import inspect

    from megatron_rz.learner.learner import Learner

    mode = "aligned" if "mode" in inspect.signature(Learner.__init__).parameters else "fast"
    run_dir = tmp_path_factory.mktemp("async") / "run"
    _prep(run_dir, base_model)
    out = subprocess.run(_cmd(run_dir, "schedule.steps=6", "schedule.max_lag=2", f"mode={mode}",
                              "schedule.eval_every=2"),
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    return run_dir, out, mode


def test_async_run_lag_bound_and_metrics(async_run):
    run_dir, out, _ = async_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "lag_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["weight_version"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        for key in ("lag_mean", "lag_max", "sample_lag_mean", "frac_tokens_lag_0", "frac_tokens_lag_1",
                    "frac_tokens_lag_2", "time_rollout_wait", "time_learner", "time_sync",
                    "samples_per_s", "tokens_per_s", "reward_mean", "max_abs_dlogp"):
            assert key in r, (key, r)
        assert r["lag_max"] <= 2  # every sample's oldest token is within the bound
        assert abs(r["frac_tokens_lag_0"] + r["frac_tokens_lag_1"] + r["frac_tokens_lag_2"] - 1.0) < 1e-9
        assert r["tokens"] > 0 and r["samples_per_s"] > 0
    assert max(r["lag_max"] for r in train) > 0
    assert sum(r["lag_mean"] for r in train) > 0  # some tokens were generated by older weights
    assert train[0]["lag_max"] == 0  # the first batch can only come from version 0
    # periodic evaluations (eval_every=2) in the rollout process: one at a version in [2, 4), one in
    # [4, 6) (version 6's is the final one), each logged (with a training row, or at the end when it
    # came after the last one) with its weights' version
    evs = [r for r in rows if "eval_version" in r]
    assert [r["eval_version"] // 2 for r in evs] == [1, 2], evs
    for r in evs:
        assert r["step"] >= r["eval_version"] and 0.0 <= r["eval_reward"] <= 1.0, r
        assert any(k.startswith("eval/") and k.endswith("/greedy") for k in r), r
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["max_lag"] == 2 and summary["lag_max"] <= 2
    assert 0.0 <= summary["eval_reward_after"] <= 1.0
    assert (run_dir / "hf_final" / "model.safetensors").is_file()
    assert not (run_dir / "rollout" / "weights").exists()  # weight files cleaned up
    m = READY.search(out.stdout)
    assert m, out.stdout[-2000:]
    pids = [int(m.group(1))] + [int(p) for p in m.group(2).split(",") if p.strip()]
    assert _wait_gone(pids, 5) == []  # rollout process and its vLLM processes are gone


def test_async_fast_mode_verifies_every_sync(tmp_path, base_model):
    """mode=fast through the rollout process (max_lag=1), every sync verified (SHORT: verify_every=1).
    A stock class's worker takes each checkpoint tensor's bits as loaded, before vLLM packs it, only
    once its layout was asked: the rollout process once asked after the first swap, so every fast
    async run stopped at its first sync (WeightSyncError, 69/69 "not reported")."""
    run_dir = tmp_path / "run"
    _prep(run_dir, base_model)
    out = subprocess.run(_cmd(run_dir, "schedule.steps=3", "schedule.max_lag=1", "mode=fast"),
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows if "lag_mean" in r] == [1, 2, 3]


def test_async_lag0_tokens_have_w_exactly_one_in_aligned_mode(async_run):
    run_dir, out, mode = async_run
    if mode != "aligned":
        pytest.skip("Learner(mode=...) not available yet: aligned learner mode is needed for w == 1 exactly")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pure = [r for r in rows if r.get("lag0_pure_tokens", 0) > 0]
    assert pure, "no batch had samples generated entirely by the learner's current weights"
    for r in pure:
        # w = exp(logp_learner - logp_rollout) == 1 exactly on every such token
        assert r["lag0_pure_frac_bitwise"] == 1.0 and r["lag0_pure_max_abs_dlogp"] == 0.0, r


# ------------------------------------------------------------------------------ failures


def _start(run_dir: Path, *overrides: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(_cmd(run_dir, *overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=ROOT, start_new_session=True)
    lines = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = READY.search(line)
        if m:
            return proc, [int(m.group(1))] + [int(p) for p in m.group(2).split(",") if p.strip()]
    proc.kill()
    raise AssertionError("rollout never became ready:\n" + "".join(lines)[-3000:] + proc.stderr.read()[-3000:])


RESTARTED = re.compile(r"\[rz\] rollout engine restarted in the rollout process \(vLLM pids \[([\d, ]*)\], "
                       r"weights version (\d+), restart 1 of 2\)")


def _rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's complete rows so far (a row being written is not one yet)."""
    f = run_dir / "metrics.jsonl"
    text = f.read_text() if f.exists() else ""
    return [json.loads(x) for x in text.split("\n")[:-1] if x.strip()]


def test_rollout_engine_death_is_restarted_then_killing_rollout_process_fails_learner_fast(tmp_path, base_model):
    """Two faults in one asynchronous run (max_lag 1). (1) SIGKILL of the rollout process's vLLM
    engine core: the rollout process restarts its engine with the newest weights it applied
    (their bucket files were kept for this), redoes the unfinished batches and tells the learner
    the new engine's processes; training goes on within the lag bound. (2) SIGKILL of the rollout
    process itself: the learner stops fast, naming it, and no vLLM process (old or new) is left."""
    import threading

    run_dir = tmp_path / "run"
    _prep(run_dir, base_model)
    proc, pids = _start(run_dir, "schedule.steps=500", "schedule.max_lag=1")
    import queue

    err: list[str] = []
    drain = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)  # vLLM logs: never a full pipe
    drain.start()
    out: queue.Queue = queue.Queue()  # stdout lines read beside the test: its deadline holds even if the run hangs
    reader = threading.Thread(target=lambda: [out.put(x) for x in iter(proc.stdout.readline, "")] + [out.put(None)],
                              daemon=True)
    reader.start()
    train = lambda: [r for r in _rows(run_dir) if "lag_max" in r]  # noqa: E731
    try:
        deadline = time.monotonic() + 300
        # Wait for a batch sampled wholly past version 0 (its oldest token's version, the learner's
        # version before the update minus lag_max, >= 1): then the rollout process has applied newer
        # weights. Two rows alone do not show it at max_lag 1 (both may be version-0 samples).
        applied = lambda: any(r["weight_version"] - 1 - r["lag_max"] >= 1 for r in train())  # noqa: E731
        while time.monotonic() < deadline and not applied():
            time.sleep(0.2)
        assert applied(), train()[-2:]
        os.kill(pids[1], signal.SIGKILL)  # the engine core
        lines, m = [], None
        while time.monotonic() < deadline and m is None:
            try:
                line = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            lines.append(line)
            m = RESTARTED.search(line)
        assert m, "".join(lines)[-3000:]
        assert any("[rz] rollout engine died in the rollout process" in x for x in lines), "".join(lines)[-3000:]
        assert int(m.group(2)) >= 1  # the newest applied weights, not the base model's
        new_pids = [int(p) for p in m.group(1).split(",") if p.strip()]
        assert new_pids and not set(new_pids) & set(pids)
        seen = len(train())
        while time.monotonic() < deadline and len(train()) < seen + 2:
            time.sleep(0.2)  # updates on batches of the new engine
        rows = train()
        assert len(rows) >= seen + 2, (seen, rows[-2:])
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and all(r["lag_max"] <= 1 for r in rows)
        pids += new_pids
        os.kill(pids[0], signal.SIGKILL)  # the rollout process
        t0 = time.monotonic()
        proc.wait(timeout=90)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    drain.join(30)
    stderr = "".join(err)
    assert proc.returncode != 0
    assert "RolloutProcessError" in stderr and f"rollout process (pid {pids[0]}) exited with code -9" in stderr, stderr[-3000:]
    assert took < 60, took
    assert _wait_gone(pids, 10) == []  # no orphaned vLLM engine core / worker, old or new


@pytest.mark.slow
def test_ctrl_c_ends_rollout_and_vllm(tmp_path, base_model):
    run_dir = tmp_path / "run"
    _prep(run_dir, base_model)
    proc, pids = _start(run_dir, "schedule.steps=500", "schedule.max_lag=2")
    try:
        time.sleep(3.0)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert _wait_gone(pids, 20) == []


# ------------------------------------------------------------------------------ vLLM servers


def _start_servers(run_dir: Path, nodes: list[str], log_dir: Path, *overrides: str) -> list[subprocess.Popen]:
    """`python -m vllm_bridge.serve` per "node" with the recipe's engine settings (what an rz submit
    job's rollout nodes run), recording themselves under RUN_DIR/rollout/servers."""
    import socket

    from megatron_rz.recipe import load_recipe
    from vllm_bridge.server_client import write_key

    recipe = load_recipe(ROOT / "recipes" / "tiny_moe.yaml", [*SHORT, *overrides])
    engine_args = {k: v for k, v in recipe.engine_kwargs().items() if k != "aligned"}
    key = write_key(run_dir)
    procs = []
    for i, node in enumerate(nodes):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {**_env(), "PYTHONPATH": str(ROOT), "VLLM_CPU_OMP_THREADS_BIND": str(i % 2)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "vllm_bridge.serve", str(run_dir / "base_model"), "--host", "127.0.0.1",
             "--port", str(port), "--key-file", str(key), "--engine-args", json.dumps(engine_args),
             "--aligned" if recipe.mode == "aligned" else "--no-aligned", "--node", node,
             "--record", str(run_dir / "rollout" / "servers" / f"{node}.json")],
            cwd=ROOT, env=env, stdout=open(log_dir / f"{node}.log", "w"), stderr=subprocess.STDOUT,
            start_new_session=True))
    return procs


def _stop_servers(procs: list[subprocess.Popen]) -> None:
    import contextlib

    for p in procs:  # each server leads its own session: its engine core too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def test_async_trainer_on_two_vllm_servers(tmp_path, base_model, async_run):
    """max_lag > 0 with the rollout on two vLLM servers (an rz submit job's rollout nodes, here two
    processes on this machine; rollout.where=servers): the rollout process drives them through the
    server client's stream (in-flight swaps over /pause), the weights travel as bucket files. The
    first batch (version 0 everywhere) is the one the local rollout process made: the first update
    is the same to the last bit."""
    run_dir = tmp_path / "run"
    _prep(run_dir, base_model)
    local_dir, _, mode = async_run
    over = ("schedule.steps=3", "schedule.max_lag=2", f"mode={mode}", "rollout.where=servers", "rollout.num_engines=2",
            "rollout.server_wait_s=480")  # two engines starting beside two other test workers: 240 s was once short
    servers = _start_servers(run_dir, ["nodeA", "nodeB"], tmp_path, *over)
    try:
        out = subprocess.run(_cmd(run_dir, *over), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    finally:
        _stop_servers(servers)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert re.search(r"rollout on 2 vLLM server\(s\): nodeA .*nodeB", out.stdout), out.stdout[-2000:]
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "lag_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["lag_max"] <= 2 and r["tokens"] > 0 for r in rows), rows
    local = [r for r in map(json.loads, (local_dir / "metrics.jsonl").read_text().splitlines()) if "lag_mean" in r]
    for key in ("reward_mean", "response_len", "loss", "grad_norm", "max_abs_dlogp", "tokens"):
        assert rows[0][key] == local[0][key], (key, rows[0][key], local[0][key])
    if mode == "aligned":
        for r in rows:
            if r.get("lag0_pure_tokens", 0):
                assert r["lag0_pure_frac_bitwise"] == 1.0, r
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    assert not (run_dir / "rollout" / "weights").exists()


def test_lost_vllm_server_fails_async_learner_naming_it(tmp_path, base_model):
    run_dir = tmp_path / "run"
    _prep(run_dir, base_model)
    # a loaded 2-core box: one server start took more than 240 s in a fresh-clone run
    over = ("schedule.steps=500", "schedule.max_lag=1", "rollout.where=servers", "rollout.server_wait_s=480")
    (server,) = _start_servers(run_dir, ["nodeC"], tmp_path, *over)
    try:
        proc = subprocess.Popen(_cmd(run_dir, *over), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env(), cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists():
            time.sleep(0.5)
        time.sleep(2.0)  # training under way
        os.killpg(server.pid, signal.SIGKILL)  # the node goes away
        t0 = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _stop_servers([server])
    assert proc.returncode != 0
    assert "RolloutProcessError" in stderr and "nodeC" in stderr, stderr[-3000:]
    assert took < 60, took
