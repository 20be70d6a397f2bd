"""benchmarks/stability.py sweep: the per-lr stability verdict and the chosen lr from metrics.jsonl."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import stability  # noqa: E402

STEPS = 20
META = {"recipe": "recipes/tiny_moe.yaml", "overrides": ["algo.lr=1e-4"], "bf16": "rollout", "mode": "aligned",
        "lag": 8, "steps": STEPS}


def _write(root: Path, lr: float, n=STEPS, kl=lambda i: 0.01, reward=lambda i: 0.6, grad=lambda i: 0.5,
           eval_last=0.8, **extra):
    d = stability._lr_dir(root, META, lr)
    d.mkdir(parents=True)
    rows = [{"step": 0, "eval_reward": 0.4}]
    for i in range(1, n + 1):
        rows.append({"step": i, "d3": kl(i), "kl_k1": kl(i), "max_abs_dlogp": 0.1, "frac_bitwise": 0.1,
                     "loss": -0.01, "grad_norm": grad(i), "is_w_max": 1.5, "reward_mean": reward(i),
                     "update_skipped": 0, **extra.get(i, {})})
    rows.append({"step": n, "eval_reward": eval_last})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _sweep(root: Path, lrs):
    (root / "sweep.json").write_text(json.dumps({**META, "lrs": lrs}))


def test_verdicts_and_chosen_lr(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    _write(root, 5e-5)
    _write(root, 1e-4, kl=lambda i: 0.01 * (1 + i / STEPS), reward=lambda i: 0.5 + 0.01 * i)  # KL 1.9x: stable
    _write(root, 2e-4, kl=lambda i: 0.01 * (1 + 3 * i / STEPS))  # KL grows ~3.5x
    _write(root, 4e-4, grad=lambda i: "nan" if i == 7 else 0.5,  # as MetricsLogger writes it
           extra={7: {"update_skipped": 1}})
    _write(root, 8e-4, reward=lambda i: 0.7 if i <= 10 else 0.6, eval_last=0.0)  # collapse
    _sweep(root, [5e-5, 1e-4, 2e-4, 4e-4, 8e-4])
    res = stability.sweep_report(root, out)
    v = res["lrs"]
    assert v["5e-05"]["stable"] and v["0.0001"]["stable"]
    assert v["0.0001"]["kl_k1_growth"] == pytest.approx(1.975 / 1.075)
    assert v["0.0002"]["status"] == "unstable: kl_k1_growth"
    assert v["0.0004"]["status"] == "unstable: finite" and v["0.0004"]["nonfinite_updates"] == 1
    assert v["0.0008"]["checks"]["reward"] is False and v["0.0008"]["checks"]["held_out"] is False
    assert res["chosen_lr"] == 1e-4 and not res["provisional"] and res["unstable_below_chosen"] == []
    md = (out / "report.md").read_text()
    assert "**Chosen lr: 0.0001**" in md and "| 0.0002 | 20 | unstable: kl_k1_growth |" in md
    assert (out / "plots" / "compare_kl.png").is_file() and (out / "plots" / "compare_reward.png").is_file()
    assert gzip.decompress((out / "lr0.0004.metrics.jsonl.gz").read_bytes()).count(b"\n") == STEPS + 2
    # the same sweep's report is rewritten; another sweep's, or other files, never
    stability.sweep_report(root, out, plots=False)
    # a sweep of the same settings in another root (its own id): refused too
    (root / "sweep.json").write_text(json.dumps({**META, "lrs": [5e-5, 1e-4, 2e-4, 4e-4, 8e-4], "id": "another"}))
    with pytest.raises(SystemExit, match="another experiment"):
        stability.sweep_report(root, out, plots=False)
    (root / "sweep.json").write_text(json.dumps({**META, "steps": 10, "lrs": [5e-5]}))
    with pytest.raises(SystemExit, match="another experiment"):
        stability.sweep_report(root, out, plots=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("keep")
    with pytest.raises(SystemExit, match="holds other files"):
        stability.sweep_report(root, tmp_path / "other", plots=False)


def test_unfinished_and_failed_runs(tmp_path):
    root = tmp_path / "root"
    _write(root, 1e-4)
    _write(root, 2e-4, n=12)  # still running: incomplete, so the choice is provisional
    d = _write(root, 4e-4, n=5)
    (d / "sweep_exit.json").write_text(json.dumps({"rc": 1, "updates": 5}))  # stopped: not stable
    _sweep(root, [1e-4, 2e-4, 4e-4, 8e-4])  # 8e-4 never started
    res = stability.sweep_report(root, tmp_path / "out", plots=False)
    v = res["lrs"]
    assert v["0.0002"]["status"] == "incomplete" and v["0.0008"]["status"] == "incomplete"
    assert v["0.0004"]["status"].startswith("unstable: finished") and not v["0.0004"]["stable"]
    assert res["chosen_lr"] == 1e-4 and res["provisional"]
    # a stable lr above an unstable one is chosen, and the report says the sweep is not monotone
    root2 = tmp_path / "root2"
    _write(root2, 1e-4, grad=lambda i: float("inf") if i == 3 else 0.5)
    _write(root2, 2e-4)
    _sweep(root2, [1e-4, 2e-4])
    res = stability.sweep_report(root2, tmp_path / "out2", plots=False)
    assert res["chosen_lr"] == 2e-4 and res["unstable_below_chosen"] == [1e-4]


def test_lrs_spec():
    assert stability._lrs("2e-4,5e-5,2e-4") == [5e-5, 2e-4]
    with pytest.raises(SystemExit, match="> 0"):
        stability._lrs("0,1e-4")
    with pytest.raises(SystemExit, match="numbers"):
        stability._lrs("1e-4,fast")
