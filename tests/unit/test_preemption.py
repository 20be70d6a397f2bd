"""The learner-side preemption hook (megatron_rz.launch.preemption), on one process without SLURM."""

import os
import signal

import pytest

from megatron_rz.launch import preemption
from megatron_rz.manifest import COMPLETE


class _Learner:
    """Stands in for Learner.save_checkpoint (one rank): the directory plus its COMPLETE marker."""

    def __init__(self):
        self.saved = []

    def save_checkpoint(self, d, step):
        d.mkdir(parents=True)
        (d / COMPLETE).write_text(f"step {step}\n")
        self.saved.append((d, step))
        return d


@pytest.fixture
def flag(tmp_path, monkeypatch):
    path = tmp_path / "preempt.requested"
    monkeypatch.setenv(preemption.PREEMPT_FILE_ENV, str(path))
    monkeypatch.setattr(preemption, "_signalled", False)
    return path


def test_no_request_no_checkpoint(flag, tmp_path):
    lrn = _Learner()
    preemption.checkpoint_and_exit_if_requested(lrn, tmp_path, 3, 10)
    assert lrn.saved == [] and not (tmp_path / preemption.MARKER).exists()


def test_file_request_checkpoints_that_step_and_exits_0(flag, tmp_path):
    flag.touch()
    lrn = _Learner()
    with pytest.raises(SystemExit) as e:
        preemption.checkpoint_and_exit_if_requested(lrn, tmp_path, 3, 10)
    assert e.value.code == 0
    assert lrn.saved == [(tmp_path / "checkpoints" / "step_000003", 3)]
    assert (tmp_path / preemption.MARKER).read_text().strip() == "3"


def test_last_step_finishes_normally(flag, tmp_path):
    flag.touch()
    lrn = _Learner()
    preemption.checkpoint_and_exit_if_requested(lrn, tmp_path, 10, 10)  # the final save comes next anyway
    assert lrn.saved == []


def test_sigusr1_to_the_process_counts(flag, tmp_path):
    preemption.install()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.requested_locally()
    with pytest.raises(SystemExit):
        preemption.checkpoint_and_exit_if_requested(_Learner(), tmp_path, 1, 10)
