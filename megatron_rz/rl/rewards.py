"""Rewards of the data tasks, and the guard every one of their calls runs under.

``task.reward`` names one:

* ``math_verify``: the response's final or ``\\boxed{}`` answer is equivalent to the reference
  answer, as math-verify's ``parse`` + ``verify`` decide (LaTeX and plain expressions; the last
  ``\\boxed{}`` takes priority);
* ``exact``: the stripped response equals the stripped reference answer;
* ``package.module:fn``: a user function ``fn(response, answer, row) -> float`` (row: the dataset
  row, every column).

Rewards run in a worker process (``RewardWorker``, this module run as ``python -m``), so a reward
that hangs is killed: a call that raises, returns something that is not a finite number, or runs
past ``task.reward_timeout_s`` scores 0 and is counted (status "error" / "timeout"); the worker is
replaced and the run goes on. math-verify's own per-parse timeouts (signal alarms) work there
because the worker calls it in its main thread.
"""

from __future__ import annotations

import importlib
import math
import sys
from functools import lru_cache

from megatron_rz.recipe import RecipeError
from megatron_rz.rl.worker_process import WorkerDied, WorkerLoadError, WorkerProcess, WorkerTimeout, serve

BUILTIN_REWARDS = ("math_verify", "exact")
STARTUP_TIMEOUT_S = 300.0  # the worker's python start and its reward module's imports (sympy: ~1 s)
MAX_PRINTED = 3  # reward errors printed per guard; the rest are only counted


# ---------------------------------------------------------------- the reward functions


@lru_cache(maxsize=65536)
def _gold(answer: str):
    from math_verify import parse

    # A bare reference ("\frac{1}{2}", "0.5", "(1,2)") is read as LaTeX math; one that brings its own
    # delimiters or \boxed{} as it is.
    text = answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"
    gold = parse(text) or parse(answer)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    return gold


def math_verify_reward(response: str, answer: str, row=None) -> float:
    """1.0 when the response's final / boxed answer equals ``answer`` (math-verify), else 0.0."""
    from math_verify import parse, verify

    pred = parse(response)
    return 1.0 if pred and verify(_gold(str(answer)), pred) else 0.0


def exact_reward(response: str, answer: str, row=None) -> float:
    return 1.0 if response.strip() == str(answer).strip() else 0.0


FUNCTIONS = {"math_verify": "megatron_rz.rl.rewards:math_verify_reward", "exact": "megatron_rz.rl.rewards:exact_reward"}


def function_path(reward: str) -> str:
    """The 'module:function' path of a task.reward value."""
    return FUNCTIONS.get(reward, reward)


def resolve(path: str):
    """The function at 'package.module:fn', or a RecipeError naming task.reward."""
    mod_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise RecipeError(f"task.reward={path!r} could not be imported ({type(e).__name__}: {e}); name a function "
                          "'package.module:fn' importable here (fn(response, answer, row) -> float)") from None
    if not callable(fn):
        raise RecipeError(f"task.reward={path!r} is a {type(fn).__name__}, not a function")
    return fn


# ---------------------------------------------------------------- the guard


class RewardWorker:
    """Calls 'module:function' paths in a child process with a per-call time limit.

    ``call(path, args) -> (value, status)``: status None (value is the reward), "error" or
    "timeout" (value 0.0). The child starts at the first call (a task built only to make a
    tokenizer or to check a recipe starts none) and is replaced after a timeout or a crash.
    ``errors`` / ``timeouts`` count every such call."""

    def __init__(self, paths: list[str], timeout_s: float):
        self.paths, self.timeout_s = list(paths), float(timeout_s)
        self.errors = self.timeouts = 0
        self._process = WorkerProcess("megatron_rz.rl.rewards", self.paths, what="reward",
                                      startup_timeout_s=STARTUP_TIMEOUT_S)
        self._printed = 0

    def _note(self, status: str, detail: str) -> None:
        if status == "error":
            self.errors += 1
        else:
            self.timeouts += 1
        if self._printed < MAX_PRINTED:
            self._printed += 1
            more = " (later ones are only counted)" if self._printed == MAX_PRINTED else ""
            print(f"[rz] reward {status}, scored 0: {detail[:300]}{more}", file=sys.stderr, flush=True)

    def call(self, path: str, args: tuple) -> tuple[float, str | None]:
        try:
            kind, value = self._process.call((path, args), self.timeout_s, path)
        except WorkerLoadError as e:
            raise RecipeError(f"task.reward: the reward worker could not load {self.paths}: {e}") from None
        except WorkerTimeout:
            self._note("timeout", f"{path} ran past task.reward_timeout_s={self.timeout_s:g} s")
            return 0.0, "timeout"
        except WorkerDied as e:
            self._note("error", str(e))
            return 0.0, "error"
        if kind == "ok":
            return value, None
        self._note("error", f"{path}: {value}")
        return 0.0, "error"

    def close(self) -> None:
        self._process.close()


class GuardedReward:
    """The reward methods of the data tasks: ``score`` through one RewardWorker per task (started at
    the first call), ``exact`` in-process (it cannot hang). Needs ``reward_path`` and ``cfg``."""

    reward_path: str
    _worker: RewardWorker | None = None

    def score(self, problem, response: str) -> tuple[float, str | None]:
        if self.reward_path == FUNCTIONS["exact"]:
            return exact_reward(response, problem.answer), None
        if self._worker is None:
            self._worker = RewardWorker([self.reward_path], self.cfg.reward_timeout_s)
        return self._worker.call(self.reward_path, (response, problem.answer, problem.row))

    def reward(self, problem, response: str) -> float:
        return self.score(problem, response)[0]

    @property
    def reward_counts(self) -> dict:
        w = self._worker
        return {"reward_errors": w.errors if w else 0, "reward_timeouts": w.timeouts if w else 0}

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def _as_reward(value) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"returned {value!r}: a reward must be a finite number")
    return float(value)


def _score(fn, args: tuple) -> float:
    return _as_reward(fn(*args))


if __name__ == "__main__":
    # a reward that raises scores 0 and the worker stays
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:], resolve, _score, error_chars=500)
