"""Tools for tests/unit/test_agentic_tools.py, in a module of their own: the tool worker imports it
in its process (light: no torch), so a restarted worker is up in a fraction of a second."""

import os
import time


def echo(arg: str) -> str:
    return arg


def boom(arg: str) -> str:
    raise ZeroDivisionError(f"no {arg}")


def sleepy(arg: str) -> str:
    time.sleep(float(arg))
    return "woke"


def huge(arg: str) -> str:
    return "x" * 10_000_000


def die(arg: str) -> str:
    os._exit(3)


def pid(arg: str) -> int:
    return os.getpid()  # not a str: turned into text
