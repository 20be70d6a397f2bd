"""Every parameter verified after every sync, on a real vLLM-CPU engine (aligned tiny Qwen3-MoE), and
the engine-restart rules through the real loop with a really killed engine.

One engine for the module, held by the loop's own InlineRollout (megatron_rz/loop/rollout.py), in
file order:

* Random single-byte flips, each in a byte drawn uniformly from all the bytes a sync carries (so a
  parameter is drawn with probability proportional to its size: experts, attention, embeddings,
  norms, router), injected into the transfer of a real sync through each transport available on
  CPU: in-process (the safetensors bytes handed to the engine), filesystem (a bucket file on disk,
  the path a remote engine takes in the loop), resharded (a part file; reshard.check_resharded), and
  with RZ_TEST_VERIFY_SERVER=1 a `vllm serve` server. Then flips of a byte of a parameter inside the
  engine after a clean sync (rz_flip_byte). Each must raise WeightSyncError naming exactly that
  parameter (N/N caught); a clean sync of the same weights passes (no false alarm).
* mode=fast (a stock-class engine on the same checkpoint, for its test class only): every one of the
  69 checkpoint tensors verified although vLLM holds them packed (q/k/v, gate/up), stacked (experts)
  or, on CPU, moved into oneDNN / sgl / CPU-MoE packs (checked as loaded); flips drawn over all the
  bytes of the sync, one flip in each of the 69 tensors, and in-memory flips in every parameter the
  stock engine still holds as loaded: N/N caught.
* The remote-engine rule: the same engine given to InlineRollout as a remote one (not restartable),
  its engine core SIGKILLed: fetch_batch stops with the engine's error, no restart.
* The restart budget (schedule.engine_restarts=2): the loop's own rollout, whose engine is now dead:
  fetch_batch starts a new engine, pushes the current weights (verified) and re-runs the batch,
  which equals the batch the first engine produced before it died (torch.equal logprobs); the new
  engine then stuck (its core SIGSTOPped: alive, no token) is named after rollout.stall_timeout_s and
  replaced the same way, the batch again equal; a third failure stops the run: no fourth engine.

Counts: RZ_VERIFY_FLIPS (per transport, default 8), RZ_VERIFY_ENGINE_FLIPS (default 30);
RZ_VERIFY_FLIPS_OUT=path.json writes the counts and timings (benchmarks/results/verify_flips_cpu.json:
see docs/architecture.md "Reliability" for the command).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import struct
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
SETS = ["schedule.engine_restarts=2", "rollout.stall_timeout_s=60", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4", "rollout.max_num_seqs=8", "rollout.kv_cache_gb=0.25", "task.eval_prompts=4"]
FLIPS = int(os.environ.get("RZ_VERIFY_FLIPS", "8"))
ENGINE_FLIPS = int(os.environ.get("RZ_VERIFY_ENGINE_FLIPS", "30"))
REPORT: dict = {"flips": {}}


class _Learner:
    """The learner as fetch_batch sees it: a version and its weights as an HF-named stream (the
    trained state dict), what the restart path re-pushes."""

    def __init__(self, sd: dict, version: int):
        self.sd, self.version = sd, version

    def export_hf_weights(self):
        return iter(self.sd.items())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from safetensors.torch import load_file

    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from megatron_rz.loop.rollout import InlineRollout
    from megatron_rz.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("verify")
    recipe = load_recipe(str(ROOT / "recipes" / "tiny_moe.yaml"), SETS + [f"logging.run_dir={tmp / 'run'}"])
    base = tmp / "base"
    make_random_checkpoint(recipe, base, seed=0)
    t0 = time.perf_counter()
    rollout = InlineRollout(recipe, base, tmp / "run", 0, 0)
    REPORT["engine_start_s"] = time.perf_counter() - t0
    sd = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    trained = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    yield {"recipe": recipe, "base": base, "run": tmp / "run", "rollout": rollout, "sd": trained, "tmp": tmp}
    rollout.close()
    out = os.environ.get("RZ_VERIFY_FLIPS_OUT")
    if out:
        Path(out).write_text(json.dumps(REPORT, indent=1) + "\n")
    print("\nverify report:", json.dumps(REPORT))


def _buckets(sd: dict):
    from vllm_bridge.weights.buckets import iter_buckets

    return iter_buckets(sd.items(), 256 << 10)  # several buckets, as a larger model's stream


def _safetensors_spans(raw: bytes | bytearray) -> tuple[int, list[tuple[str, int, int]]]:
    """(data start, [(name, begin, end)]) of a safetensors serialisation (offsets into the data)."""
    n = struct.unpack("<Q", bytes(raw[:8]))[0]
    header = json.loads(bytes(raw[8:8 + n]))
    return 8 + n, [(k, *v["data_offsets"]) for k, v in header.items() if k != "__metadata__"]


def _flip_in(raws: list[bytearray], rng: random.Random) -> str:
    """Flip one byte drawn uniformly from the tensor data of ``raws`` (serialised safetensors);
    returns the tensor it belongs to (its name before any '@box')."""
    spans = []
    for i, raw in enumerate(raws):
        start, items = _safetensors_spans(raw)
        spans += [(i, start + b, e - b, name) for name, b, e in items]
    total = sum(s[2] for s in spans)
    pos = rng.randrange(total)
    for i, off, size, name in spans:
        if pos < size:
            raws[i][off + pos] ^= rng.randrange(1, 256)
            return name.split("@")[0]
        pos -= size
    raise AssertionError("unreachable")


def _flip_files(paths: list, rng: random.Random) -> str:
    """One byte flipped, drawn uniformly from the tensor data of all the files."""
    raws = [bytearray(Path(p).read_bytes()) for p in paths]
    before = [bytes(r) for r in raws]
    name = _flip_in(raws, rng)
    for p, raw, old in zip(paths, raws, before):
        if raw != old:
            Path(p).write_bytes(bytes(raw))
    return name


def _count(kind: str, n: int, names: list, t: float) -> None:
    REPORT["flips"][kind] = {"caught": n, "n": n, "distinct_parameters": len(set(names)), "s": round(t, 2),
                             "kinds": _kinds(names)}
    print(f"\n[{kind}] {n}/{n} flips caught ({len(set(names))} distinct parameters, {t:.1f} s): {_kinds(names)}")


def _kinds(names: list) -> dict:
    out: dict = {}
    for n in names:
        k = ("experts" if ".experts." in n else "attention" if "_proj" in n else "embeddings" if "embed" in n
             else "lm_head" if "lm_head" in n else "router" if "mlp.gate" in n else "norms" if "norm" in n else n)
        out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def _expect_caught(fn, name) -> str:
    """fn() must raise WeightSyncError naming exactly the flipped parameter (``name``: a str, or a
    function giving it once fn ran) and no other: one line."""
    from vllm_bridge.weights.buckets import WeightSyncError

    with pytest.raises(WeightSyncError) as e:
        fn()
    name = name if isinstance(name, str) else name()
    msg = str(e.value)
    assert f"rank 0 {name} (bytes differ)" in msg and " 1/69 " in msg and "\n" not in msg, msg
    return name


# ------------------------------------------------------------------ every parameter, every transport


def test_clean_sync_verifies_every_parameter(setup):
    ro, sd = setup["rollout"], setup["sd"]
    runs = [ro.push_weights(_buckets(sd), 1, verify=True) for _ in range(3)]  # the first one warms up
    info = sorted(runs[1:], key=lambda x: x["total_s"])[0]
    v = info["verify"]
    assert v["checked"] == len(sd) == 69 and v["unverified"] == 0
    assert v["bytes"] == sum(t.numel() * t.element_size() for t in sd.values())
    REPORT["clean_sync"] = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in v.items()}
    REPORT["clean_sync"]["sync_total_s"] = round(info["total_s"], 4)
    print(f"\nclean sync: {v['checked']} parameters ({v['bytes']} bytes) verified; learner side {v['learner_s']:.4f} s, "
          f"engine read-back {v['engine_s']:.4f} s; the sync itself {info['total_s']:.3f} s")


def _flips_in_process(ro, sd, rng, monkeypatch, kind: str, v0: int) -> None:
    """FLIPS syncs through the loop's in-process push, each with one byte of the safetensors bytes
    handed to the engine flipped: each caught, naming the tensor; then a clean sync passes."""
    import vllm_bridge.weights.inprocess as tr

    real = tr.to_safetensors
    names, t0 = [], time.perf_counter()
    for i in range(FLIPS):
        payloads = [bytearray(real(b)) for b in _buckets(sd)]
        name = _flip_in(payloads, rng)
        it = iter(payloads)
        monkeypatch.setattr(tr, "to_safetensors", lambda b: bytes(next(it)))  # the corrupted transfer
        names.append(_expect_caught(lambda: ro.push_weights(_buckets(sd), v0 + i, verify=True), name))
        monkeypatch.setattr(tr, "to_safetensors", real)
    _count(kind, FLIPS, names, time.perf_counter() - t0)
    assert ro.push_weights(_buckets(sd), v0 + FLIPS, verify=True)["verify"]["checked"] == 69  # clean again


def test_flips_in_process(setup, monkeypatch):
    """The loop's in-process push (InlineRollout.push_weights -> InProcessTransport), one byte of
    the safetensors bytes handed to the engine flipped."""
    _flips_in_process(setup["rollout"], setup["sd"], random.Random(11), monkeypatch, "inprocess", 2)


def test_flips_filesystem(setup, monkeypatch):
    """The loop's filesystem path (rollout.weight_transport=filesystem, what the job's vLLM servers
    get: bucket files on the run directory that the workers read), over an engine the rollout did
    not start; one byte of the files flipped before the workers read them."""
    from megatron_rz.loop.rollout import InlineRollout
    from vllm_bridge.weights.filesystem import FilesystemTransport

    recipe = setup["recipe"].model_copy(deep=True)
    recipe.rollout.weight_transport = "filesystem"
    remote = InlineRollout(recipe, setup["base"], setup["run"], 0, 0, engine=setup["rollout"].engine)
    assert not remote.side.restartable and isinstance(remote.transport, FilesystemTransport)
    sd, rng = setup["sd"], random.Random(12)
    real_apply = FilesystemTransport.apply
    hit: list[str] = []

    def corrupted(update, engine):
        hit.append(_flip_files(update.paths, rng))
        return real_apply(update, engine)

    t0 = time.perf_counter()
    for i in range(FLIPS):
        monkeypatch.setattr(FilesystemTransport, "apply", staticmethod(corrupted))
        _expect_caught(lambda: remote.push_weights(_buckets(sd), 200 + i, verify=True), lambda: hit[-1])
        monkeypatch.setattr(FilesystemTransport, "apply", staticmethod(real_apply))
    assert len(hit) == FLIPS
    _count("filesystem", FLIPS, hit, time.perf_counter() - t0)
    assert remote.push_weights(_buckets(sd), 300, verify=True)["verify"]["checked"] == 69


def _write_resharded(sd: dict, layout, transport, version: int) -> dict:
    """One learner rank holding every full tensor: megatron_rz.loop.weights.write_resharded's steps (plan, parts,
    expected checksums, commit) on a state dict, through the real reshard module."""
    from vllm_bridge.weights import reshard

    pieces = [[reshard.Piece(n, tuple(t.shape), reshard.full_box(t.shape), str(t.dtype).replace("torch.", ""))
               for n, t in sd.items()]]
    transfers = reshard.plan(pieces, layout)
    transport.prepare(version)
    parts: dict = {}
    sent = []
    for t in transfers:
        x = reshard.narrow(sd[t.name], reshard.relative(t.box, t.piece_box))
        parts.setdefault(t.engine_rank, {})[reshard.box_key(t.name, t.box)] = x
        sent.append(x)
    transport.write(version, 0, parts)
    return {"update": transport.commit(version, 1), "expected": reshard.expected_checksums(transfers, sent, layout)}


def test_flips_resharded(setup, monkeypatch):
    """The loop's resharded apply (InlineRollout.apply_resharded, reshard.check_resharded), one byte of
    the part files flipped before the workers read them. The rollout holds the transport a
    rollout.weight_transport=reshard recipe gives it (the same engine as the other flips)."""
    from vllm_bridge.weights import make_transport
    from vllm_bridge.weights.buckets import WeightSyncError

    ro, sd, rng = setup["rollout"], setup["sd"], random.Random(13)
    monkeypatch.setattr(ro, "transport", make_transport("reshard", run_dir=setup["run"]))
    layout, directory = ro.reshard_target()
    transport = ro.transport
    assert Path(directory) == transport.directory
    names, t0 = [], time.perf_counter()
    for i in range(FLIPS):
        written = _write_resharded(sd, layout, transport, 400 + i)
        name = _flip_files(sorted(Path(written["update"].directory).rglob("part-*.safetensors")), rng)
        with pytest.raises(WeightSyncError) as e:
            ro.apply_resharded(written, verify=True)
        assert f"rank 0 {name} (bytes differ)" in str(e.value) and " 1/69 engine parameters" in str(e.value), e.value
        names.append(name)
    _count("reshard", FLIPS, names, time.perf_counter() - t0)
    assert ro.apply_resharded(_write_resharded(sd, layout, transport, 500), verify=True)["verify"]["checked"] == 69


def test_flips_inside_the_engine_after_a_sync(setup):
    """A clean sync, then one byte of one parameter changed in the engine's memory (drawn uniformly
    over all the bytes the engine holds): the every-parameter check names it; undone, it passes."""
    from vllm_bridge.weights.verify import SyncCheck

    ro, sd, rng = setup["rollout"], setup["sd"], random.Random(14)
    ro.push_weights(_buckets(sd), 600, verify=True)
    check = SyncCheck(SyncCheck.layout_of(ro.engine)).named(sd.items())
    sizes = {n: t.numel() * t.element_size() for n, t in sd.items()}
    order = sorted(sizes)
    names, t0 = [], time.perf_counter()
    for _ in range(ENGINE_FLIPS):
        name = rng.choices(order, weights=[sizes[n] for n in order])[0]
        index, xor = rng.randrange(sizes[name]), rng.randrange(1, 256)
        assert ro.engine.collective_rpc("rz_flip_byte", name, index, xor) == [True]
        names.append(_expect_caught(lambda: check.verify(ro.engine, 600), name))
        ro.engine.collective_rpc("rz_flip_byte", name, index, xor)  # undo
    _count("engine_memory", ENGINE_FLIPS, names, time.perf_counter() - t0)
    assert check.verify(ro.engine, 600)["checked"] == 69


@pytest.mark.skipif(os.environ.get("RZ_TEST_VERIFY_SERVER") != "1",
                    reason="opt-in (RZ_TEST_VERIFY_SERVER=1): starts a `vllm serve` server, ~40 s")
def test_flips_through_a_vllm_server(setup):
    """The server transport (bucket files the server's workers read, checksums over HTTP)."""
    import contextlib
    import socket
    import subprocess
    import sys

    from vllm_bridge.server_client import connect, write_key
    from vllm_bridge.weights.filesystem import FilesystemTransport
    from vllm_bridge.weights.verify import SyncCheck

    tmp, sd, rng = setup["tmp"], setup["sd"], random.Random(15)
    run_dir = tmp / "server_run"
    key = write_key(run_dir)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine_args = {k: v for k, v in setup["recipe"].engine_kwargs().items() if k != "aligned"}
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_bridge.serve", str(setup["base"]), "--host", "127.0.0.1", "--port", str(port),
         "--key-file", str(key), "--engine-args", json.dumps(engine_args), "--aligned", "--node", "nodeV",
         "--record", str(run_dir / "rollout" / "servers" / "nodeV.json")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        client = connect(run_dir, expected=1, wait_s=600, health_every_s=1.0, dead_after_s=30.0)
        fs = FilesystemTransport(run_dir / "rollout" / "weights")
        layout = SyncCheck.layout_of(client)
        names, t0 = [], time.perf_counter()
        for i in range(FLIPS):
            check = SyncCheck(layout)
            update = fs.push(check.stream(_buckets(sd)), 700 + i)
            name = _flip_files(update.paths, rng)
            client.apply_weights(update.paths, update.version)
            fs.release(update)
            names.append(_expect_caught(lambda: check.verify(client, update.version), name))
        _count("server", FLIPS, names, time.perf_counter() - t0)
        assert client.update_weights(sd.items(), 800, verify=True)["verify"]["checked"] == 69
        client.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------ stock vLLM classes (mode=fast)


@pytest.fixture(scope="class")
def fast(setup):
    """A stock-class engine (mode=fast) on the same checkpoint, for this class only (closed at its end):
    its q/k/v packed in qkv_proj, gate/up in gate_up_proj, experts stacked in w13/w2, and on CPU the
    linears (router included) moved into oneDNN / sgl packs and the MoE stacks re-laid out."""
    from megatron_rz.loop.rollout import InlineRollout

    recipe = setup["recipe"].model_copy(deep=True)
    recipe.mode = "fast"
    t0 = time.perf_counter()
    ro = InlineRollout(recipe, setup["base"], setup["tmp"] / "fast_run", 0, 0)
    REPORT["fast_engine_start_s"] = round(time.perf_counter() - t0, 1)
    assert not ro.engine.aligned
    yield ro
    ro.close()


class TestFastMode:
    """mode=fast: every checkpoint tensor verified too (worker_ext.stock_pieces: where vLLM's own
    loaders put it; the bits taken as loaded where vLLM then packs it away)."""

    def test_clean_sync_verifies_every_checkpoint_tensor(self, setup, fast):
        from vllm_bridge.weights.verify import SyncCheck

        sd = setup["sd"]
        seqs = [[5, 6, 7, 8, 9, 10], [3, 4, 30, 31, 2]]
        before = fast.engine.score(seqs)
        layout = SyncCheck.layout_of(fast.engine)  # the dry run of the loaders (meta tensors)
        assert fast.engine.score(seqs) == before  # ... changed nothing in the model
        (report,) = layout
        assert sorted(report["params"]) == sorted(sd) and report["unverified"] == {}
        shapes = fast.engine.collective_rpc("rz_param_shapes")[0]
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == [0]  # on CPU: moved into a oneDNN pack
        assert len(shapes["model.layers.0.mlp.experts.routed_experts.w13_weight"]) == 3  # stacked experts
        runs = [fast.push_weights(_buckets(sd), 1, verify=True) for _ in range(2)]
        v = runs[-1]["verify"]
        assert v["checked"] == 69 and v["unverified"] == 0 and v["unverified_bytes"] == 0
        assert v["bytes"] == sum(t.numel() * t.element_size() for t in sd.values())
        live = fast.engine.collective_rpc("rz_live_pieces")[0]
        assert v["at_load"] == 69 - sum(len(x) for x in live.values()) > 0
        # the engine now computes with the synced weights (the hook only reads)
        new = fast.engine.score(seqs)
        assert new != before
        fast.push_weights(_buckets(sd), 2, verify=True)
        assert fast.engine.score(seqs) == new
        REPORT["fast_clean_sync"] = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in v.items()}
        print(f"\nfast mode clean sync: {v['checked']} checkpoint tensors ({v['bytes']} bytes) verified, "
              f"{v['at_load']} of them as loaded (packed after loading), {len(live)} read back live")

    def test_flips_in_process(self, setup, fast, monkeypatch):
        """Flips drawn uniformly over all the bytes of the sync, so over every checkpoint tensor by size:
        q/k/v, o, router (all oneDNN/sgl-packed on CPU), experts (stacked, CPU-packed), embeddings, norms."""
        _flips_in_process(fast, setup["sd"], random.Random(21), monkeypatch, "fast_inprocess", 2)

    def test_a_flip_in_every_checkpoint_tensor(self, setup, fast, monkeypatch):
        """One flipped byte (drawn within the tensor) in each of the 69 checkpoint tensors in turn,
        through the in-process push: every kind of stock layout is hit, not only the large experts."""
        import vllm_bridge.weights.inprocess as tr

        sd, rng = setup["sd"], random.Random(23)
        real = tr.to_safetensors
        names, t0 = [], time.perf_counter()
        for i, target in enumerate(sorted(sd)):
            payloads = [bytearray(real(b)) for b in _buckets(sd)]
            for raw in payloads:
                start, items = _safetensors_spans(raw)
                for name, b, e in items:
                    if name == target:
                        raw[start + b + rng.randrange(e - b)] ^= rng.randrange(1, 256)
            it = iter(payloads)
            monkeypatch.setattr(tr, "to_safetensors", lambda b: bytes(next(it)))
            names.append(_expect_caught(lambda: fast.push_weights(_buckets(sd), 50 + i, verify=True), target))
            monkeypatch.setattr(tr, "to_safetensors", real)
        _count("fast_every_tensor", len(names), names, time.perf_counter() - t0)
        assert sorted(names) == sorted(sd)
        assert fast.push_weights(_buckets(sd), 200, verify=True)["verify"]["checked"] == 69

    def test_flips_inside_the_engine_after_a_sync(self, setup, fast):
        """In-memory flips in every parameter the stock engine still holds as loaded (rz_live_pieces,
        drawn by size) are caught. The packed copies (oneDNN handles, CPU MoE packs) are checked as
        loaded: a later change of their memory is outside this check."""
        from vllm_bridge.shards import box_numel
        from vllm_bridge.weights.verify import SyncCheck

        sd, rng = setup["sd"], random.Random(22)
        fast.push_weights(_buckets(sd), 600, verify=True)
        check = SyncCheck(SyncCheck.layout_of(fast.engine)).named(sd.items())
        live = fast.engine.collective_rpc("rz_live_pieces")[0]
        shapes = fast.engine.collective_rpc("rz_param_shapes")[0]
        itemsize = sd[next(iter(sd))].element_size()
        sizes = {n: math.prod(shapes[n]) * itemsize for n in live}
        order = sorted(sizes)
        names, t0 = [], time.perf_counter()
        for _ in range(ENGINE_FLIPS):
            param = rng.choices(order, weights=[sizes[n] for n in order])[0]
            index, xor = rng.randrange(sizes[param]), rng.randrange(1, 256)
            flat = index // itemsize
            pos = []
            for s in reversed(shapes[param]):
                pos.append(flat % s)
                flat //= s
            pos = pos[::-1]
            name = next(n for n, box in live[param] if all(a <= x < b for x, (a, b) in zip(pos, box)))
            assert all(box_numel(box) for _, box in live[param])
            assert fast.engine.collective_rpc("rz_flip_byte", param, index, xor) == [True]
            names.append(_expect_caught(lambda: check.verify(fast.engine, 600), name))
            fast.engine.collective_rpc("rz_flip_byte", param, index, xor)  # undo
        _count("fast_engine_memory", ENGINE_FLIPS, names, time.perf_counter() - t0)
        assert check.verify(fast.engine, 600)["checked"] == 69


# ------------------------------------------------------------------ engine death, through the loop


def _kill_cores(engine) -> list[int]:
    pids = list(engine.engine_pids())
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def test_remote_engine_is_not_restarted(setup):
    """InlineRollout over an engine it did not start (the rule for vLLM servers: their hosts' business):
    its engine core SIGKILLed, fetch_batch stops with the engine's error and starts nothing."""
    from megatron_rz.loop.rollout import InlineRollout
    from megatron_rz.loop.trainer import build_batch, fetch_batch
    from vllm_bridge.engine import RolloutEngineError

    ro, sd = setup["rollout"], setup["sd"]
    ro.push_weights(_buckets(sd), 1, verify=True)
    samples, _ = ro.batch(0)  # batch 0 at version 1, from the first engine
    setup["batch_before"] = build_batch(samples, ro.pad_id)
    engine = ro.engine
    remote = InlineRollout(setup["recipe"], setup["base"], setup["run"], 0, 0, engine=engine)
    _kill_cores(engine)
    with pytest.raises(RolloutEngineError):
        fetch_batch(_Learner(sd, 1), remote, 0, 0, 0)
    assert remote.restarts == 0 and remote.engine is engine and engine.dead_reason() is not None


def test_restart_budget_through_the_loop(setup, capsys):
    """schedule.engine_restarts=2, the loop's own (restartable) rollout, its engine dead (above):
    fetch_batch starts a new engine, pushes version 1 (verified: every parameter) and re-runs batch
    0, which equals the first engine's bit for bit. The new engine stuck (its engine core stopped
    with SIGSTOP: alive, no token): named within its stall bound (3 s), replaced, batch 0 equal
    again. The third engine killed too: the run stops, no fourth engine."""
    from megatron_rz.loop.trainer import fetch_batch
    from vllm_bridge.engine import RolloutEngineError

    ro, sd = setup["rollout"], setup["sd"]
    want = setup["batch_before"]

    def same_batch(batch, what):
        for f in ("input_ids", "loss_mask", "old_logprobs", "versions", "rewards"):
            assert torch.equal(getattr(batch, f), getattr(want, f)), f"{what}: the re-run batch's {f} differs"

    first = ro.engine
    assert first.dead_reason() is not None
    t0 = time.perf_counter()
    batch, _ = fetch_batch(_Learner(sd, 1), ro, 0, 0, 0)
    REPORT["restart_s"] = round(time.perf_counter() - t0, 1)
    out = capsys.readouterr().out
    assert ro.restarts == 1 and ro.engine is not first and ro.engine.weight_version == 1
    assert "rollout engine died during update 1" in out and "restart 1 of 2" in out, out
    same_batch(batch, "after a death")
    second = ro.engine
    assert second.stall_timeout_s == 60  # from the recipe, through the restart
    second.stall_timeout_s = 3  # a fresh engine's first steps may take seconds on a busy box: short here only
    stopped = list(second.engine_pids())
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        batch, _ = fetch_batch(_Learner(sd, 1), ro, 0, 0, 0)
        REPORT["stuck_restart_s"] = round(time.perf_counter() - t0, 1)
    finally:
        for pid in stopped:  # (close() killed them; a survivor must not stay stopped)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    out = capsys.readouterr().out
    assert ro.restarts == 2 and ro.engine is not second and ro.engine.weight_version == 1
    assert "alive but stuck" in out and "rollout.stall_timeout_s=3" in out and "restart 2 of 2" in out, out
    same_batch(batch, "after a stall")
    third = ro.engine
    _kill_cores(third)
    with pytest.raises(RolloutEngineError):
        fetch_batch(_Learner(sd, 1), ro, 0, 0, 0)
    assert ro.restarts == 2 and ro.engine is third  # the budget is spent: no fourth engine
