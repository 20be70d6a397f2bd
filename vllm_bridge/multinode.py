"""One vLLM engine across several rollout nodes (tensor parallel wider than a node).

vLLM 0.32 runs such an engine with its multiprocessing executor on every node: the head node
(node_rank 0) builds the engine (``LLM(..., nnodes=k, node_rank=0, master_addr, master_port)``)
and waits in torch.distributed for the other nodes' workers; each other node (node_rank r) runs
only workers, built from the *same* engine settings (the "headless" mode of ``vllm serve``).

Here the head is a rollout host serving a RolloutEngine (vllm_bridge.remote); it learns its engine
settings from the learner's ``start`` call, so it publishes them -- the exact keyword arguments
and environment RolloutEngine passes to vLLM -- to ``RUN_DIR/rollout/engines/engine-<e>.json`` on the
shared filesystem just before it builds the engine (RolloutEngine's ``before_start`` hook). The
worker hosts of engine e wait for that file and start their workers with it
(``run_worker_node``). A new file (a restarted engine) starts them again.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

ROLLOUT_DIR = "rollout"


def engine_file(run_dir: str | os.PathLike, engine: int) -> Path:
    # a subdirectory: RUN_DIR/rollout/*.json are the hosts' own records (the batch script counts them)
    return Path(run_dir) / ROLLOUT_DIR / "engines" / f"engine-{int(engine)}.json"


def free_port() -> int:
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def head_settings(nnodes: int, master_addr: str, master_port: int | None = None) -> dict:
    """Extra RolloutEngine kwargs of an engine's head node."""
    return {"nnodes": int(nnodes), "node_rank": 0, "master_addr": master_addr,
            "master_port": int(master_port or free_port()), "distributed_executor_backend": "mp"}


def publisher(run_dir: str | os.PathLike, engine: int) -> Callable[[dict, dict], None]:
    """RolloutEngine(before_start=...) for engine `engine`'s head: write its settings atomically."""

    def publish(kwargs: dict, env: dict) -> None:
        path = engine_file(run_dir, engine)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"kwargs": kwargs, "env": env, "written": time.time()}, default=str) + "\n")
        os.replace(tmp, path)

    return publish


def wait_for_settings(run_dir: str | os.PathLike, engine: int, after: float = 0.0, poll_s: float = 1.0,
                      should_stop: Callable[[], bool] = lambda: False) -> dict | None:
    """The head's published settings newer than `after` (None if should_stop() first)."""
    path = engine_file(run_dir, engine)
    while not should_stop():
        try:
            info = json.loads(path.read_text())
            if info["written"] > after:
                return info
        except (FileNotFoundError, ValueError, KeyError):
            pass
        time.sleep(poll_s)
    return None


def run_worker_node(settings: dict, node_rank: int) -> None:
    """Run this node's tensor-parallel workers of the published engine until the head goes away."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    os.environ.update(settings["env"])
    kwargs = dict(settings["kwargs"])
    kwargs["node_rank"] = int(node_rank)
    if isinstance(kwargs.get("compilation_config"), dict):  # LLM() converts it; EngineArgs wants the class
        from vllm.config import CompilationConfig

        kwargs["compilation_config"] = CompilationConfig(**kwargs["compilation_config"])
    config = EngineArgs(**kwargs).create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT, headless=True)
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)  # returns when the workers exit (head gone, shutdown)
