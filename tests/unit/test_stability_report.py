"""benchmarks/stability.py: the leg spec and the report's figures from a run's metrics.jsonl."""

import json
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
                     "grad_norm": (grad or {}).get(i, 0.1), "is_w_max": 1.0 + x, "reward_mean": i / len(d3s)})
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
    assert res["lags"]["2"]["fast_over_aligned_d3_peak_over_median"] == 10.0
    assert (tmp_path / "out" / "plots_lag2" / "compare_d3.png").is_file()
    assert "| fast_lag2 | 10 |" in (tmp_path / "out" / "report.md").read_text()
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
    """SIGTERM to `stability.py run` goes on to the leg it is running (as SIGTERM: `rz train`
    checkpoints, then exits 143) and the runner waits for it, so no leg outlives its runner holding
    the run directory's lock. The leg here is a real child process with rz train's exit code."""
    import signal
    import subprocess
    import time

    marker = tmp_path / "got_sigterm"
    child = subprocess.Popen([sys.executable, "-c",
                              "import pathlib, signal, sys, time\n"
                              f"def stop(*a):\n    pathlib.Path({str(marker)!r}).write_text('1'); sys.exit(143)\n"
                              "signal.signal(signal.SIGTERM, stop)\nprint('up', flush=True)\ntime.sleep(120)\n"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "up"
    stability._child = child
    try:
        t = time.time()
        with pytest.raises(SystemExit) as e:
            stability._stop(signal.SIGTERM, None)
        assert e.value.code == 128 + signal.SIGTERM
        assert child.returncode == 143 and marker.read_text() == "1"
        assert time.time() - t < 30
    finally:
        stability._child = None
        if child.poll() is None:
            child.kill()
    # no leg running: the runner just stops
    with pytest.raises(SystemExit):
        stability._stop(signal.SIGINT, None)


def test_long_runs_are_drawn_with_their_running_median(tmp_path):
    from megatron_rz.loop import metrics as M

    assert M.running_median([1, 100, 2, 3, 4], 3) == [50.5, 2.0, 3.0, 3.0, 3.5]
    assert M.running_median([5, 1], 1) == [5.0, 1.0]
    n = M.SMOOTH_ABOVE + 100  # a long leg beside a short one: both drawn, the long one smoothed
    _write(tmp_path / "long", [1e-3 * (1 + (i % 7)) for i in range(n)])
    _write(tmp_path / "short", [1e-3] * 50)
    out = M.plot_compare([tmp_path / "long", tmp_path / "short"], tmp_path / "plots")
    assert sorted(p.name for p in out) == sorted(M.COMPARE) and all(p.stat().st_size > 0 for p in out)
