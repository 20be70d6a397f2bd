"""The learner's critical path of an asynchronous run's weight push (the filesystem transport): every
bucket file written inline, against the background writer (``FilesystemTransport.push_background``:
the learner waits only for the copy of each bucket to host memory).

    python benchmarks/sync_write.py --out OUT.json [--gb 0.85] [--device cpu|cuda] [--rounds 3]
        [--budget-gb 4] [--dir DIR]

Weights: bf16 tensors of a gpu_moe-sized model (``--gb`` of them, 2-16 MB each) on ``--device``; the
bucket stream is the learner's (``iter_buckets`` with the trainer's 64 MB buckets: detached clones where
the weights are). Per round, inline and background alternate (which goes first alternates too):
``critical_s`` = the push call (what the learner waits for), ``done_s`` = until the version is written
and renamed (the rollout is told then), each version verified byte for byte against the weights it
was pushed from. The rounds' medians and min-max go to ``--out``; the version directories are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def weights(gb: float, device: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    out, total, i = {}, 0, 0
    target = int(gb * 1e9)
    while total < target:
        rows = 1024 * (1 + i % 8)  # 2-16 MB bf16 tensors, as a MoE model's experts and projections
        t = torch.randn(rows, 1024, generator=g).to(torch.bfloat16).to(device)
        out[f"model.layers.{i // 16}.w{i % 16}"] = t
        total += t.numel() * 2
        i += 1
    return out


def one(params: dict, directory: Path, version: int, background: bool, budget: int) -> dict:
    import torch
    from safetensors.torch import load_file

    from vllm_bridge.weights import make_transport
    from vllm_bridge.weights.buckets import DEFAULT_BUCKET_BYTES, iter_buckets

    # the transport an asynchronous run's learner gets (rollout process placement: max_lag > 0)
    t = make_transport("filesystem", run_dir=directory, max_lag=2, background_bytes=budget if background else 0)
    got = []
    if params and next(iter(params.values())).is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    info = t.push_background(iter_buckets(params.items(), DEFAULT_BUCKET_BYTES, device=None), version, got.append)
    critical = time.perf_counter() - t0
    t.flush()
    done = time.perf_counter() - t0
    t.close()
    files = {}
    for p in got[0].paths:
        files.update(load_file(p))
    ok = files.keys() == params.keys() and all(torch.equal(files[k], v.cpu()) for k, v in params.items())
    if not ok:
        raise SystemExit(f"sync_write: version {version} differs from the weights it was pushed from")
    shutil.rmtree(Path(got[0].paths[0]).parent)
    return {"critical_s": critical, "done_s": done, "waited_s": info["waited_s"], "bytes": info["bytes"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, default=0.85)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-gb", type=float, default=4.0)
    ap.add_argument("--dir", default="", help="where the versions are written (default: a temporary directory)")
    a = ap.parse_args(argv)
    if os.path.exists(a.out):
        print(f"sync_write: --out {a.out} already exists; give another path", file=sys.stderr)
        return 2
    if a.dir and (Path(a.dir) / "rollout" / "weights").exists():
        print(f"sync_write: --dir {a.dir} already holds weight versions (a run's?); give an empty directory",
              file=sys.stderr)
        return 2
    params = weights(a.gb, a.device)
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="rz_sync_write_"))
    budget = int(a.budget_gb * (1 << 30))
    rows = {"inline": [], "background": []}
    version = 0
    for r in range(a.rounds):
        order = ("inline", "background") if r % 2 == 0 else ("background", "inline")
        for kind in order:
            version += 1
            rows[kind].append(one(params, base, version, kind == "background", budget))
            print(f"round {r} {kind}: {json.dumps({k: round(v, 4) for k, v in rows[kind][-1].items()})}", flush=True)
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)

    def summary(xs, key):
        v = [x[key] for x in xs]
        return {"median": statistics.median(v), "min": min(v), "max": max(v)}

    res = {"device": a.device, "gb": sum(p.numel() * 2 for p in params.values()) / 1e9, "tensors": len(params),
           "budget_gb": a.budget_gb, "rounds": a.rounds, "cpu_count": os.cpu_count(),
           **{k: {"critical_s": summary(v, "critical_s"), "done_s": summary(v, "done_s"), "rounds": v}
              for k, v in rows.items()}}
    res["critical_background_over_inline"] = res["background"]["critical_s"]["median"] / res["inline"]["critical_s"]["median"]
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"critical path: inline {res['inline']['critical_s']['median']:.3f} s, background "
          f"{res['background']['critical_s']['median']:.3f} s (x{res['critical_background_over_inline']:.2f}); "
          f"written: inline {res['inline']['done_s']['median']:.3f} s, background {res['background']['done_s']['median']:.3f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
