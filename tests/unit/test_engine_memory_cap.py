"""vLLM differences the engine and its workers meet: gpu_memory_utilization beside a colocated learner (capped at the free fraction of the GPU), and the tensors no weight loader writes on a vLLM without that set."""

import torch

from vllm_bridge import engine


def test_no_cuda_leaves_vllms_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine._colocated_memory_cap() == {}


def test_a_gpu_with_a_learner_on_it_gets_the_free_fraction(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # the H100 of the 2026-12-07 bench step: 72.59 of 79.18 GiB free with the gpu_moe learner resident
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(72.59 * gib), int(79.18 * gib)))
    cap = engine._colocated_memory_cap()["gpu_memory_utilization"]
    assert cap * 79.18 < 72.59  # vLLM's start-up check: utilization x total <= free
    assert cap > 0.85


def test_an_empty_gpu_keeps_vllms_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (139 << 30, 140 << 30))
    assert engine._colocated_memory_cap() == {}


def test_a_cuda_runtime_error_leaves_vllms_default(monkeypatch):
    def boom():
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", boom)
    assert engine._colocated_memory_cap() == {}


def test_skip_load_tensors_of_a_vllm_without_the_set_are_0_32s(monkeypatch):
    """vllm_compat item 6: on vLLM 0.26 (no SKIP_LOAD_TENSORS) the layout check leaves out the same
    names vLLM 0.32 does; here (0.32) the installed set and the fallback must agree."""
    import builtins

    import pytest

    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    from vllm_bridge import vllm_compat

    assert vllm_compat.skip_load_tensors() == frozenset(SKIP_LOAD_TENSORS)
    real_import, refused = builtins.__import__, []

    def without_the_set(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "vllm.model_executor.model_loader.reload.meta" and "SKIP_LOAD_TENSORS" in (fromlist or ()):
            refused.append(name)
            raise ImportError("cannot import name 'SKIP_LOAD_TENSORS'")  # as vLLM 0.26 answers
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", without_the_set)
    assert vllm_compat.skip_load_tensors() == frozenset(SKIP_LOAD_TENSORS)
    assert refused  # the fallback answered, not the installed set
