"""benchmarks/rollout_gpu.py compare: the ratios a user reads, from engine parts as bench-one writes them;
bench: which variants each engine process is asked to time."""

import json
import os

import pytest

from benchmarks.rollout_gpu import compare


def _part(engine, medians):
    cells = [{"batch": b, "prompt": p, "new": n, "seeded": True, "median_s": m, "min_s": m, "max_s": m,
              "rounds_s": [m], "tok_s": b * n / m} for (b, p, n), m in medians.items()]
    return {"engine": engine, "startup_s": 1.0, "env": {}, "probes": [], "cells": cells}


A, B = (1, 64, 128), (64, 512, 512)


def test_every_aligned_kind_over_stock_and_aligned_over_every_other():
    res = compare([_part("stock", {A: 1.0, B: 2.0}), _part("aligned_v2", {A: 1.1, B: 1.9}),
                   _part("aligned", {A: 1.2, B: 2.4})])
    s = res["summary"]
    assert s["aligned_over_stock"]["worst"] == 1.2 and s["aligned_over_stock"]["worst_cell"] == "1x64x128 seeded"
    assert s["aligned_v2_over_stock"] == {"worst": 1.1, "worst_cell": "1x64x128 seeded", "best": 0.95,
                                          "best_cell": "64x512x512 seeded", "cells": 2}
    assert s["aligned_over_aligned_v2"]["worst"] == pytest.approx(1.263, abs=1e-3)
    row = next(r for r in res["cells"] if (r["batch"], r["prompt"], r["new"]) == B)
    assert row["aligned_v2_over_stock"] == 0.95 and row["aligned_over_stock"] == 1.2


def test_without_the_aligned_engine_the_other_kinds_still_get_their_ratio():
    # a run of aligned_v2 and stock alone (no "aligned" part) still says how aligned_v2 compares
    s = compare([_part("aligned_v2", {A: 0.9}), _part("stock", {A: 1.0})])["summary"]
    assert s["aligned_v2_over_stock"]["worst"] == 0.9 and "aligned_over_stock" not in s


def test_parts_of_one_engine_from_several_calls_pool_their_rounds():
    # two calls measured stock's cell A (rounds 1.0 / 3.0 and 2.0): the pooled median is over all three
    first, second = _part("stock", {A: 1.0}), _part("stock", {A: 2.0, B: 4.0})
    first["cells"][0]["rounds_s"] = [1.0, 3.0]
    res = compare([first, second, _part("aligned", {A: 2.2, B: 4.0})])
    row = next(r for r in res["cells"] if (r["batch"], r["prompt"], r["new"]) == A)
    assert row["stock"]["rounds_s"] == [1.0, 3.0, 2.0] and row["stock"]["median_s"] == 2.0
    assert (row["stock"]["min_s"], row["stock"]["max_s"]) == (1.0, 3.0)
    assert row["aligned_over_stock"] == 1.1
    assert res["engines"]["stock"]["calls"] == 2 and res["engines"]["stock"]["startup_s"] == [1.0, 1.0]


def test_markdown_shows_every_cell_each_engine_and_the_worst_cell():
    from benchmarks.rollout_gpu import markdown

    res = compare([_part("stock", {A: 1.0, B: 2.0}), _part("stock_bi", {A: 1.5}), _part("aligned", {A: 1.2, B: 1.8})])
    md = markdown(res)
    lines = [x for x in md.splitlines() if x.startswith("| 1 x") or x.startswith("| 64 x")]
    assert len(lines) == 2
    a_row = next(x for x in lines if x.startswith("| 1 x 64 x 128"))
    assert "1.000 (1.000-1.000, n=1)" in a_row and "| 1.20 |" in a_row and "| 0.80 |" in a_row
    b_row = next(x for x in lines if x.startswith("| 64 x 512 x 512"))
    assert "| - |" in b_row  # stock_bi did not measure this cell
    assert "aligned / stock: worst 1.20 (1x64x128 seeded), best 0.90 (64x512x512 seeded), 2 cells" in md


def _arg(cmd, flag):
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


@pytest.mark.parametrize("first_exit", [0, 124])
def test_bench_gives_later_engines_the_variants_the_first_one_finished(tmp_path, monkeypatch, first_exit):
    """An engine process that ran out of budget (exit 0) or was cut off by `timeout` (124) after two of
    the four variants: the next engine times exactly those two, so each finished cell has its ratio."""
    import subprocess

    import benchmarks.rollout_gpu as rg

    calls = []

    def engine_process(cmd, env=None):  # stands in for one bench-one process (it needs CUDA vLLM)
        kind, out, only = _arg(cmd, "--engine"), _arg(cmd, "--out"), _arg(cmd, "--only")
        calls.append((kind, only))
        cells = [tuple(map(int, c.split("x"))) for c in _arg(cmd, "--cells").split(",")]
        seeded = [x == "on" for x in _arg(cmd, "--seeded").split(",")]
        want = [(c, sd) for c in cells for sd in seeded]
        if only is None:
            want = want[:2]  # the first engine: its budget ends after two variants
        else:
            want = [(c, sd) for c, sd in want if rg.variant(*c, sd) in only.split(",")]
        m = 1.0 if kind == "stock" else 1.1
        part = {"engine": kind, "startup_s": 1.0, "env": {}, "probes": [], "skipped": [],
                "cells": [{"batch": b, "prompt": p, "new": n, "seeded": sd, "rounds_s": [m], "median_s": m,
                           "min_s": m, "max_s": m, "tok_s": b * n / m} for (b, p, n), sd in want]}
        json.dump(part, open(out, "w"))
        return subprocess.CompletedProcess(cmd, first_exit if only is None else 0)

    monkeypatch.setattr(subprocess, "run", engine_process)
    res = rg.bench("ckpt", str(tmp_path / "b.json"), [A, B], 5, engines=("stock", "aligned"), seeded=(True, False),
                   budget_s=100)
    assert calls == [("stock", None), ("aligned", "1x64x128/on,1x64x128/off")]
    assert sorted((r["batch"], r["seeded"], r["aligned_over_stock"]) for r in res["cells"]) == [(1, False, 1.1), (1, True, 1.1)]
    assert (tmp_path / "b.aligned.json").exists() and (tmp_path / "b.json").exists()


def test_bench_one_command_names_only_when_given():
    from benchmarks.rollout_gpu import bench_one_command, variant

    cmd = bench_one_command("aligned", "ck", "p.json", [A], 5, 20, (True,), 0, None)
    assert "--only" not in cmd and cmd[cmd.index("--cells") + 1] == "1x64x128"
    cmd = bench_one_command("aligned", "ck", "p.json", [A, B], 5, 20, (True, False), 0, [variant(64, 512, 512, False)])
    assert cmd[cmd.index("--only") + 1] == "64x512x512/off"


def test_bench_one_refuses_an_only_variant_it_was_not_given(capsys, tmp_path):
    from benchmarks.rollout_gpu import main

    rc = main(["bench-one", "--engine", "aligned", "--ckpt", "ck", "--out", str(tmp_path / "o.json"), "--cells", "1x64x128",
               "--seeded", "on", "--only", "1x64x128/off"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--only '1x64x128/off' is not one of" in err and "1x64x128/on" in err


def test_bench_and_bench_one_never_overwrite_an_earlier_run(tmp_path, monkeypatch, capsys):
    import subprocess

    import benchmarks.rollout_gpu as rg

    def no_engine(cmd, env=None):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(subprocess, "run", no_engine)
    for earlier in ("b.stock.json", "b.aligned.json"):
        d = tmp_path / earlier.replace(".", "_")
        d.mkdir()
        (d / earlier).write_text("{}")
        with pytest.raises(SystemExit, match=f"{earlier} exists"):
            rg.bench("ckpt", str(d / "b.json"), [A], 5, engines=("stock", "aligned"))
        assert (d / earlier).read_text() == "{}"
    (tmp_path / "o.json").write_text("{}")
    rc = rg.main(["bench-one", "--engine", "aligned", "--ckpt", "ck", "--out", str(tmp_path / "o.json"),
                  "--cells", "1x64x128"])
    assert rc == 2 and "already holds results" in capsys.readouterr().err and (tmp_path / "o.json").read_text() == "{}"


def test_process_order_alternates_the_engines_every_repeat():
    from benchmarks.rollout_gpu import process_order

    assert process_order(("stock", "aligned"), 1) == [(0, "stock"), (0, "aligned")]
    assert process_order(("stock", "aligned", "aligned_small"), 3) == [
        (0, "stock"), (0, "aligned"), (0, "aligned_small"),
        (1, "aligned_small"), (1, "aligned"), (1, "stock"),
        (2, "stock"), (2, "aligned"), (2, "aligned_small")]


def test_bench_with_several_processes_pools_them_and_reports_each_pairs_ratio(tmp_path, monkeypatch):
    """Two processes per engine, the second pair in the reverse order: every process writes its own
    part (none overwritten), the pooled median is over all rounds, and the ratio of each process pair
    sits beside the pooled ratio, in the row, the summary and the markdown."""
    import subprocess

    import benchmarks.rollout_gpu as rg

    calls = []
    # seconds per process, in start order: stock 1.0, aligned 1.2, then aligned 1.0, stock 1.0
    medians = iter([1.0, 1.2, 1.0, 1.0])

    def engine_process(cmd, env=None):
        kind, out, only = _arg(cmd, "--engine"), _arg(cmd, "--out"), _arg(cmd, "--only")
        calls.append((kind, os.path.basename(out), only))
        m = next(medians)
        part = {"engine": kind, "startup_s": 1.0, "env": {}, "probes": [], "skipped": [],
                "cells": [{"batch": 1, "prompt": 64, "new": 128, "seeded": True, "rounds_s": [m, m], "median_s": m,
                           "min_s": m, "max_s": m, "tok_s": 128 / m}]}
        json.dump(part, open(out, "w"))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", engine_process)
    res = rg.bench("ckpt", str(tmp_path / "b.json"), [A], 5, engines=("stock", "aligned"), processes=2)
    assert calls == [("stock", "b.stock.json", None), ("aligned", "b.aligned.json", "1x64x128/on"),
                     ("aligned", "b.aligned.p1.json", "1x64x128/on"), ("stock", "b.stock.p1.json", "1x64x128/on")]
    row = res["cells"][0]
    assert row["stock"]["process_medians_s"] == [1.0, 1.0] and row["aligned"]["process_medians_s"] == [1.2, 1.0]
    assert row["aligned"]["rounds_s"] == [1.2, 1.2, 1.0, 1.0] and row["aligned_over_stock"] == 1.1
    assert row["aligned_over_stock_per_process"] == [1.2, 1.0]
    assert res["summary"]["aligned_over_stock"]["per_process_range"] == [1.0, 1.2]
    md = rg.markdown(res)
    assert "1.100 (1.000-1.200, n=4, 2 processes)" in md and "| 1.10 (1.00-1.20) |" in md
    assert "over process pairs 1.00-1.20" in md
    # a second run into the same folder finds the repeat's parts and starts nothing
    (tmp_path / "b.json").unlink()
    for p in ("b.stock.json", "b.aligned.json"):
        (tmp_path / p).unlink()
    with pytest.raises(SystemExit, match="b.aligned.p1.json exists"):
        rg.bench("ckpt", str(tmp_path / "b.json"), [A], 5, engines=("stock", "aligned"), processes=2)
    assert len(calls) == 4


def test_bench_refuses_fewer_than_one_process(capsys, tmp_path):
    from benchmarks.rollout_gpu import main

    rc = main(["bench", "--ckpt", "ck", "--out", str(tmp_path / "o.json"), "--processes", "0"])
    assert rc == 2 and "--processes 0 must be 1 or more" in capsys.readouterr().err
