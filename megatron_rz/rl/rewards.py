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
import os
import subprocess
import sys
from functools import lru_cache
from multiprocessing.connection import Connection

from megatron_rz.recipe import RecipeError

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
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._printed = 0

    def _start(self) -> None:
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_rz.rl.rewards", str(child_r), str(child_w), *self.paths],
            pass_fds=(child_r, child_w), env=env, stdin=subprocess.DEVNULL)
        os.close(child_r)
        os.close(child_w)
        self._conn = _Duplex(parent_r, parent_w)
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the reward worker did not start within {STARTUP_TIMEOUT_S:g} s")
        kind, detail = self._conn.recv()
        if kind != "ready":
            self.close()
            raise RecipeError(f"task.reward: the reward worker could not load {self.paths}: {detail}")

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
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        try:
            self._conn.send((path, args))
            ready = self._conn.poll(self.timeout_s)
        except (BrokenPipeError, EOFError, OSError) as e:
            self.close()
            self._note("error", f"the reward worker died ({e})")
            return 0.0, "error"
        if not ready:
            self.close()  # kills the call: a fresh worker takes the next one
            self._note("timeout", f"{path} ran past task.reward_timeout_s={self.timeout_s:g} s")
            return 0.0, "timeout"
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait(timeout=5) if self._proc is not None else None
            self.close()
            self._note("error", f"the reward worker died during {path} (exit code {code})")
            return 0.0, "error"
        if kind == "ok":
            return value, None
        self._note("error", f"{path}: {value}")
        return 0.0, "error"

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


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


class _Duplex:
    """A Connection-like pair over two pipe ends (send on one, receive on the other)."""

    def __init__(self, read_fd: int, write_fd: int):
        self.r, self.w = Connection(read_fd, writable=False), Connection(write_fd, readable=False)

    def send(self, obj) -> None:
        self.w.send(obj)

    def recv(self):
        return self.r.recv()

    def poll(self, timeout: float) -> bool:
        return self.r.poll(timeout)

    def close(self) -> None:
        for c in (self.r, self.w):
            try:
                c.close()
            except OSError:
                pass


def _as_reward(value) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"returned {value!r}: a reward must be a finite number")
    return float(value)


def _serve(read_fd: int, write_fd: int, paths: list[str]) -> None:
    conn = _Duplex(read_fd, write_fd)
    fns = {}
    try:
        for p in paths:
            fns[p] = resolve(p)
    except Exception as e:  # noqa: BLE001 (reported to the parent, which names task.reward)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            path, args = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        try:
            fn = fns.get(path) or fns.setdefault(path, resolve(path))
            out = ("ok", _as_reward(fn(*args)))
        except BaseException as e:  # noqa: BLE001 (a reward that raises scores 0; the worker stays)
            out = ("error", f"{type(e).__name__}: {str(e)[:500]}")
        conn.send(out)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
