"""vLLM's gpu_memory_utilization beside a colocated learner: capped at the free fraction of the GPU."""

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
