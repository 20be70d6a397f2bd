"""Run directories are never clobbered: results refused without resume/--overwrite, one live run
per directory (lock naming its pid, stale locks taken over), base models reused only by hash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rz import cli
from megatron_rz.recipe import load_recipe
from megatron_rz.launch.rundir import (LOCK, RECORD, RunDirError, base_model_dir, base_model_hash, build_base_model,
                                claim_run_dir)

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_moe.yaml")


def _recipe(run_dir: Path, *extra: str):
    return load_recipe(TINY, [f"logging.run_dir={run_dir}", "logging.wandb=false", *extra])


def _finished_run(run_dir: Path) -> dict:
    """A run dir as a finished run leaves it (the files that matter here)."""
    files = {"metrics.jsonl": '{"step": 0, "eval_reward": 0.4}\n{"step": 1, "reward_mean": 0.5}\n',
             "checkpoints/step_000001/rank00000.pt": "x", "checkpoints/step_000001/COMPLETE": "step 1\n",
             "summary.json": "{}", "base_model/warm_start.json": "{}"}
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    return files


def _contents(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): p.read_text() for p in run_dir.rglob("*") if p.is_file()}


def test_fresh_dir_is_claimed_recorded_and_released(tmp_path):
    r = _recipe(tmp_path / "run")
    lock = claim_run_dir(r)
    held = json.loads((tmp_path / "run" / LOCK).read_text())
    assert held["pid"] == os.getpid()
    rec = json.loads((tmp_path / "run" / RECORD).read_text())
    assert rec["recipe"]["algo"]["lr"] == r.algo.lr and rec["base_model_hash"] == base_model_hash(r, r.schedule.seed)
    with pytest.raises(RunDirError, match=rf"in use by another live run: pid {os.getpid()}"):
        claim_run_dir(r)  # a second live run in the same dir (this process still holds it)
    lock.release()
    assert not (tmp_path / "run" / LOCK).exists()


def test_second_train_refuses_with_the_choices_and_touches_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _finished_run(run)
    before = _contents(run)
    rc = cli.main(["train", TINY, f"logging.run_dir={run}", "algo.lr=3e-4"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    for choice in ("metrics.jsonl (2 rows)", "checkpoints/ (1, newest step_000001)", "checkpoint.load=latest",
                   "logging.run_dir=OTHER_DIR", "--overwrite"):  # (name= would not move an explicit run_dir)
        assert choice in err, (choice, err)
    assert _contents(run) == before and not (run / LOCK).exists()
    assert "name=OTHER" in str(_refusal(_recipe_named(tmp_path)))


def _recipe_named(tmp_path):
    r = load_recipe(TINY, ["logging.wandb=false", f"logging.run_dir={tmp_path}/runs/{{name}}"])
    r.run_dir.mkdir(parents=True)
    _finished_run(r.run_dir)
    return r


def _refusal(recipe):
    with pytest.raises(RunDirError) as e:
        claim_run_dir(recipe)
    return e.value


def test_resume_keeps_everything_and_overwrite_deletes_only_results(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _finished_run(run)
    before = _contents(run)
    claim_run_dir(_recipe(run, "checkpoint.load=latest")).release()
    after = _contents(run)
    assert {k: after[k] for k in before} == before  # resume: nothing replaced (run.json added)
    assert len(json.loads(after[RECORD])["starts"]) == 1
    claim_run_dir(_recipe(run), overwrite=True).release()
    assert sorted(_contents(run)) == ["base_model/warm_start.json", RECORD]


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / LOCK).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "start_ticks": "1"}))
    claim_run_dir(_recipe(run)).release()
    # a live pid whose start time differs (the pid was reused by another process): stale too
    (run / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "start_ticks": "-5"}))
    (run / RECORD).unlink()
    claim_run_dir(_recipe(run)).release()


def test_lock_of_a_live_process_names_it(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / LOCK).write_text(json.dumps({"pid": live.pid, "host": os.uname().nodename, "started": "now"}))
        assert cli.main(["train", TINY, f"logging.run_dir={run}", "checkpoint.load=latest"]) == 2
        assert f"in use by another live run: pid {live.pid}" in capsys.readouterr().err
    finally:
        live.kill()
        live.wait()


def test_base_model_reused_only_when_its_hash_matches(tmp_path):
    run = tmp_path / "run"
    r = _recipe(run)
    assert base_model_dir(r, run) == (run / "base_model", True)  # nothing yet: make base_model/
    (run / "base_model").mkdir(parents=True)
    (run / "base_model" / "warm_start.json").write_text(json.dumps({"base_hash": base_model_hash(r, 0)}))
    assert base_model_dir(r, run) == (run / "base_model", False)
    assert base_model_dir(_recipe(run, "algo.lr=1e-3", "model.fp8=none"), run) == (run / "base_model", False)
    for changed in (["model.hidden_size=96"], ["warm_start.distractor_rate=0.1"], ["schedule.seed=3"],
                    ["task.digits=3"]):
        r2 = _recipe(run, *changed)
        assert base_model_hash(r2, r2.schedule.seed) != base_model_hash(r, 0), changed
        assert base_model_dir(r2, run) == (run / f"base_model-{base_model_hash(r2, r2.schedule.seed)}", True), changed
    # a base_model/ without a record (killed warm start, older version) is never taken as matching
    (run / "base_model" / "warm_start.json").unlink()
    assert base_model_dir(r, run)[0].name.startswith("base_model-")


def test_killed_base_model_build_leaves_no_base_model(tmp_path, monkeypatch):
    import megatron_rz.learner.tiny_models as tm

    def dies(recipe, out_dir, seed=0, progress=True):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")  # the random init is on disk ...
        raise KeyboardInterrupt  # ... when the warm start is interrupted

    monkeypatch.setattr(tm, "warm_start", dies)
    with pytest.raises(KeyboardInterrupt):
        build_base_model(_recipe(tmp_path), tmp_path / "base_model")
    assert not (tmp_path / "base_model").exists()


def test_metrics_logger_never_deletes_an_earlier_file(tmp_path):
    from megatron_rz.loop.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    MetricsLogger(_recipe(tmp_path), tmp_path, resume=False).log(0, {"eval_reward": 0.5})
    kept = list(tmp_path.glob("metrics.jsonl.replaced-*"))
    assert len(kept) == 1 and kept[0].read_text() == '{"step": 1}\n'
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "eval_reward": 0.5}


def test_lock_being_written_is_not_taken_but_an_old_torn_one_is(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text('{"pid": ')  # a run that is writing its lock this very moment
    with pytest.raises(RunDirError, match="a run starting now"):
        claim_run_dir(_recipe(run))
    os.utime(run / LOCK, (0, 0))  # the same torn file, left long ago by a killed process
    claim_run_dir(_recipe(run)).release()
