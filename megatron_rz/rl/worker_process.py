"""A child process that calls functions for its parent, each call under a time limit.

The parent (``WorkerProcess``) starts ``python -m <module> <read fd> <write fd> <args>`` and speaks
to it over two pipes; the child's ``__main__`` runs ``serve``, which loads the 'module:function'
paths it was given, says "ready", then answers each ``(path, args)`` request with ``("ok", value)``
or ``("error", "ExceptionType: message")``. A call that runs past its limit kills the child
(``WorkerTimeout``); a child that dies during a call is ``WorkerDied``; either way the next call
starts a fresh one. The reward and tool workers (megatron_rz.rl.rewards, megatron_rz.rl.tools)
are built on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Callable


class WorkerLoadError(RuntimeError):
    """The child could not load its functions (the message is its ``ExceptionType: message``)."""


class WorkerTimeout(RuntimeError):
    """A call ran past its limit; the child was killed."""


class WorkerDied(RuntimeError):
    """The child died before or during a call (the message says which, and its exit code)."""


class Pipe:
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


class WorkerProcess:
    """The parent's side: ``call(request, timeout_s, label)`` sends ``request`` to the child and
    returns its reply. The child starts at the first call (``python -m module`` with ``args`` after
    the two pipe ends; it must answer "ready" within ``startup_timeout_s``) and after a timeout or a
    crash. ``what`` names the worker in messages ("the reward worker died ...")."""

    def __init__(self, module: str, args: list[str], *, what: str, startup_timeout_s: float):
        self.module, self.args, self.what = module, list(args), what
        self.startup_timeout_s = float(startup_timeout_s)
        self._proc: subprocess.Popen | None = None
        self._conn: Pipe | None = None

    def start(self) -> None:
        """Start the child and wait for its "ready": a RuntimeError when it does not come in time, a
        WorkerLoadError when the child could not load its functions."""
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.module, str(child_r), str(child_w), *self.args],
            pass_fds=(child_r, child_w), env=env, stdin=subprocess.DEVNULL)
        os.close(child_r)
        os.close(child_w)
        self._conn = Pipe(parent_r, parent_w)
        if not self._conn.poll(self.startup_timeout_s):
            self.close()
            raise RuntimeError(f"the {self.what} worker did not start within {self.startup_timeout_s:g} s")
        kind, detail = self._conn.recv()
        if kind != "ready":
            self.close()
            raise WorkerLoadError(detail)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def call(self, request, timeout_s: float, label: str):
        """The child's reply to ``request`` (``("ok", value)`` or ``("error", message)`` from
        ``serve``). Starts a child first if none runs. WorkerTimeout after ``timeout_s`` (the child is
        killed); WorkerDied when the child is gone (``label``, the call's name, is in the message)."""
        if not self.running:
            self.close()
            self.start()
        try:
            self._conn.send(request)
            ready = self._conn.poll(timeout_s)
        except (EOFError, OSError) as e:
            self.close()
            raise WorkerDied(f"the {self.what} worker died ({e})") from None
        if not ready:
            self.close()  # kills the call: a fresh child takes the next one
            raise WorkerTimeout(f"{label} ran past {timeout_s:g} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError, ValueError):
            code = self._proc.wait(timeout=5) if self._proc is not None else None
            self.close()
            raise WorkerDied(f"the {self.what} worker died during {label} (exit code {code})") from None

    def close(self) -> None:
        """Close the pipes and kill the child, if one runs."""
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


def serve(read_fd: int, write_fd: int, paths: list[str], resolve: Callable[[str], Callable],
          run: Callable[[Callable, tuple], object], error_chars: int) -> None:
    """The child's side, run by its ``__main__``: loads every path with ``resolve`` and says "ready"
    (or "failed" and why, then returns), then answers each ``(path, args)`` request with
    ``("ok", run(fn, args))``, or ``("error", "ExceptionType: message")`` cut to ``error_chars`` when
    that raises (the child goes on), until the parent is gone. A path not loaded at the start is
    loaded at its first call."""
    conn = Pipe(read_fd, write_fd)
    fns = {}
    try:
        for p in paths:
            fns[p] = resolve(p)
    except Exception as e:  # noqa: BLE001 (reported to the parent, which names what failed)
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
            out = ("ok", run(fn, args))
        except BaseException as e:  # noqa: BLE001 (a function that raises: its error is the reply)
            out = ("error", f"{type(e).__name__}: {e}"[:error_chars])
        conn.send(out)
