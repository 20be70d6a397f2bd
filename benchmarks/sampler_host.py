"""Host and GPU cost of one sampling step: vLLM's own V1 Sampler vs the aligned one (CUDA).

A decode step of a small batch is host-bound (the model's forward is a CUDA graph replay; the
sampler is not captured), so what the sampler costs on the host adds to every step. This times
``Sampler.forward`` itself -- the object vLLM's model runner calls -- on one GPU, with a real
``SamplingMetadata`` (temperature 1, no top-k / top-p, sampled-token logprobs: what rollouts ask),
seeded (a ``torch.Generator`` per request, as a per-request seed gives) and unseeded:

* ``stock``: ``vllm.v1.sample.sampler.Sampler()`` as vLLM builds it (raw logprobs);
* ``aligned``: the same class built with ``RZ_ALIGNED_SAMPLER=1`` after
  ``vllm_bridge.sampler_patch.apply()``, processed logprobs (what ``RolloutEngine(aligned=True)``
  runs);
* the aligned path's parts alone (``kernels.untruncated_logprobs``, the keyed draw with its keys,
  the sampled-token gather + finiteness flag).

Per cell: host microseconds per call (``perf_counter`` over ``--calls`` calls without a sync,
so while the host is ahead the launches only queue) and GPU microseconds per call (CUDA events
around the same calls after a sync). Prints one JSON line per cell and writes ``--out``.

    python benchmarks/sampler_host.py --out sampler_host.json [--rows 1,32,64,256] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _metadata(n: int, seeded: bool, device):
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    gens = {i: torch.Generator(device=device).manual_seed(1000 + i) for i in range(n)} if seeded else {}
    z = torch.zeros(n, device=device)
    return SamplingMetadata(
        temperature=torch.ones(n, device=device), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators=gens, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None, frequency_penalties=z,
        presence_penalties=z, repetition_penalties=torch.ones(n, device=device), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def _time(fn, calls: int) -> dict:
    import torch

    for _ in range(5):  # warm-up (Triton JIT)
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    return {"host_us": round(host / calls * 1e6, 1), "wall_us": round(wall / calls * 1e6, 1),
            "gpu_span_us": round(a.elapsed_time(b) / calls * 1e3, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,32,64,256")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args(argv)
    if os.path.exists(a.out):
        print(f"sampler_host: --out {a.out} exists; give another --out", file=sys.stderr)
        return 2
    import torch

    from vllm_bridge import sampler_patch

    sampler_patch.apply()
    from vllm.v1.sample.sampler import Sampler

    import kernels
    from kernels.triton.draw import gumbel_draw

    dev = torch.device("cuda")
    stock = Sampler()
    os.environ[sampler_patch.ENV] = "1"
    aligned = Sampler(logprobs_mode="processed_logprobs")
    del os.environ[sampler_patch.ENV]
    assert sampler_patch.is_aligned(aligned) and not sampler_patch.is_aligned(stock)
    rows = []
    for n in [int(x) for x in a.rows.split(",")]:
        logits = torch.randn(n, a.vocab, device=dev, dtype=torch.bfloat16) * 3
        temp = torch.ones(n, device=dev)
        for seeded in (False, True):
            md = _metadata(n, seeded, dev)
            keys = sampler_patch.DrawKeys()
            parts = {
                "stock": lambda: stock(logits, md),
                "aligned": lambda: aligned(logits, md),
                "aligned.logprobs": lambda: kernels.untruncated_logprobs(logits.float(), temp),
                "aligned.keys": lambda: keys.step(n, md.generators, dev),
                "aligned.draw": lambda: gumbel_draw(logits.float(), temp, keys.step(n, md.generators, dev)[0]),
                "to_float": lambda: logits.to(torch.float32),
            }
            lf = logits.float()
            lp = kernels.untruncated_logprobs(lf, temp)
            tok = gumbel_draw(lf, temp, None)
            parts["aligned.gather_finite"] = lambda: torch.isfinite(lp.gather(1, tok.unsqueeze(1)).squeeze(1)).all()
            row = {"rows": n, "vocab": a.vocab, "seeded": seeded}
            for name, fn in parts.items():
                row[name] = _time(fn, a.calls)
            print(json.dumps(row), flush=True)
            rows.append(row)
    json.dump({"gpu": torch.cuda.get_device_name(), "calls": a.calls, "rows": rows}, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
