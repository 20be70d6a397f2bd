"""benchmarks/stability.py: the leg spec and the report's figures from a run's metrics.jsonl."""

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import stability  # noqa: E402


def _write(d: Path, d3s, grad=None):
    d.mkdir(parents=True)
    rows = [{"step": 0, "eval_reward": 0.4}]
    for i, x in enumerate(d3s, 1):
        rows.append({"step": i, "d3": x, "kl_k1": 2 * x, "max_abs_dlogp": 0.1, "frac_bitwise": 0.5,
                     "grad_norm": (grad or {}).get(i, 0.1), "is_w_max": 1.0 + x, "reward_mean": i / len(d3s),
                     "entropy_est": 1.0 / i})
    rows.append({"step": len(d3s), "eval_reward": 0.8})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_legs_spec():
    assert stability._legs("aligned:2,fast:8") == [("aligned", 2), ("fast", 8)]
    with pytest.raises(SystemExit, match="MODE:LAG"):
        stability._legs("slow:2")


def test_report_figures_and_ratio(tmp_path):
    _write(tmp_path / "aligned_lag2", [1.0] * 9 + [4.0], grad={3: 0.5})
    _write(tmp_path / "fast_lag2", [1.0] * 9 + [40.0], grad={7: 5.0})
    res = stability.report(tmp_path, tmp_path / "out")
    a, f = res["legs"]["aligned_lag2"], res["legs"]["fast_lag2"]
    assert a["updates"] == 10 and a["d3_peak_over_median"] == 4.0 and f["d3_peak_over_median"] == 40.0
    assert a["d3_median_first_10pct"] == 1.0 and f["d3_median_last_10pct"] == 40.0
    assert a["grad_norm_max"] == 0.5 and f["grad_norm_max"] == 5.0
    assert a["eval_first"] == 0.4 and a["eval_last"] == 0.8
    assert a["kl_k1_median_by_tenth"] == [2.0] * 9 + [8.0] and a["entropy_first_10pct"] == 1.0
    assert a["entropy_last_10pct"] == 0.1
    assert res["lags"]["2"]["fast_over_aligned_d3_peak_over_median"] == 10.0
    assert (tmp_path / "out" / "plots_lag2" / "compare_d3.png").is_file()
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| fast_lag2 | 10 |" in md and "| fast_lag2 | 2 | 2 | 2 | 2 | 2 | 2 | 2 | 2 | 2 | 80 |" in md
    # another experiment's files are never overwritten
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("keep")
    with pytest.raises(SystemExit, match="holds other files"):
        stability.report(tmp_path, tmp_path / "other")
    # nor another experiment's report; the same experiment's report is rewritten
    (tmp_path / "experiment.json").write_text(json.dumps({"recipe": "another"}))
    with pytest.raises(SystemExit, match="another experiment"):
        stability.report(tmp_path, tmp_path / "out")
    (tmp_path / "experiment.json").unlink()
    stability.report(tmp_path, tmp_path / "out")


def test_a_stopped_runner_stops_its_running_leg_first(tmp_path):
    """SIGTERM to the runner while it waits on a leg (the real case: the main thread inside the
    child's wait()) goes on to the leg as SIGTERM (`rz train` checkpoints, then exits 143); the
    runner reaps it and stops, so no leg outlives its runner holding the run directory's lock. The
    leg is a real child process with rz train's exit code; the signal comes from another thread."""
    import signal
    import threading
    import time

    marker = tmp_path / "got_sigterm"
    code = ("import pathlib, signal, sys, time\n"
            f"def stop(*a):\n    pathlib.Path({str(marker)!r}).write_text('1'); sys.exit(143)\n"
            "signal.signal(signal.SIGTERM, stop)\ntime.sleep(120)\n")
    old = signal.signal(signal.SIGTERM, stability._stop)
    try:
        timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
        timer.start()
        t = time.time()
        with open(tmp_path / "leg.log", "w") as out, pytest.raises(SystemExit) as e:
            stability._run_leg([sys.executable, "-c", code], dict(os.environ), out)
        assert e.value.code == 128 + signal.SIGTERM
        assert marker.read_text() == "1" and time.time() - t < 30
        assert stability._child is None
        # between legs (no child): the runner stops at once
        with pytest.raises(SystemExit):
            stability._stop(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGTERM, old)
        stability._stopping = None
        stability._child = None


def test_long_runs_are_drawn_with_their_running_median(tmp_path):
    from megatron_rz.loop import metrics as M

    assert M.running_median([1, 100, 2, 3, 4], 3) == [50.5, 2.0, 3.0, 3.0, 3.5]
    assert M.running_median([5, 1], 1) == [5.0, 1.0]
    n = M.SMOOTH_ABOVE + 100  # a long leg beside a short one: both drawn, the long one smoothed
    _write(tmp_path / "long", [1e-3 * (1 + (i % 7)) for i in range(n)])
    _write(tmp_path / "short", [1e-3] * 50)
    out = M.plot_compare([tmp_path / "long", tmp_path / "short"], tmp_path / "plots")
    assert sorted(p.name for p in out) == sorted(M.COMPARE) and all(p.stat().st_size > 0 for p in out)


def test_legs_keep_only_their_newest_checkpoints(tmp_path, monkeypatch):
    """Every leg's rz train gets checkpoint.keep (bookkeeping: a 20,000-update leg would otherwise keep
    800 checkpoints); the experiment's identity (experiment.json's overrides) does not include it, so
    an experiment started before keeps resuming."""
    import json

    calls = []

    def fake_rz(args, log, mode="aligned"):
        calls.append(args)
        raise SystemExit(0)

    (tmp_path / "base_model").mkdir()
    monkeypatch.setattr(stability, "_base_model", lambda *a: True)
    monkeypatch.setattr(stability, "_rz", fake_rz)
    with pytest.raises(SystemExit):
        stability.run(tmp_path, "recipes/tiny_moe.yaml", [("fast", 8)], 100, 600, 3600, ["algo.lr=5e-5"])
    (cmd,) = calls
    assert cmd[-1] == "checkpoint.keep=3" and "checkpoint.every=25" in cmd and "algo.lr=5e-5" in cmd
    assert "schedule.max_lag=8" in cmd and "rollout.dtype=bfloat16" in cmd
    meta = json.loads((tmp_path / "experiment.json").read_text())
    assert not any(o.startswith("checkpoint.keep") for o in meta["overrides"] + meta["fast_overrides"])


def test_the_report_names_each_override_once_with_the_value_the_run_used():
    # DEFAULTS' algo.lr=1e-4 then the run's own algo.lr=5e-5: the recipe applies the last one
    ov = stability.DEFAULTS + ["algo.lr=5e-5", "logging.wandb=false"]
    eff = stability.effective(ov)
    assert "algo.lr=5e-5" in eff and "algo.lr=1e-4" not in eff
    assert len(eff) == len({o.split("=", 1)[0] for o in ov}) and eff[0] == "algo.lr=5e-5"


def test_seeds_report_sets_seeds_side_by_side_over_the_same_updates(tmp_path):
    s0, s1 = tmp_path / "exp", tmp_path / "exp_seed1"
    _write(s0 / "aligned_lag8", [1.0] * 18 + [3.0, 3.0])  # 20 updates; seed 1 has 10: both compared over 10
    _write(s0 / "fast_lag8", [1.0] * 9 + [5.0] + [9.0] * 10)
    _write(s1 / "aligned_lag8", [1.0] * 9 + [2.0])
    _write(s1 / "fast_lag8", [1.0] * 9 + [1.5])
    _write(s1 / "aligned_lag2", [1.0] * 10)  # in one root only: left out
    res = stability.seeds_report([s0, s1], tmp_path / "out")
    assert set(res["legs"]) == {"aligned_lag8", "fast_lag8"}
    a, f = res["legs"]["aligned_lag8"], res["legs"]["fast_lag8"]
    assert a["updates_each"] == f["updates_each"] == 10
    # kl_k1 = 2 * d3 in _write: KL growth = last tenth / first tenth of the first 10 updates
    assert a["seeds"]["exp"]["kl_growth"] == 1.0 and a["seeds"]["exp_seed1"]["kl_growth"] == 2.0
    assert f["seeds"]["exp"]["kl_growth"] == 5.0 and f["seeds"]["exp_seed1"]["kl_growth"] == 1.5
    assert a["summary"]["kl_growth"] == {"min": 1.0, "median": 1.5, "max": 2.0}
    kl = res["lags"]["8"]["kl_growth"]
    assert kl["per_seed"] == {"exp": 5.0, "exp_seed1": 0.75} and kl["fast_above"] == 1 and kl["seeds"] == 2
    # held-out evaluations count up to the compared update only: seed 0's second one (update 20) is past it
    assert a["seeds"]["exp"]["eval_gain"] == 0.0 and a["seeds"]["exp_seed1"]["eval_gain"] == pytest.approx(0.4)
    md = (tmp_path / "out" / "seeds.md").read_text()
    assert "| exp_seed1 | 2 |" in md and "| KL k1 last / first 10% | 5 | 0.75 | 1 of 2 |" in md
    # the same roots' report is rewritten; other files or other roots are never overwritten
    stability.seeds_report([s0, s1], tmp_path / "out")
    with pytest.raises(SystemExit, match="other roots"):
        stability.seeds_report([s1, s0], tmp_path / "out")
    with pytest.raises(SystemExit, match="two or more"):
        stability.seeds_report([s0], tmp_path / "out2")
    with pytest.raises(SystemExit, match="not a directory"):
        stability.seeds_report([s0, tmp_path / "missing"], tmp_path / "out3")
