"""The rollout component of an `rz submit` job: one process per rollout node.

    python -m megatron_rz.rollout_host RUN_DIR

Checks that vLLM imports, listens on a free TCP port, records {node, addr, port, pid, gpus, job,
restart} in RUN_DIR/rollout/<node>.json and serves vllm_bridge.remote.RolloutHost to learner rank 0
(authkey: $RZ_ROLLOUT_AUTHKEY or RUN_DIR/rollout.key, 0600; the batch script sets RZ_REMOTE_ROLLOUT=1
for the learner). The checkpoint is on the shared filesystem (RUN_DIR/base_model).

* Synchronous trainer (schedule.max_lag = 0): rank 0 asks the host to start a RolloutEngine on this
  node with the trainer's own engine settings, then calls generate / update_weights / verify.
* Asynchronous trainer (max_lag > 0): rank 0 starts the streaming op "rollout": this process runs
  the async rollout loop (megatron_rz.async_trainer.run_rollout: engine, in-flight weight swaps,
  lag bound) for its share of every batch, sends batches back and takes weight versions (files
  on the shared filesystem) as they come.

Every call is logged here ("[rz rollout] <node>: ..."). The process exits when the batch script
writes RUN_DIR/LEARNER_EXITED or stops it (SIGTERM), closing its engine first. A node that cannot
import vLLM fails the job at start, not hours later.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import sys
from pathlib import Path

DONE = "LEARNER_EXITED"


def _gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)


class _Terminated(SystemExit):
    """SIGTERM: a SystemExit, so that it unwinds through the request handlers (which report other
    exceptions to the learner and keep serving) and every engine is closed on the way out."""


def _raise_terminated(signum, frame):
    raise _Terminated(128 + signum)


def _serve_async_rollout(kw, results, control):
    from megatron_rz.async_trainer import serve_rollout

    return serve_rollout(kw, results, control)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m megatron_rz.rollout_host RUN_DIR", file=sys.stderr)
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

    from vllm_bridge.remote import RolloutEngineError, RolloutHost

    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        host = RolloutHost(run_dir, node=node, addr=os.environ.get("RZ_NODE_ADDR") or None,
                           port=int(os.environ.get("RZ_ROLLOUT_PORT", "0") or 0), extra_info=extra,
                           streams={"rollout": _serve_async_rollout})
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
