"""rollout.weight_transport: the one choice of how weights reach the engines (vllm_bridge/weights).

The compatibility table is stated here independently of the code (which pairs a user may pick),
and every transport x engine placement x mode is tried through the recipe: a supported pair builds
its transport (the right class, the run's one weights directory), an unsupported one is refused
in one line naming the key, the setting in the way and the fix. The old key gets a pointer to the
new one, and no module outside the package constructs a transport."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny_moe.yaml")
PLACEMENTS = {  # engine placement -> recipe overrides
    "inline": [],
    "process": ["schedule.max_lag=2"],
    "servers": ["rollout.where=servers"],
    "servers-async": ["rollout.where=servers", "schedule.max_lag=2"],
}
# what a user may pick (transport -> placements), and the class each resolves to there
SUPPORTED = {
    "auto": {"inline": "InProcessTransport", "process": "FilesystemTransport", "servers": "FilesystemTransport",
             "servers-async": "FilesystemTransport"},
    "inprocess": {"inline": "InProcessTransport"},
    "filesystem": {p: "FilesystemTransport" for p in PLACEMENTS},
    "nccl": {"inline": "EngineNCCLTransport"},
    "ipc": {"inline": "IPCTransport"},
    "reshard": {"inline": "ShardedFilesystemTransport"},
}
IN_THE_WAY = {"process": "schedule.max_lag > 0", "servers": "rollout.where=servers", "servers-async": "rollout.where=servers"}


@pytest.mark.parametrize("mode", ["aligned", "fast"])
@pytest.mark.parametrize("place", list(PLACEMENTS))
@pytest.mark.parametrize("kind", list(SUPPORTED))
def test_every_transport_and_placement_is_built_or_refused_in_one_line(kind, place, mode, tmp_path):
    from megatron_rz.recipe import load_recipe
    from vllm_bridge.weights import WEIGHTS_DIR, make_transport

    overrides = [f"rollout.weight_transport={kind}", f"mode={mode}", *PLACEMENTS[place]]
    want = SUPPORTED[kind].get(place)
    if kind == "reshard" and mode == "fast":
        want = None
    if want is None:
        with pytest.raises(Exception) as e:
            load_recipe(RECIPE, overrides)
        msg = str(e.value).strip()
        assert len(msg.splitlines()) == 1, msg
        assert f"rollout.weight_transport={kind} cannot be used here" in msg and "rollout.weight_transport=auto" in msg
        assert (f"mode={mode}" if place == "inline" else IN_THE_WAY[place]) in msg, msg
        return
    r = load_recipe(RECIPE, overrides)
    t = make_transport(r.rollout.weight_transport, run_dir=tmp_path, where=r.rollout.where, max_lag=r.schedule.max_lag)
    assert type(t).__name__ == want
    if want in ("FilesystemTransport", "ShardedFilesystemTransport"):
        assert t.directory == tmp_path / WEIGHTS_DIR  # one weights directory per run, whatever the transport
    assert getattr(t, "collective", False) == (want == "ShardedFilesystemTransport")
    kwargs = r.engine_kwargs()
    assert ("weight_transfer_config" in kwargs) == (kind == "nccl")


def test_a_family_without_per_rank_pieces_cannot_reshard():
    from megatron_rz.recipe import load_recipe

    with pytest.raises(Exception, match=r"rollout.weight_transport=reshard cannot be used here: model.arch=deepseek_v4"):
        load_recipe(str(ROOT / "recipes" / "tiny_dsv4.yaml"), ["rollout.weight_transport=reshard"])


def test_the_old_key_points_at_the_new_one(tmp_path):
    from megatron_rz.recipe import load_recipe

    for source, overrides in ((RECIPE, ["rollout.weight_sync=reshard"]), (None, None)):
        if source is None:
            source = tmp_path / "old.yaml"
            source.write_text("rollout:\n  weight_sync: full\n")
            source, overrides = str(source), []
        with pytest.raises(Exception) as e:
            load_recipe(source, overrides)
        assert str(e.value).strip().endswith("rollout.weight_sync is now rollout.weight_transport (full: auto; reshard: reshard)")


NO_CUDA = {"nccl": "vLLM's NCCL weight transfer is GPU only", "ipc": "CUDA IPC handles are GPU only"}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("kind", sorted(NO_CUDA))
def test_gpu_transports_without_cuda_stop_rz_train_before_anything_starts(kind, tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_rz.cli", "train", RECIPE, f"rollout.weight_transport={kind}",
                          f"logging.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0
    err = out.stderr.strip()
    assert err.splitlines() == [f"rz: error: rollout.weight_transport={kind} cannot be used here: this machine has no "
                                f"CUDA device ({NO_CUDA[kind]}); use rollout.weight_transport=auto"], err
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()  # nothing started, nothing written


# modules outside vllm_bridge/weights that construct a transport, and why
CONSTRUCTORS_ALLOWED = {
    # the servers' client: the engine-side API (update_weights / swap_weights of named tensors) of servers whose
    # workers only read bucket files: that is how the servers receive weights, not a choice
    "vllm_bridge/server_client.py",
    # ranks other than 0 hold no rollout: they open the reshard writer on the directory rank 0 broadcasts
    "megatron_rz/loop/trainer.py",
}
TRANSPORT_CLASSES = {"InProcessTransport", "FilesystemTransport", "NCCLTransport", "EngineNCCLTransport",
                     "IPCTransport", "ShardedFilesystemTransport"}


def test_no_module_outside_the_package_chooses_a_transport():
    found = {}
    for pkg in ("megatron_rz", "vllm_bridge", "benchmarks"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if rel.startswith("vllm_bridge/weights/"):
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call):
                    fn = node.func
                    name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
                    if name in TRANSPORT_CLASSES:
                        found.setdefault(rel, []).append(f"{name} (line {node.lineno})")
    assert set(found) <= CONSTRUCTORS_ALLOWED, {k: v for k, v in found.items() if k not in CONSTRUCTORS_ALLOWED}
    assert set(found) == CONSTRUCTORS_ALLOWED, f"stale entries: {CONSTRUCTORS_ALLOWED - set(found)}"


def test_auto_is_ipc_for_a_colocated_engine_on_cuda_and_inprocess_on_cpu(tmp_path):
    from vllm_bridge.weights import make_transport
    from vllm_bridge.weights.select import resolve

    assert resolve("auto", where="local", max_lag=0, cuda=True) == "ipc"
    assert resolve("auto", where="local", max_lag=0, cuda=False) == "inprocess"
    for where, lag in (("local", 2), ("servers", 0), ("servers", 2)):  # never IPC off the trainer's process
        assert resolve("auto", where=where, max_lag=lag, cuda=True) == "filesystem"
    assert resolve("inprocess", cuda=True) == "inprocess"  # an explicit choice stays
    assert type(make_transport("auto", run_dir=tmp_path, cuda=True)).__name__ == "IPCTransport"
