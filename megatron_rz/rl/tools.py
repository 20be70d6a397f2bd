"""Tools of agentic tasks: plain Python functions, each call run under a guard.

A tool is any importable function ``fn(arg: str) -> str`` (a non-str result is turned into text
with ``str``). The model calls it as ``name(arg)`` in its turn (megatron_rz.rl.agentic.ToolEnv
parses that); ``arg`` is the text between the brackets, unparsed.

``ToolWorker`` runs the calls in a child process (this module run as ``python -m``), so a tool
cannot stop the run:

* a tool that raises: its ``ExceptionType: message`` becomes the reply, status "error";
* a tool that runs past ``timeout_s`` (task.tool_timeout_s): the child is killed and replaced, the
  reply says so, status "timeout";
* a reply longer than ``max_chars`` (task.tool_output_chars) is cut there in the child (a huge
  output never crosses the pipe), status "truncated"; error replies are cut to it too;
* a worker that dies during a call: status "error", a fresh one takes the next call.

Every status is counted (``counts``), the first few printed.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Callable

STARTUP_TIMEOUT_S = 120.0
MAX_PRINTED = 3
STATUSES = ("error", "timeout", "truncated")


class ToolLoadError(RuntimeError):
    """A tool could not be imported in the worker (named in the message)."""


def tool_path(tool: Callable | str) -> str:
    """'package.module:function' of a tool given as a function or as that path. A function must
    be importable under its module and name (not a lambda, a closure or a function of __main__):
    the worker process imports it."""
    if isinstance(tool, str):
        if ":" not in tool:
            raise ValueError(f"tool {tool!r}: name it 'package.module:function'")
        return tool
    mod, name = getattr(tool, "__module__", None), getattr(tool, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in name or "." in name:
        raise ValueError(f"tool {tool!r} is not importable as module:function (define it at the top level of a "
                         "module the run can import)")
    return f"{mod}:{name}"


def resolve(path: str) -> Callable:
    mod_name, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(mod_name), attr)
    if not callable(fn):
        raise TypeError(f"{path} is a {type(fn).__name__}, not a function")
    return fn


class _Pipe:
    """Send on one pipe end, receive on another."""

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


class ToolWorker:
    """``call(name, arg) -> (reply, status)``; status None, "error", "timeout" or "truncated".

    ``tools``: {name: function or 'module:function'}. The child starts at the first call and is
    replaced after a timeout or a crash."""

    def __init__(self, tools: dict[str, Callable | str], timeout_s: float, max_chars: int):
        self.paths = {name: tool_path(t) for name, t in tools.items()}
        self.timeout_s, self.max_chars = float(timeout_s), int(max_chars)
        self.counts = {s: 0 for s in STATUSES}
        self.calls = 0
        self._proc: subprocess.Popen | None = None
        self._conn: _Pipe | None = None
        self._printed = 0

    def _start(self) -> None:
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_rz.rl.tools", str(child_r), str(child_w), str(self.max_chars),
             *self.paths.values()], pass_fds=(child_r, child_w), env=env, stdin=subprocess.DEVNULL)
        os.close(child_r)
        os.close(child_w)
        self._conn = _Pipe(parent_r, parent_w)
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the tool worker did not start within {STARTUP_TIMEOUT_S:g} s")
        kind, detail = self._conn.recv()
        if kind != "ready":
            self.close()
            raise ToolLoadError(f"the tool worker could not load {list(self.paths.values())}: {detail}")

    def _note(self, status: str, detail: str) -> None:
        self.counts[status] += 1
        if status != "truncated" and self._printed < MAX_PRINTED:
            self._printed += 1
            more = " (later ones are only counted)" if self._printed == MAX_PRINTED else ""
            print(f"[rz] tool {status}, its reply is the error: {detail[:200]}{more}", file=sys.stderr, flush=True)

    def call(self, name: str, arg: str) -> tuple[str, str | None]:
        path = self.paths[name]
        self.calls += 1
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        try:
            self._conn.send((path, (arg,)))
            ready = self._conn.poll(self.timeout_s)
        except (BrokenPipeError, EOFError, OSError) as e:
            self.close()
            self._note("error", f"the tool worker died ({e})")
            return f"error: the tool {name} crashed"[: self.max_chars], "error"
        if not ready:
            self.close()  # kills the call: a fresh worker takes the next one
            self._note("timeout", f"{name} ran past task.tool_timeout_s={self.timeout_s:g} s")
            return f"error: {name} timed out after {self.timeout_s:g} s"[: self.max_chars], "timeout"
        try:
            kind, text, cut = self._conn.recv()
        except (EOFError, OSError, ValueError):
            code = self._proc.wait(timeout=5) if self._proc is not None else None
            self.close()
            self._note("error", f"the tool worker died during {name} (exit code {code})")
            return f"error: the tool {name} crashed"[: self.max_chars], "error"
        if kind == "error":
            self._note("error", f"{name}: {text}")
            return f"error: {text}"[: self.max_chars], "error"
        if cut:
            self._note("truncated", name)
            return text, "truncated"
        return text, None

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


def _serve(read_fd: int, write_fd: int, max_chars: int, paths: list[str]) -> None:
    conn = _Pipe(read_fd, write_fd)
    fns = {}
    try:
        for p in paths:
            fns[p] = resolve(p)
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            path, args = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        try:
            value = fns[path](*args)
            text = value if isinstance(value, str) else str(value)
            out = ("ok", text[:max_chars], len(text) > max_chars)
        except BaseException as e:  # noqa: BLE001 (a tool that raises: its error is the reply)
            out = ("error", f"{type(e).__name__}: {e}"[:max_chars], False)
        conn.send(out)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
