"""The recipe's process settings reach this process and the environment of the processes it starts."""

from __future__ import annotations

import pytest

import kernels
from kernels import settings
from megatron_rz import manifest
from megatron_rz.recipe import load_recipe
from megatron_rz.launch.runtime import apply_runtime, child_env

KEYS = ("RZ_KERNELS", "RZ_GEMM_SMALL_TILES", "RZ_GEMM_TABLE", "RZ_KERNELS_NATIVE", "RZ_VLLM_PATCHES")


@pytest.fixture()
def restore(monkeypatch):
    for k in KEYS:  # monkeypatch puts the original values back afterwards
        monkeypatch.setenv(k, "unset")
    yield
    kernels.set_backend("auto")
    kernels.set_gemm_small_tiles(True)
    kernels.set_gemm_table("auto")
    manifest.set_verify("hash")


def test_defaults_are_what_the_code_did_before(restore):
    recipe = load_recipe(None)
    assert child_env(recipe) == {"RZ_KERNELS": "auto", "RZ_GEMM_SMALL_TILES": "1", "RZ_GEMM_TABLE": "auto",
                                 "RZ_KERNELS_NATIVE": "1", "RZ_VLLM_PATCHES": "1"}
    apply_runtime(recipe)
    assert kernels.backend() == "auto" and settings.gemm_small_tiles() and manifest.verify_mode() == "hash"
    assert settings.gemm_table() == "auto"


def test_fields_are_applied_here_and_exported(restore):
    import os

    recipe = load_recipe(None, ["runtime.kernels=reference", "runtime.gemm_small_tiles=false",
                                "runtime.vllm_patches=false", "runtime.native_cpu_kernels=false",
                                "runtime.gemm_table=off", "checkpoint.verify=size"])
    apply_runtime(recipe)
    assert kernels.backend() == "reference" and not settings.gemm_small_tiles()
    assert settings.gemm_table() == "off"
    assert manifest.verify_mode() == "size"
    assert {k: os.environ[k] for k in KEYS} == {"RZ_KERNELS": "reference", "RZ_GEMM_SMALL_TILES": "0",
                                                "RZ_GEMM_TABLE": "off", "RZ_KERNELS_NATIVE": "0",
                                                "RZ_VLLM_PATCHES": "0"}


def test_a_child_reads_them_from_the_environment(restore):
    """What a vLLM worker (started with the parent's environment) sees at import."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    apply_runtime(load_recipe(None, ["runtime.kernels=reference", "runtime.gemm_small_tiles=false",
                                     "runtime.gemm_table=off"]))
    code = "from kernels import settings; print(settings.backend(), settings.gemm_small_tiles(), settings.gemm_table())"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=60).stdout.split()
    assert out == ["reference", "False", "off"]


def test_settings_refuse_unknown_values():
    with pytest.raises(ValueError, match="'auto' or 'reference'"):
        kernels.set_backend("triton")
