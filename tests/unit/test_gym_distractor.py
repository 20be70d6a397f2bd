"""The reasoning-gym task's planted mistake for the warm start (GymTask.distractor, chain_sum)."""

import random

import pytest

pytest.importorskip("reasoning_gym")

from megatron_rz.recipe import TaskConfig
from megatron_rz.rl.gym_task import GymTask, chain_sum_distractor


def _e(expr):
    return {"metadata": {"expression": expr}}


def test_chain_sum_distractor_forgets_carry_and_borrow():
    assert chain_sum_distractor(_e("47 + 38")) == "75"
    assert chain_sum_distractor(_e("52 - 17")) == "45"
    assert chain_sum_distractor(_e("17 - 52")) == "-45"
    assert chain_sum_distractor(_e("7 + 45")) == "42"
    assert chain_sum_distractor(_e("1 + 2 + 3")) is None


def test_gym_task_distractor_only_where_it_differs():
    task = GymTask(TaskConfig(name="reasoning_gym", eval_prompts=4, kwargs={
        "dataset": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}))
    probs = task.sample(random.Random(0), 200)
    wrong = [task.distractor(p) for p in probs]
    assert all(w is None or w != p.answer for w, p in zip(wrong, probs))
    assert 0.2 < sum(w is not None for w in wrong) / len(wrong) < 0.8  # carries / borrows are common
    other = GymTask(TaskConfig(name="reasoning_gym", eval_prompts=4, kwargs={"dataset": "leg_counting"}))
    assert other.distractor(other.sample(random.Random(0), 1)[0]) is None
