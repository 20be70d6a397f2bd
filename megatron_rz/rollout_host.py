"""The rollout component of an `rz submit` job: one process per rollout node.

    python -m megatron_rz.rollout_host RUN_DIR

It checks that the node can run the engine stack (vLLM importable, the GPUs SLURM gave it),
records the node in RUN_DIR/rollout/<node>.json (host, address, GPUs) for the learner side, and
holds the node until the batch script writes RUN_DIR/LEARNER_EXITED or stops it (SIGTERM).

Today the trainers start their vLLM engine from learner rank 0 (megatron_rz.trainer.RolloutSide,
async_trainer.RolloutProcess), so the engines still run on the learner's first node; this host is
where remote engines start once the trainer can drive them over the network. A node that cannot
import vLLM fails the job at start, not hours later.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

DONE = "LEARNER_EXITED"


def _gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m megatron_rz.rollout_host RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    if importlib.util.find_spec("vllm") is None:
        print(f"[rz rollout] {node}: vLLM is not importable with {sys.executable}; fix cluster.setup or "
              "cluster.container_image", file=sys.stderr, flush=True)
        return 3
    info = {
        "node": node,
        "host": socket.gethostname(),
        "addr": os.environ.get("RZ_NODE_ADDR", ""),
        "gpus": _gpus(),
        "pid": os.getpid(),
        "job": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "started": time.time(),
    }
    out = run_dir / "rollout"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{node}.json").write_text(json.dumps(info) + "\n")
    print(f"[rz rollout] {node}: ready ({info['gpus']} GPU(s)); holding the node until the learner exits",
          flush=True)
    while not stop["now"] and not (run_dir / DONE).exists():
        time.sleep(1.0)
    print(f"[rz rollout] {node}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
