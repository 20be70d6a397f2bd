"""The child of tests/unit/test_worker_process.py: a few plain functions, served by
megatron_rz.rl.worker_process.serve when this module runs as ``python -m`` (light: no torch)."""

import importlib
import os
import sys
import time

from megatron_rz.rl.worker_process import serve


def add(a, b):
    return a + b


def divide(a, b):
    return a / b


def sleep(seconds):
    time.sleep(seconds)
    return "woke"


def pid():
    return os.getpid()


def die():
    os._exit(3)


def resolve(path: str):
    mod_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod_name), attr)


def run(fn, args):
    return fn(*args)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:], resolve, run, error_chars=40)
