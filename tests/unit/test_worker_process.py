"""megatron_rz.rl.worker_process: a call's value comes back, an exception is the error reply and
the child goes on, a call past its limit kills the child and the next call gets a fresh one, a
child that dies during a call is WorkerDied, a function that cannot load is WorkerLoadError, and
close() ends the child."""

from __future__ import annotations

import os

import pytest

from megatron_rz.rl.worker_process import WorkerDied, WorkerLoadError, WorkerProcess, WorkerTimeout

CHILD = "worker_process_child"  # tests/unit/worker_process_child.py: the child imports it from there
LIMIT_S = 30.0  # a generous limit for the calls that should answer at once


def _worker(*names: str) -> WorkerProcess:
    return WorkerProcess(CHILD, [f"{CHILD}:{n}" for n in names], what="test", startup_timeout_s=120)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def worker():
    w = _worker("add", "divide", "sleep", "pid", "die")
    yield w
    w.close()


def test_a_call_returns_the_value_and_an_exception_is_the_error_reply(worker):
    assert not worker.running  # the child starts at the first call
    assert worker.call((f"{CHILD}:add", (2, 3)), LIMIT_S, "add") == ("ok", 5)
    first = worker.call((f"{CHILD}:pid", ()), LIMIT_S, "pid")[1]
    assert worker.call((f"{CHILD}:divide", (1, 0)), LIMIT_S, "divide") == ("error", "ZeroDivisionError: division by zero")
    kind, message = worker.call((f"{CHILD}:add", ("x" * 100, 1)), LIMIT_S, "add")
    assert kind == "error" and message.startswith("TypeError: ") and len(message) == 40  # cut to error_chars
    assert worker.call((f"{CHILD}:pid", ()), LIMIT_S, "pid") == ("ok", first)  # an exception does not cost the child


def test_a_call_past_its_limit_kills_the_child_and_the_next_call_gets_a_fresh_one(worker):
    first = worker.call((f"{CHILD}:pid", ()), LIMIT_S, "pid")[1]
    with pytest.raises(WorkerTimeout, match="sleep ran past 0.5 s"):
        worker.call((f"{CHILD}:sleep", (60,)), 0.5, "sleep")
    assert not worker.running and _gone(first)
    assert worker.call((f"{CHILD}:sleep", (0,)), LIMIT_S, "sleep") == ("ok", "woke")
    assert worker.call((f"{CHILD}:pid", ()), LIMIT_S, "pid")[1] != first


def test_a_child_that_dies_during_a_call_is_replaced(worker):
    with pytest.raises(WorkerDied, match=r"the test worker died during die \(exit code 3\)"):
        worker.call((f"{CHILD}:die", ()), LIMIT_S, "die")
    assert worker.call((f"{CHILD}:add", (1, 1)), LIMIT_S, "add") == ("ok", 2)


def test_close_ends_the_child(worker):
    pid = worker.call((f"{CHILD}:pid", ()), LIMIT_S, "pid")[1]
    assert worker.running and not _gone(pid)
    worker.close()
    assert not worker.running and _gone(pid)
    worker.close()  # twice is fine


def test_a_function_that_cannot_load_is_a_load_error():
    w = _worker("add", "no_such_function")
    try:
        with pytest.raises(WorkerLoadError, match="AttributeError: .*no_such_function"):
            w.call((f"{CHILD}:add", (1, 1)), LIMIT_S, "add")
        assert not w.running
    finally:
        w.close()
