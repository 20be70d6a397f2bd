"""Cost of the every-parameter weight-sync check (vllm_bridge.worker_ext.tensor_bits, what each
engine worker and the learner compute per parameter after every sync), per GB of weights, where the
weights live (CPU, or on the device on CUDA), beside a plain read of the same bytes.

    .venv/bin/python benchmarks/verify_cost.py --device cpu --gb 1 --out benchmarks/results/verify_cost_cpu.json
    python benchmarks/verify_cost.py --device cuda --gb 4 --out $OUT/verify_cost_h200.json   (on the H200)

Weights: 64 MiB tensors ([4096, 4096] fp32 / [4096, 8192] bf16) plus small ones (norm-sized, [4096]),
so the per-tensor overhead counts too. Each figure: median of 5 passes after one warm-up. On CUDA it
also checks that the device result equals the CPU result for the same bytes (the check compares a
CPU-computed learner value with a device-computed engine value).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_bridge.worker_ext import tensor_bits, tensors_bits  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median(fn, device: str, passes: int = 5) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(device: str, gb: float) -> dict:
    out: dict = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
                 "cpu_count": os.cpu_count()}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    g = torch.Generator(device=device).manual_seed(0)
    for dtype, shape in ((torch.float32, (4096, 4096)), (torch.bfloat16, (4096, 8192))):
        big = torch.empty(shape, dtype=dtype).element_size() * shape[0] * shape[1]
        n = max(1, int(gb * 1e9 // big))
        ts = [torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(n)]
        ts += [torch.randn((4096,), generator=g, device=device).to(dtype) for _ in range(4 * n)]  # norms etc.
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        bits_s = _median(lambda: [tensor_bits(t) for t in ts], device)
        read_s = _median(lambda: [t.sum() for t in ts], device)  # a plain read: torch's own sum of every element
        row = {"tensors": len(ts), "bytes": nbytes, "bits_s": bits_s, "bits_s_per_gb": bits_s / (nbytes / 1e9),
               "bits_gb_per_s": nbytes / 1e9 / bits_s, "torch_sum_s_per_gb": read_s / (nbytes / 1e9)}
        # what the sync check runs: every tensor of the list at once (on CUDA one Triton launch per
        # element size and one synchronisation, kernels.triton.bits)
        many_s = _median(lambda: tensors_bits(ts), device)
        row.update({"tensors_bits_s": many_s, "tensors_bits_s_per_gb": many_s / (nbytes / 1e9)})
        if device == "cuda":
            row["cuda_equals_cpu"] = all(tensor_bits(t) == tensor_bits(t.cpu()) for t in (ts[0], ts[-1]))
        out[str(dtype).replace("torch.", "")] = row
        print(f"{device} {dtype}: {nbytes / 1e9:.2f} GB in {len(ts)} tensors: tensor_bits {bits_s:.3f} s "
              f"({row['bits_s_per_gb']:.3f} s/GB, {row['bits_gb_per_s']:.1f} GB/s); torch's sum of the same "
              f"tensors {row['torch_sum_s_per_gb']:.3f} s/GB; the list at once (tensors_bits) "
              f"{row['tensors_bits_s_per_gb']:.4f} s/GB", flush=True)
        del ts
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    res = run(a.device, a.gb)
    res["command"] = " ".join(["python", "benchmarks/verify_cost.py", *sys.argv[1:]])
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
