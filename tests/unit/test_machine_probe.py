"""benchmarks/machine_probe.py: the machine-speed probes a GPU benchmark records before and after
each engine, and the rollout benchmark's verdict on them (benchmarks/rollout_gpu.py compare)."""

from __future__ import annotations

import pytest

from benchmarks import rollout_gpu as rg
from benchmarks.machine_probe import probe, spread


def test_host_probe_without_a_gpu():
    p = probe(gpu=False)
    assert p["host_ms"] > 0 and p["load1"] >= 0
    assert "gemm_tflops" not in p and "hbm_gbs" not in p


@pytest.mark.parametrize("probes, stable, moved", [
    ([{"gemm_tflops": 600.0, "hbm_gbs": 3000.0, "host_ms": 10.0},
      {"gemm_tflops": 590.0, "hbm_gbs": 2950.0, "host_ms": 10.3}], True, None),
    ([{"gemm_tflops": 600.0, "hbm_gbs": 3000.0, "host_ms": 10.0},
      {"gemm_tflops": 420.0, "hbm_gbs": 3000.0, "host_ms": 10.0}], False, "gemm_tflops"),
    ([{"gemm_tflops": 600.0, "host_ms": 10.0}, {"gemm_tflops": 600.0, "host_ms": 14.0}], False, "host_ms"),
    ([{"host_ms": 10.0}], False, None),  # one probe compares nothing
    ([], False, None),
])
def test_spread_flags_a_machine_that_moved(probes, stable, moved):
    s = spread(probes)
    assert s["stable"] is stable and s["probes"] == len(probes)
    if moved:
        assert s[moved] > s["tol"]


def _part(engine, medians, gemm):
    cells = [{"batch": b, "prompt": 64, "new": 128, "seeded": True, "median_s": m, "min_s": m, "max_s": m,
              "rounds_s": [m], "tok_s": 1.0} for b, m in zip((1, 32), medians)]
    probes = [{"gemm_tflops": g, "hbm_gbs": 3000.0, "host_ms": 10.0} for g in gemm]
    return {"engine": engine, "startup_s": 1.0, "env": {}, "probes": probes, "cells": cells}


def test_compare_reports_the_machine_beside_the_ratios():
    quiet = rg.compare([_part("stock", (1.0, 2.0), (600, 598)), _part("aligned", (1.1, 2.0), (601, 599))])
    assert quiet["summary"]["aligned_over_stock"]["worst"] == 1.1
    assert quiet["summary"]["machine"]["stable"] and quiet["summary"]["machine"]["probes"] == 4
    assert len(quiet["engines"]["stock"]["probes"]) == 2
    noisy = rg.compare([_part("stock", (1.0, 2.0), (600, 598)), _part("aligned", (1.1, 2.0), (450, 600))])
    assert not noisy["summary"]["machine"]["stable"] and noisy["summary"]["machine"]["gemm_tflops"] == 0.25
    old = rg.compare([{k: v for k, v in _part("stock", (1.0, 2.0), ()).items() if k != "probes"},
                      _part("aligned", (1.1, 2.0), ())])
    assert not old["summary"]["machine"]["stable"]  # parts without probes: nothing says the machine held
