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

Engines and processes (set by the batch script, see megatron_rz.submit.rollout_tasks): with
RZ_ROLLOUT_TASKS_PER_NODE > 1 (an engine smaller than a node) SLURM starts one host per engine on
each node, each seeing only its engine's GPUs, recorded as <node>-<local id>; with
RZ_ENGINE_NODES = k > 1 (an engine wider than a node) the host on the first node of every k serves
the engine (vLLM's multi-node executor, node_rank 0) and the hosts on the other k - 1 nodes run its
workers (vllm_bridge.multinode), started from the settings the head publishes.

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


def _run_workers(run_dir: Path, name: str, addr: str | None, extra: dict, engine: int, rank: int, done: Path) -> int:
    """A non-first node of a multi-node engine: record itself, then run the engine's workers
    whenever its head publishes settings (again after a restart of the engine), until the end."""
    import json
    import time

    from vllm_bridge import multinode

    out = run_dir / "rollout"
    out.mkdir(parents=True, exist_ok=True)
    info = {"node": name, "host": socket.gethostname(), "addr": addr or "", "pid": os.getpid(), **extra,
            "role": "engine workers", "started": time.time()}
    (out / f"{name}.json").write_text(json.dumps(info) + "\n")
    print(f"[rz rollout] {name}: node {rank} of engine {engine}: waiting for its head's settings", flush=True)
    after = 0.0
    try:
        while True:
            settings = multinode.wait_for_settings(run_dir, engine, after=after, should_stop=done.exists)
            if settings is None:
                break
            after = settings["written"]
            print(f"[rz rollout] {name}: starting the workers of engine {engine} (node_rank {rank})", flush=True)
            multinode.run_worker_node(settings, rank)
            print(f"[rz rollout] {name}: workers of engine {engine} exited", flush=True)
    except _Terminated:
        print(f"[rz rollout] {name}: SIGTERM", flush=True)
    print(f"[rz rollout] {name}: done", flush=True)
    return 0


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
    tasks = int(os.environ.get("RZ_ROLLOUT_TASKS_PER_NODE", "1") or 1)
    name = node if tasks == 1 else f"{node}-{os.environ.get('SLURM_LOCALID', '0')}"
    engine_nodes = int(os.environ.get("RZ_ENGINE_NODES", "1") or 1)
    addr = os.environ.get("RZ_NODE_ADDR") or None
    engine_extra = {}
    signal.signal(signal.SIGTERM, _raise_terminated)
    if engine_nodes > 1:
        from vllm_bridge import multinode

        node_id = int(os.environ.get("SLURM_NODEID", "0") or 0)
        engine, rank = divmod(node_id, engine_nodes)
        extra.update(engine=engine, engine_node_rank=rank)
        if rank:
            return _run_workers(run_dir, name, addr, extra, engine, rank, done)
        engine_extra = {**multinode.head_settings(engine_nodes, addr or socket.gethostbyname(socket.gethostname())),
                        "before_start": multinode.publisher(run_dir, engine)}

    from vllm_bridge.remote import RolloutEngineError, RolloutHost

    try:
        host = RolloutHost(run_dir, node=name, addr=addr,
                           port=int(os.environ.get("RZ_ROLLOUT_PORT", "0") or 0), extra_info=extra,
                           streams={"rollout": _serve_async_rollout}, engine_extra=engine_extra)
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
