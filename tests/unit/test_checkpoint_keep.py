"""checkpoint.keep: a run keeps its newest N complete checkpoints, and never touches a newer
unfinished one (a save in progress) or anything that is not one of its step directories."""

from pathlib import Path

import pytest

from megatron_rz.launch.rundir import checkpoint_dir
from megatron_rz.loop.resume import latest_checkpoint, prune_checkpoints
from megatron_rz.manifest import mark_complete
from megatron_rz.recipe import load_recipe


def _save(run: Path, step: int, complete: bool = True) -> Path:
    d = checkpoint_dir(run, step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes([step % 256]) * 64)
    if complete:
        mark_complete(d, step)
    return d


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_keeps_the_newest_complete_and_spares_a_save_in_progress(tmp_path):
    run = tmp_path / "run"
    for s in (25, 50, 75):
        _save(run, s)
    _save(run, 60, complete=False)      # killed mid-save, older than the newest kept: goes
    _save(run, 100)
    _save(run, 125, complete=False)     # newer than every complete one: a save in progress, stays
    (run / "checkpoints" / "notes").mkdir()          # not a step directory: never touched
    (run / "checkpoints" / "step_x").mkdir()
    gone = prune_checkpoints(run, 2, log=lambda *_: None)
    assert sorted(p.name for p in gone) == ["step_000025", "step_000050", "step_000060"]
    assert _names(run) == ["notes", "step_000075", "step_000100", "step_000125", "step_x"]
    # what load=latest picks is unchanged by the pruning
    assert latest_checkpoint(run, log=lambda *_: None) == checkpoint_dir(run, 100)


@pytest.mark.parametrize("keep", [0, 3, 5])
def test_nothing_goes_while_there_are_no_more_than_keep(tmp_path, keep):
    run = tmp_path / "run"
    for s in (1, 2, 3):
        _save(run, s)
    assert prune_checkpoints(run, keep, log=lambda *_: None) == []
    assert _names(run) == ["step_000001", "step_000002", "step_000003"]


def test_keep_is_a_recipe_key_refused_when_negative(tmp_path):
    ok = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe.yaml", ["checkpoint.keep=2"])
    assert ok.checkpoint.keep == 2
    with pytest.raises(Exception, match="keep"):
        load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe.yaml", ["checkpoint.keep=-1"])
