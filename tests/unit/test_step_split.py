"""The RL step's split (the weight push's bytes and export time, per-update medians) and where evaluations are drawn."""

import torch

from megatron_rz.loop import trainer


def test_the_counted_stream_passes_every_bucket_and_times_only_the_making_of_them(monkeypatch):
    clock = [100.0]  # a clock that moves only when the test says: no wall-clock timing here
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: clock[0])

    def export():
        for i in range(3):
            clock[0] += 0.5  # the learner's export of one bucket
            yield {f"w{i}": torch.zeros(4, 8, dtype=torch.bfloat16), f"b{i}": torch.zeros(8)}
        clock[0] += 0.25  # finishing the stream (the last gather) is export time too

    tally = [0, 0.0]
    seen = []
    for b in trainer._counted(export(), tally):
        clock[0] += 7.0  # the transport's work on the bucket: not export time
        seen.append(sorted(b))
    assert seen == [["b0", "w0"], ["b1", "w1"], ["b2", "w2"]]
    assert tally[0] == 3 * (4 * 8 * 2 + 8 * 4)
    assert tally[1] == 1.75


def test_step_split_reports_the_export_share_when_every_row_has_it():
    rows = [{"time_rollout": 9.0, "time_learner": 9.0, "time_sync": 9.0, "time_step": 27.0, "time_sync_export": 5.0}]
    rows += [{"time_rollout": 1.0 + i, "time_learner": 0.5, "time_sync": 0.8, "time_step": 2.3 + i,
              "time_sync_export": 0.2 + 0.1 * i} for i in range(3)]
    out = trainer.step_split(rows)
    assert out["updates"] == 4 and out["updates_timed"] == 3  # the first update left out
    assert out["time_rollout"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert abs(out["time_sync_export"]["median"] - 0.3) < 1e-12
    assert "time_sync_export" not in trainer.step_split([{k: v for k, v in r.items() if k != "time_sync_export"}
                                                         for r in rows])


def test_evaluations_are_drawn_at_the_version_they_measured():
    from megatron_rz.loop.metrics import eval_points

    rows = [{"step": 0, "eval/heldout/greedy": 0.3},
            {"step": 5, "lag_mean": 1.0},
            {"step": 6, "lag_mean": 1.0, "eval/heldout/greedy": 0.5, "eval_version": 4},  # async, logged later
            {"step": 9, "eval/heldout/greedy": 0.6, "eval_version": 8},
            {"step": 9, "eval/heldout/greedy": 0.7}]  # the final evaluation
    assert eval_points(rows, "heldout", "greedy") == [(0, 0.3), (4, 0.5), (8, 0.6), (9, 0.7)]
    assert eval_points(rows, "other", "greedy") == []
