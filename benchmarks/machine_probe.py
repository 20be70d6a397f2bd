"""How fast the machine is right now: a few fixed measurements a benchmark records beside its own.

Lent GPU machines vary: on one H100 lease stock vLLM ran a cell 45% slower than on the lease before,
and two adjacent calls of the same engine differed by 39%. A ratio measured across such a change is
not a measurement. ``probe()`` times the same small work every time, before and after each engine
of a benchmark:

* ``hbm_gbs``: device-to-device copy of 1 GiB (read + write bytes / time), median of 5;
* ``gemm_tflops``: a 4096^3 bf16 ``torch.matmul`` (cuBLAS), median of 10;
* ``host_ms``: a fixed pure-Python loop (the engine's scheduler and runner are host-bound at small
  batches), median of 5;
* ``smi``: the GPU's SM / memory clocks, temperature and power from nvidia-smi where it exists;
* ``load1``: the host's 1-minute load average.

:func:`spread` compares several probes: the largest relative difference of each timed quantity
(``(max - min) / max``), and ``stable`` = all of them within ``tol`` (default 5%).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time

__all__ = ["probe", "spread"]

SMI_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")


def _host_ms() -> float:
    def loop() -> float:
        t = time.perf_counter()
        acc = 0
        for i in range(300_000):
            acc += i & 7
        return (time.perf_counter() - t) * 1e3

    return round(statistics.median(loop() for _ in range(5)), 3)


def _smi() -> dict | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    vals = [v.strip() for v in out[0].split(",")]
    return {k: (float(v) if v.replace(".", "", 1).isdigit() else v) for k, v in zip(SMI_FIELDS, vals)}


def _gpu() -> dict:
    import torch

    def timed(fn, reps: int) -> list[float]:
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        return out

    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t_copy = statistics.median(timed(lambda: dst.copy_(src), 5))
    del src, dst
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    t_mm = statistics.median(timed(lambda: a @ b, 10))
    del a, b
    torch.cuda.empty_cache()
    return {"hbm_gbs": round(2 * 2 * n / t_copy / 1e9, 1), "gemm_tflops": round(2 * 4096 ** 3 / t_mm / 1e12, 1)}


def probe(gpu: bool | None = None) -> dict:
    """One probe of this machine (GPU parts where CUDA is available, or when ``gpu`` is True)."""
    out: dict = {"t": round(time.time(), 1), "host_ms": _host_ms(), "load1": round(os.getloadavg()[0], 2)}
    if gpu is None:
        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
    if gpu:
        try:
            out.update(_gpu())
        except Exception as e:  # noqa: BLE001 (e.g. out of memory beside a large engine: the bench goes on)
            out["gpu_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["smi"] = _smi()
    return out


def spread(probes: list[dict], tol: float = 0.05) -> dict:
    """Relative spread ``(max - min) / max`` of each timed quantity over ``probes`` (those that have
    it) and whether every one is within ``tol``."""
    res: dict = {"probes": len(probes)}
    for key in ("hbm_gbs", "gemm_tflops", "host_ms"):
        vals = [p[key] for p in probes if isinstance(p, dict) and isinstance(p.get(key), (int, float))]
        if len(vals) >= 2:
            res[key] = round((max(vals) - min(vals)) / max(vals), 3)
    timed = [v for k, v in res.items() if k != "probes"]
    res["stable"] = bool(timed) and all(v <= tol for v in timed)
    res["tol"] = tol
    return res
