"""CUDA-graph timing for the GPU benchmarks: median time per call over copies that defeat L2."""

from __future__ import annotations

import statistics

import torch

L2_BYTES = 50 * 2**20


def bench_graph(make_fn, n_copies: int, iters: int = 24, reps: int = 15) -> float:
    """Median ms per call; make_fn(i) returns a no-arg callable for copy i."""
    fns = [make_fn(i) for i in range(n_copies)]
    for f in fns:  # warm-up / compile outside the graph
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fns[i % n_copies]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    del g
    return statistics.median(times)


def copies(nbytes: int) -> int:
    """How many copies of the operands make a graph replay read from HBM, not L2 (2 to 8)."""
    return max(2, min(8, -(-3 * L2_BYTES // max(nbytes, 1))))
