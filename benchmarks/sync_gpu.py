"""Colocated weight sync on one GPU: the learner's weights into an aligned vLLM engine on the same GPU,
per transport, every parameter verified, against a plain device-to-device copy of the same bytes.

    python benchmarks/sync_gpu.py --out $OUT/sync_gpu.json [--config gpu_moe] [--transports inprocess,ipc]
        [--rounds 5]

One sync is what the training loop runs per update with schedule.max_lag=0 (megatron_rz.loop.trainer):
the learner's HF-named bucket stream (``weights.hf_buckets``), every tensor added to the every-parameter
check as it passes (``verify.SyncCheck.stream``), ``transport.deliver`` into the engine (stage each
bucket, one in-place reload, version label), then ``SyncCheck.verify`` (every worker's parameter bits
read back on the device and compared). Timed apart: the export alone (the stream walked, nothing
sent), the delivery, the verification. The copy reference: ``torch.Tensor.copy_`` of one buffer of
the model's bytes into another on the same GPU (what HBM-to-HBM reaches for this size).

Learner: ``mode=aligned`` of benchmarks/learner_gpu.py's config (random bf16 weights); engine:
``RolloutEngine(aligned=True)`` from a checkpoint of the same weights written first, 2 GB of KV cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def write_ckpt(model_cfg, sd: dict, out: Path) -> None:
    from safetensors.torch import save_file

    from megatron_rz.learner.tiny_models import hf_config

    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(model_cfg, 1, 0)
    cfg.architectures = [cfg.architectures[0] if cfg.architectures else type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.to_json_file(str(out / "config.json"))
    save_file({k: v.cpu().contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 1}))


def _copy_reference(nbytes: int, rounds: int) -> dict:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    s = statistics.median(ts)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "median_s": s, "gb_per_s": nbytes / s / 1e9}


def main(argv=None) -> int:
    import torch

    from learner_gpu import CONFIGS, bench_recipe, random_hf_weights
    from megatron_rz.learner.learner import Learner
    from megatron_rz.loop.weights import hf_buckets
    from vllm_bridge.engine import RolloutEngine
    from vllm_bridge.weights import make_transport
    from vllm_bridge.weights.verify import SyncCheck

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="gpu_moe", choices=sorted(CONFIGS))
    ap.add_argument("--transports", default="inprocess,ipc")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)

    r = bench_recipe(a.config, "aligned")
    sd = random_hf_weights(r.model)
    learner = Learner(r.model, r.parallel, r.algo, sd, seed=0, mode="aligned")
    ckpt = Path(tempfile.mkdtemp(prefix="rz_sync_ckpt_"))
    write_ckpt(r.model, sd, ckpt)
    del sd
    t0 = time.perf_counter()
    engine = RolloutEngine(ckpt, aligned=True, dtype="bfloat16", kv_cache_gb=2.0, max_model_len=256,
                           skip_tokenizer_init=True, gpu_memory_utilization=0.3)
    res: dict = {"config": a.config, "engine_start_s": time.perf_counter() - t0, "device": torch.cuda.get_device_name(),
                 "transports": {}}
    layout = SyncCheck.layout_of(engine)

    # the export alone (the bucket stream walked on the learner's GPU, nothing sent)
    ts, nbytes = [], 0
    for _ in range(a.rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        nbytes = sum(v.numel() * v.element_size() for b in hf_buckets(learner) for v in b.values())
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    res["export"] = {"median_s": statistics.median(ts), "bytes": nbytes}
    res["copy_reference"] = _copy_reference(nbytes, a.rounds)
    version = 0
    for kind in a.transports.split(","):
        transport = make_transport(kind, run_dir=tempfile.mkdtemp(prefix="rz_sync_run_"), engine=engine)
        rows = []
        for i in range(a.rounds + 1):  # the first is a warm-up (handles opened, allocator grown)
            version += 1
            check = SyncCheck(layout)
            torch.cuda.synchronize()
            t = time.perf_counter()
            info = transport.deliver(check.stream(hf_buckets(learner)), version, engine)
            t_sync = time.perf_counter() - t
            v = check.verify(engine, version)
            t_all = time.perf_counter() - t
            if i:
                rows.append({"sync_s": t_sync, "verify_s": t_all - t_sync, "total_s": t_all,
                             "learner_checksum_s": v["learner_s"], "engine_checksum_s": v["engine_s"],
                             "checked": v["checked"], "unverified": v["unverified"],
                             "reload_s": info.get("reload_s"), "pack_s": info.get("pack_s")})
        med = {k: statistics.median([row[k] for row in rows]) for k in ("sync_s", "verify_s", "total_s")}
        res["transports"][kind] = {"rounds": rows, **{f"median_{k}": v for k, v in med.items()},
                                   "gb_per_s_sync": nbytes / med["sync_s"] / 1e9,
                                   "gb_per_s_with_verify": nbytes / med["total_s"] / 1e9,
                                   "over_copy": med["total_s"] / res["copy_reference"]["median_s"]}
        print(f"[sync] {kind}: sync {med['sync_s']:.3f} s, verify {med['verify_s']:.3f} s, "
              f"{nbytes / med['total_s'] / 1e9:.2f} GB/s with verification, checked {rows[-1]['checked']}", flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    # the engine still computes with the last weights: one short generation
    out = engine.generate([[5, 6, 7, 8]], 1, temperature=1.0, max_new_tokens=8, seed=1)
    res["generate_after_ok"] = len(out[0].response_ids) == 8
    engine.close()
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "transports"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
