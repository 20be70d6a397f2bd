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
import sys
from typing import Callable

from megatron_rz.rl.worker_process import WorkerDied, WorkerLoadError, WorkerProcess, WorkerTimeout, serve

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


class ToolWorker:
    """``call(name, arg) -> (reply, status)``; status None, "error", "timeout" or "truncated".

    ``tools``: {name: function or 'module:function'}. The child starts at the first call and is
    replaced after a timeout or a crash."""

    def __init__(self, tools: dict[str, Callable | str], timeout_s: float, max_chars: int):
        self.paths = {name: tool_path(t) for name, t in tools.items()}
        self.timeout_s, self.max_chars = float(timeout_s), int(max_chars)
        self.counts = {s: 0 for s in STATUSES}
        self.calls = 0
        self._process = WorkerProcess("megatron_rz.rl.tools", [str(self.max_chars), *self.paths.values()],
                                      what="tool", startup_timeout_s=STARTUP_TIMEOUT_S)
        self._printed = 0

    def _note(self, status: str, detail: str) -> None:
        self.counts[status] += 1
        if status != "truncated" and self._printed < MAX_PRINTED:
            self._printed += 1
            more = " (later ones are only counted)" if self._printed == MAX_PRINTED else ""
            print(f"[rz] tool {status}, its reply is the error: {detail[:200]}{more}", file=sys.stderr, flush=True)

    def call(self, name: str, arg: str) -> tuple[str, str | None]:
        path = self.paths[name]
        self.calls += 1
        try:
            kind, reply = self._process.call((path, (arg,)), self.timeout_s, name)
        except WorkerLoadError as e:
            raise ToolLoadError(f"the tool worker could not load {list(self.paths.values())}: {e}") from None
        except WorkerTimeout:
            self._note("timeout", f"{name} ran past task.tool_timeout_s={self.timeout_s:g} s")
            return f"error: {name} timed out after {self.timeout_s:g} s"[: self.max_chars], "timeout"
        except WorkerDied as e:
            self._note("error", str(e))
            return f"error: the tool {name} crashed"[: self.max_chars], "error"
        if kind == "error":
            self._note("error", f"{name}: {reply}")
            return f"error: {reply}"[: self.max_chars], "error"
        text, cut = reply
        if cut:
            self._note("truncated", name)
            return text, "truncated"
        return text, None

    def close(self) -> None:
        self._process.close()


def _serve(read_fd: int, write_fd: int, max_chars: int, paths: list[str]) -> None:
    def run(fn: Callable, args: tuple) -> tuple[str, bool]:
        value = fn(*args)
        text = value if isinstance(value, str) else str(value)
        return text[:max_chars], len(text) > max_chars  # a huge output never crosses the pipe

    serve(read_fd, write_fd, paths, resolve, run, error_chars=max_chars)  # a tool's error is its reply


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
