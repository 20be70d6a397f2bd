"""The measured per-GPU GEMM pick tables (kernels/triton/gemm_table.py) and the sweep that writes them
(benchmarks/gemm_shapes.py, gpu_kernels.py --table-out). Picks change speed only: that every config
gives the same bits is tests/gpu/test_triton_kernels.py's test_gemm_all_configs_identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gemm_shapes import GemmShape, dump_table, model_gemm_shapes, table_from_sweep
from kernels import settings
from kernels.triton import gemm
from kernels.triton import gemm_table as gt

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def table_setting():
    yield
    settings.set_gemm_table("auto")
    gemm._table_index.clear()


def write(tmp_path, entries, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"device": "X", "entries": entries}))
    return p


def test_device_slug():
    assert gt.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert gt.device_slug("NVIDIA H200") == "nvidia_h200"


def test_lookup_takes_the_smallest_measured_m_at_or_above(tmp_path):
    idx = gt.load_table(write(tmp_path, {"1536,1536,8": [[64, "d64_n64_split"], [1, "d16_n64_split"],
                                                         [32, "m64_n128_split_mt"]]}), gemm.CONFIGS)
    assert [gt.lookup(idx, m, 1536, 1536, 8) for m in (1, 2, 32, 33, 64)] == [
        "d16_n64_split", "m64_n128_split_mt", "m64_n128_split_mt", "d64_n64_split", "d64_n64_split"]
    assert gt.lookup(idx, 65, 1536, 1536, 8) is None  # above what was timed: the heuristic
    assert gt.lookup(idx, 32, 1536, 1536, 1) is None  # another segmentation is another shape
    assert gt.lookup(idx, 32, 1536, 2048, 8) is None


@pytest.mark.parametrize("entries, msg", [
    ({"1536,1536": [[1, "d16_n64"]]}, "is not 'K,N,k_segments'"),
    ({"1536,1536,8": []}, "has no"),
    ({"1536,1536,8": [[0, "d16_n64"]]}, "is not \\[M > 0"),
    ({"1536,1536,8": [["32", "d16_n64"]]}, "is not \\[M > 0"),
    ({"1536,1536,8": [[32, "no_such_config"]]}, "not one of"),
    ({"1536,1536,8": [[32, "d16_n64"], [32, "d64_n64"]]}, "names one M twice"),
])
def test_bad_tables_are_refused_by_name(tmp_path, entries, msg):
    with pytest.raises(gt.GemmTableError, match=msg):
        gt.load_table(write(tmp_path, entries), gemm.CONFIGS)


def test_setting_resolution(tmp_path):
    assert gt.table_path("off", "NVIDIA H100 80GB HBM3") is None
    assert gt.table_path("auto", None) is None
    assert gt.table_path("auto", "Some GPU without a table") is None
    assert gt.table_path("auto", "NVIDIA H100 80GB HBM3") == gt.TABLE_DIR / "nvidia_h100_80gb_hbm3.json"
    p = write(tmp_path, {})
    assert gt.table_path(str(p), None) == p
    with pytest.raises(gt.GemmTableError, match="is not a file"):
        gt.table_path(str(tmp_path / "missing.json"), None)


def test_pick_config_follows_the_table_and_falls_back_above_it(tmp_path, table_setting):
    K, N, seg = 8960, 1536, 8
    heuristic = {m: gemm.pick_config(m, K, N, seg) for m in (1, 32, 64, 300)}
    # a table that names, at each measured M, a config the heuristic does not pick there
    choice = {1: "m64_n128_split", 32: "d64_n64_split", 64: "d16_n64_split"}
    assert all(gemm.CONFIGS[c] != heuristic[m] for m, c in choice.items())
    p = write(tmp_path, {f"{K},{N},{seg}": [[m, c] for m, c in choice.items()]})
    settings.set_gemm_table(str(p))
    gemm._table_index.clear()
    for m, c in choice.items():
        assert gemm.pick_config(m, K, N, seg) == gemm.CONFIGS[c]
    assert gemm.pick_config(300, K, N, seg) == heuristic[300]
    assert gemm.pick_config(32, K, N, 1) == gemm.pick_config(32, K, N, 1)  # untouched shape
    settings.set_gemm_table("off")
    assert gemm.pick_config(32, K, N, seg) == heuristic[32]


def test_committed_tables_are_valid():
    files = sorted(gt.TABLE_DIR.glob("*.json"))
    assert files, "kernels/triton/gemm_tables/ holds no table"
    for f in files:
        doc = json.loads(f.read_text())
        assert f.stem == gt.device_slug(doc["device"]), f"{f.name}: named after another device"
        idx = gt.validate_table(doc, gemm.CONFIGS)
        assert idx and doc.get("command"), f"{f.name}: empty, or no command that measured it"


def test_model_shapes_of_the_bench_configs():
    sys.path.insert(0, str(ROOT))
    from benchmarks.rollout_gpu import CONFIGS as BENCH

    q = {s.name: s for s in model_gemm_shapes(BENCH["qwen2_1p5b"])}
    assert q["qkv_proj"] == GemmShape("qkv_proj", 1536, (12 + 2 * 2) * 128, 1)
    assert q["o_proj"] == GemmShape("o_proj", 1536, 1536, 8)
    assert q["gate_up_proj"] == GemmShape("gate_up_proj", 1536, 2 * 8960, 1)
    assert q["down_proj"] == GemmShape("down_proj", 8960, 1536, 8)
    assert q["lm_head"].N == 151936 and q["lm_head"].max_m is not None
    moe = {s.name for s in model_gemm_shapes(BENCH["qwen3_30b_a3b_4l"])}
    assert "router_gate" in moe and "gate_up_proj" not in moe  # routed experts are the MoE kernels'
    ds = {s.name: s for s in model_gemm_shapes(BENCH["dsv3_4l"])}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj"} <= set(ds) or "q_proj" in ds
    assert ds["o_proj"].k_segments == 8
    assert len({(s.K, s.N, s.k_segments) for s in ds.values()}) == len(ds)


def test_table_from_sweep_round_trips_through_the_loader(tmp_path):
    rows = [dict(K=1536, N=1536, nseg=8, M=64, best="d64_n64_split"),
            dict(K=1536, N=1536, nseg=8, M=1, best="d16_n64_split"),
            dict(K=1536, N=2048, nseg=1, M=32, best=None)]  # every config failed: left out
    table = table_from_sweep(rows, {"device": "NVIDIA H200", "command": "gpu_kernels.py --sweep"})
    p = tmp_path / "t.json"
    p.write_text(dump_table(table))
    assert json.loads(p.read_text()) == table
    idx = gt.load_table(p, gemm.CONFIGS)
    assert idx == {(1536, 1536, 8): ([1, 64], ["d16_n64_split", "d64_n64_split"])}


def test_sweep_refuses_to_overwrite_a_table(tmp_path):
    p = write(tmp_path, {})
    r = subprocess.run([sys.executable, "benchmarks/gpu_kernels.py", "--sweep", "--table-out", str(p)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(p.read_text()) == {"device": "X", "entries": {}}


def test_merge_keeps_every_shape_and_refuses_two_devices():
    from benchmarks.gemm_shapes import merge_tables

    a = {"device": "NVIDIA H100 80GB HBM3", "command": "a", "entries": {"1,2,1": [[1, "d16_n64"]], "3,4,1": [[1, "d16_n32"]]}}
    b = {"device": "NVIDIA H100 80GB HBM3", "command": "b", "entries": {"3,4,1": [[8, "d64_n64"]], "5,6,8": [[1, "d16_n64_split"]]}}
    m = merge_tables([a, b])
    assert m["entries"] == {"1,2,1": [[1, "d16_n64"]], "3,4,1": [[8, "d64_n64"]], "5,6,8": [[1, "d16_n64_split"]]}
    assert m["command"] == "a + b"
    with pytest.raises(ValueError, match="several devices"):
        merge_tables([a, {**b, "device": "NVIDIA H200"}])
