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
* ``aligned.sample``: ``sampler_patch.aligned_sample`` alone (what the patched ``Sampler.sample``
  runs; without vLLM, the only whole-sampler cell);
* the aligned path's parts alone: ``aligned.logprobs`` (``kernels.untruncated_logprobs``: two
  Triton launches fused, three unfused), ``aligned.keys`` (``DrawKeys.step``),
  ``aligned.keys_previous`` (the previous key building: a Python list over the rows and
  ``torch.tensor``, timed for comparison), ``aligned.draw`` (fused: ``gumbel_draw_with_logprob``,
  which also writes the sampled token's logprob and the finite flag; unfused: ``gumbel_draw``),
  ``aligned.gather_finite`` (unfused only: torch's gather / isfinite / all).

``--fused on,off`` runs every aligned cell with ``kernels.settings.set_fused_sampler`` on and off
(``RZ_FUSED_SAMPLER``: the same bits, other launch plans); a cell's name gets ``[fused]`` or
``[unfused]``. Per cell: host microseconds per call (``perf_counter`` over ``--calls`` calls
without a sync, so while the host is ahead the launches only queue) and GPU microseconds per call
(CUDA events around the same calls after a sync). Prints one JSON line per (rows, seeded) and
writes ``--out``.

    python benchmarks/sampler_host.py --out sampler_host.json [--rows 1,32,64,256] [--vocab 32000] [--fused on,off]
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
    """vLLM's SamplingMetadata of n rows (temperature 1, nothing else); without vLLM a namespace of
    the fields the aligned sampler reads."""
    import torch

    gens = {i: torch.Generator(device=device).manual_seed(1000 + i) for i in range(n)} if seeded else {}
    z = torch.zeros(n, device=device)
    fields = dict(
        temperature=torch.ones(n, device=device), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators=gens, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None, frequency_penalties=z,
        presence_penalties=z, repetition_penalties=torch.ones(n, device=device), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={})
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.metadata import SamplingMetadata
    except ImportError:
        from types import SimpleNamespace

        return SimpleNamespace(**fields, logitsprocs=None)
    return SamplingMetadata(**fields, logitsprocs=LogitsProcessors())


def _previous_keys(n: int, generators: dict, base: int, buf, device):
    """The previous ``DrawKeys.step`` body (a Python list over the rows, ``torch.tensor``, one
    pinned copy), for timing beside the current one; the keys are the same."""
    import torch

    flat = []
    for r in range(n):
        g = generators.get(r)
        if g is None:
            flat += (base, r)
        else:
            off = g.get_offset()
            g.set_offset(off + 4)
            flat += (g.initial_seed() & ((1 << 63) - 1), off // 4)
    buf[:2 * n] = torch.tensor(flat, dtype=torch.int64)
    return buf[:2 * n].to(device, non_blocking=True).view(n, 2)


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
    ap.add_argument("--fused", default="on,off", help="aligned cells with the fused plans on, off or both")
    a = ap.parse_args(argv)
    if os.path.exists(a.out):
        print(f"sampler_host: --out {a.out} exists; give another --out", file=sys.stderr)
        return 2
    modes = [m.strip() for m in a.fused.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        print("sampler_host: --fused takes on, off or on,off", file=sys.stderr)
        return 2
    import torch
    from types import SimpleNamespace

    import kernels
    from kernels import settings
    from kernels.triton.draw import gumbel_draw, gumbel_draw_with_logprob
    from vllm_bridge import sampler_patch

    dev = torch.device("cuda")
    try:
        sampler_patch.apply()
        from vllm.v1.sample.sampler import Sampler
    except ImportError:
        Sampler = None
        print("sampler_host: no vLLM here: the stock and aligned Sampler cells are left out", file=sys.stderr)
    if Sampler is not None:
        stock = Sampler()
        os.environ[sampler_patch.ENV] = "1"
        aligned = Sampler(logprobs_mode="processed_logprobs")
        del os.environ[sampler_patch.ENV]
        assert sampler_patch.is_aligned(aligned) and not sampler_patch.is_aligned(stock)
    rows = []
    for n in [int(x) for x in a.rows.split(",")]:
        logits = torch.randn(n, a.vocab, device=dev, dtype=torch.bfloat16) * 3
        lf = logits.float()
        temp = torch.ones(n, device=dev)
        for seeded in (False, True):
            md = _metadata(n, seeded, dev)
            row = {"rows": n, "vocab": a.vocab, "seeded": seeded}
            keys = sampler_patch.DrawKeys()
            bare = SimpleNamespace()  # aligned_sample's own state (keys, finite ring) lives on the sampler object
            prev_buf = torch.empty(2 * max(n, 256), dtype=torch.int64, pin_memory=True)
            cells = {
                "to_float": lambda: logits.to(torch.float32),
                "aligned.keys": lambda: keys.step(n, md.generators, dev),
                "aligned.keys_previous": lambda: _previous_keys(n, md.generators, 0, prev_buf, dev),
            }
            if Sampler is not None:
                cells["stock"] = lambda: stock(logits, md)
            for name, fn in cells.items():
                row[name] = _time(fn, a.calls)
            for mode in modes:
                settings.set_fused_sampler(mode == "on")
                tag = "[fused]" if mode == "on" else "[unfused]"
                lp = kernels.untruncated_logprobs(lf, temp)
                k = keys.step(n, md.generators, dev)[0]
                cells = {
                    "aligned.sample": lambda: sampler_patch.aligned_sample(bare, logits, md),
                    "aligned.logprobs": lambda: kernels.untruncated_logprobs(lf, temp),
                }
                if Sampler is not None:
                    cells["aligned"] = lambda: aligned(logits, md)
                if mode == "on":
                    cells["aligned.draw"] = lambda: gumbel_draw_with_logprob(lf, temp, lp, k)
                else:
                    tok = gumbel_draw(lf, temp, k)
                    cells["aligned.draw"] = lambda: gumbel_draw(lf, temp, k)
                    cells["aligned.gather_finite"] = lambda: torch.isfinite(lp.gather(1, tok.unsqueeze(1)).squeeze(1)).all()
                for name, fn in cells.items():
                    row[name + tag] = _time(fn, a.calls)
            settings.set_fused_sampler(True)
            print(json.dumps(row), flush=True)
            rows.append(row)
    json.dump({"gpu": torch.cuda.get_device_name(), "calls": a.calls, "fused": modes, "rows": rows},
              open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
