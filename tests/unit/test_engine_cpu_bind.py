"""vLLM-CPU thread binding the engine sets when several workers share this process's CPUs."""

import os

import pytest

from vllm_bridge.engine import cpu_threads_bind


@pytest.mark.parametrize("cpus, workers, want", [
    ({0, 1}, 4, "0|1|0|1"),          # fewer CPUs than workers: one CPU each, cycling
    ({0, 1, 2, 3}, 2, "0,1|2,3"),    # contiguous shares
    ({2, 5, 7}, 2, "2|5,7"),         # the allowed CPUs, not 0..n-1
    ({0, 1}, 1, None),               # one worker: vLLM's default
])
def test_binding_shares_the_allowed_cpus(monkeypatch, cpus, workers, want):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    assert cpu_threads_bind(workers) == want


def test_a_binding_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|0-1")
    assert cpu_threads_bind(2) is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # empty counts as unset (vLLM fails on it at TP > 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_threads_bind(2) == "0|1"
