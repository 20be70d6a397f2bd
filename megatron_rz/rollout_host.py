"""The rollout component of an `rz submit` job: one process per rollout node.

    python -m megatron_rz.rollout_host RUN_DIR            serve a vLLM engine to the learner
    python -m megatron_rz.rollout_host --hold RUN_DIR     only record and hold the node

Serving (the default; the batch script sets RZ_REMOTE_ROLLOUT=1 for the learner): checks that
vLLM imports, listens on a free TCP port, records {node, addr, port, pid, gpus, job, restart} in
RUN_DIR/rollout/<node>.json and serves vllm_bridge.remote.RolloutHost: the synchronous trainer's
rank 0 connects (authkey: $RZ_ROLLOUT_AUTHKEY or RUN_DIR/rollout.key, 0600), asks it to start a
RolloutEngine on this node with the trainer's own engine settings (checkpoint on the shared
filesystem, RUN_DIR/base_model), then drives generate / update_weights / verify over the network.
Every call is logged here ("[rz rollout] <node>: generate: ..."), and the json gains the engine's
pids once it runs.

--hold: the async trainer (schedule.max_lag > 0) still runs its engine beside learner rank 0, so
for it the host only records the node and holds it.

Either way the process exits when the batch script writes RUN_DIR/LEARNER_EXITED or stops it
(SIGTERM), closing its engine first. A node that cannot import vLLM fails the job at start, not
hours later.
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


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame):  # SIGTERM: unwind so the engine is closed
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    hold = "--hold" in argv
    argv = [a for a in argv if a != "--hold"]
    if len(argv) != 1:
        print("usage: python -m megatron_rz.rollout_host [--hold] RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    if importlib.util.find_spec("vllm") is None:
        print(f"[rz rollout] {node}: vLLM is not importable with {sys.executable}; fix cluster.setup or "
              "cluster.container_image", file=sys.stderr, flush=True)
        return 3
    extra = {
        "gpus": _gpus(),
        "job": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }
    done = run_dir / DONE
    if hold:
        stop = {"now": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        info = {"node": node, "host": socket.gethostname(), "addr": os.environ.get("RZ_NODE_ADDR", ""),
                "pid": os.getpid(), **extra, "started": time.time(), "serving": False}
        out = run_dir / "rollout"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{node}.json").write_text(json.dumps(info) + "\n")
        print(f"[rz rollout] {node}: ready ({info['gpus']} GPU(s)); holding the node until the learner exits "
              "(the async trainer runs its engine beside learner rank 0)", flush=True)
        while not stop["now"] and not done.exists():
            time.sleep(1.0)
        print(f"[rz rollout] {node}: done", flush=True)
        return 0

    from vllm_bridge.remote import RolloutEngineError, RolloutHost

    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        host = RolloutHost(run_dir, node=node, addr=os.environ.get("RZ_NODE_ADDR") or None,
                           port=int(os.environ.get("RZ_ROLLOUT_PORT", "0") or 0), extra_info=extra)
    except RolloutEngineError as e:
        print(f"[rz rollout] {node}: {e}", file=sys.stderr, flush=True)
        return 4
    try:
        host.serve(should_stop=done.exists)
    except _Terminated:
        host.log("SIGTERM")
    finally:
        host.close_engine()
    host.log(f"done (calls served: {host.calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
