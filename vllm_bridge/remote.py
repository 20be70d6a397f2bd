"""Rollout engines on other nodes: a small authenticated transport around RolloutEngine.

Host side (``RolloutHost``, run by ``python -m megatron_rz.rollout_host RUN_DIR`` on every rollout
node of an ``rz submit`` job): listens on a TCP port, records ``{node, addr, port, pid, ...}`` in
``RUN_DIR/rollout/<node>.json``, and when the learner asks (``start``) builds a ``RolloutEngine``
on its own node with the engine arguments the learner sends (the sync trainer's own settings;
the checkpoint directory is on the shared filesystem, ``RUN_DIR/base_model``). It then serves
generate, score, update_weights, engine_checksums, weight_version and close.

Streaming ops (``RolloutHost(streams={name: handler})``, client ``RolloutStreams``): one long request
per host whose handler gets queue-like channels -- it ``put``s ``("data", msg)`` messages to the
learner and ``get``s the learner's ``("ctl", msg)`` ones -- with the same heartbeats and failure
reporting as a call. The asynchronous trainer runs its whole rollout loop on the hosts this way
(megatron_rz.async_trainer.RemoteRollout / serve_rollout).

Client side (``RemoteRolloutEngine``): the slice of RolloutEngine's interface the synchronous
trainer uses (generate, score, update_weights, verify_sync, engine_checksums, weight_version,
close), over one connection per host. With several hosts, generate/score split the prompts into
contiguous chunks (prompt i keeps seeds seed + i*n .. as on one engine, so the samples do not
depend on how many hosts there are) and weights go to every host.

Transport: ``multiprocessing.connection`` (length-prefixed pickles over TCP) with its HMAC
challenge on ``authkey`` in both directions; the key is ``$RZ_ROLLOUT_AUTHKEY`` or the file
``RUN_DIR/rollout.key`` (mode 0600, written by the batch script). Pickles are only accepted from a
peer that proved it holds the key. Weights travel as safetensors bytes in ~64 MB buckets
(``update_weights`` streams them, the host feeds them straight into the engine's in-place reload).
That is fine for tiny models; at scale the weights would go learner -> rollout GPUs over NCCL/RDMA
(vLLM's weight-transfer engines), with this channel carrying only the control messages.

Failures: an exception inside the host comes back as ``RolloutHostError`` (a RolloutEngineError)
naming the node and carrying the host's traceback. While the host works on a call it sends a
heartbeat every ``RZ_ROLLOUT_HEARTBEAT_S`` (2 s); a closed connection, or no message at all for
``RZ_ROLLOUT_HEARTBEAT_TIMEOUT_S`` (60 s: a dead node, a stopped process), raises
``RolloutEngineError("rollout host on node X is gone: ...")`` instead of hanging; so does a call
that outlives ``RZ_ROLLOUT_CALL_TIMEOUT_S`` (3600 s).

Must not import megatron (it runs on rollout nodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from vllm_bridge.engine import DEFAULT_BUCKET_BYTES, RolloutEngineError, _iter_buckets, check_weights
from vllm_bridge.worker_ext import is_readable_name

ROLLOUT_DIR = "rollout"  # RUN_DIR/rollout/<node>.json, one per host
KEY_FILE = "rollout.key"  # RUN_DIR/rollout.key, 0600
ENV_REMOTE = "RZ_REMOTE_ROLLOUT"  # "1": the sync trainer drives the hosts of RUN_DIR/rollout
ENV_HOSTS = "RZ_ROLLOUT_HOSTS"  # how many hosts the job started (the trainer checks it finds them all)
ENV_KEY = "RZ_ROLLOUT_AUTHKEY"


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


class RolloutHostError(RolloutEngineError):
    """An exception raised inside a rollout host, re-raised on the learner."""

    def __init__(self, node: str, kind: str, message: str, remote_traceback: str):
        super().__init__(f"rollout host on node {node} failed: {kind}: {message}\n"
                         f"--- traceback on {node} ---\n{remote_traceback.rstrip()}")
        self.node, self.kind, self.remote_message, self.remote_traceback = node, kind, message, remote_traceback


# ============================================================================ key and discovery


def remote_rollout_requested() -> bool:
    return os.environ.get(ENV_REMOTE, "") == "1"


def write_authkey(run_dir: str | os.PathLike) -> Path:
    """A fresh random key in RUN_DIR/rollout.key, created with mode 0600 (replaces an old one)."""
    path = Path(run_dir) / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.replace(tmp, path)
    return path


def read_authkey(run_dir: str | os.PathLike) -> bytes:
    """$RZ_ROLLOUT_AUTHKEY, else RUN_DIR/rollout.key (refused unless only its owner can read it)."""
    env = os.environ.get(ENV_KEY)
    if env:
        return env.encode()
    path = Path(run_dir) / KEY_FILE
    try:
        st = path.stat()
    except FileNotFoundError:
        raise RolloutEngineError(
            f"no rollout authkey: set ${ENV_KEY} or write {path} (mode 0600); the rz submit batch "
            "script writes it before it starts the rollout hosts"
        ) from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RolloutEngineError(f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    key = path.read_text().strip()
    if not key:
        raise RolloutEngineError(f"{path} is empty")
    return key.encode()


def read_hosts(run_dir: str | os.PathLike) -> list[dict]:
    """The hosts recorded in RUN_DIR/rollout/*.json that serve engines (have a port), by node name."""
    hosts = []
    for p in sorted((Path(run_dir) / ROLLOUT_DIR).glob("*.json")):
        with contextlib.suppress(ValueError, OSError):
            info = json.loads(p.read_text())
            if info.get("port"):
                hosts.append(info)
    return hosts


def wait_for_hosts(run_dir: str | os.PathLike, expected: int | None = None, timeout_s: float = 600.0,
                   poll_s: float = 1.0) -> list[dict]:
    """Wait until `expected` hosts (default $RZ_ROLLOUT_HOSTS, else at least one) have written their json."""
    if expected is None:
        expected = int(os.environ.get(ENV_HOSTS, "0") or 0) or 1
    t0 = time.monotonic()
    while True:
        hosts = read_hosts(run_dir)
        if len(hosts) >= expected:
            return hosts
        if time.monotonic() - t0 > timeout_s:
            raise RolloutEngineError(
                f"only {len(hosts)} of {expected} rollout host(s) wrote {Path(run_dir) / ROLLOUT_DIR}/<node>.json "
                f"within {timeout_s:.0f} s (found: {[h.get('node') for h in hosts]}); see the rollout "
                "component's lines ([rz rollout]) in the job log"
            )
        time.sleep(poll_s)


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


# ============================================================================ host


class _Stop(Exception):
    pass


class RolloutHost:
    """Serves one RolloutEngine (started on request) to one learner connection at a time."""

    def __init__(self, run_dir: str | os.PathLike, *, node: str | None = None, authkey: bytes | None = None,
                 bind: str = "0.0.0.0", addr: str | None = None, port: int = 0, extra_info: dict | None = None,
                 log: Callable[[str], None] | None = None, streams: dict[str, Callable] | None = None,
                 engine_extra: dict | None = None):
        self.run_dir = Path(run_dir)
        # RolloutEngine kwargs this host adds to the learner's (a multi-node engine's head settings)
        self.engine_extra = dict(engine_extra or {})
        # Long-running streaming ops (op name -> handler(kwargs, results, control)); the async
        # trainer's rollout loop is one (megatron_rz.async_trainer.serve_rollout).
        self.streams = dict(streams or {})
        self._send_lock = threading.Lock()
        self.node = node or socket.gethostname()
        self.authkey = authkey if authkey is not None else read_authkey(self.run_dir)
        self.heartbeat_s = _env_float("RZ_ROLLOUT_HEARTBEAT_S", 2.0)
        self._log = log or (lambda m: print(m, flush=True))
        self.engine = None
        self.calls: dict[str, int] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, port))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        if not addr:
            try:
                addr = socket.gethostbyname(socket.gethostname())
            except OSError:
                addr = "127.0.0.1"
        self.info = {"node": self.node, "host": socket.gethostname(), "addr": addr, "port": self.port,
                     "pid": os.getpid(), **(extra_info or {}), "started": time.time(), "engine": None}
        self.json_path = self.run_dir / ROLLOUT_DIR / f"{self.node}.json"
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(self.json_path, self.info)

    def log(self, msg: str) -> None:
        self._log(f"[rz rollout] {self.node}: {msg}")

    # ---- serving --------------------------------------------------------------------------------
    def serve(self, should_stop: Callable[[], bool] = lambda: False, poll_s: float = 1.0) -> None:
        """Accept learner connections until should_stop() (checked every poll_s) or a `shutdown` call."""
        self.log(f"listening on {self.info['addr']}:{self.port} (pid {os.getpid()})")
        try:
            while not should_stop():
                ready, _, _ = select.select([self.sock], [], [], poll_s)
                if not ready:
                    continue
                s, peer = self.sock.accept()
                s.setblocking(True)
                # The handshake must not hang the host on a peer that connects and says nothing.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 30, 0))
                conn = Connection(s.detach())
                try:
                    deliver_challenge(conn, self.authkey)
                    answer_challenge(conn, self.authkey)
                except Exception as e:  # wrong key, port scanner, half-open connection
                    self.log(f"refused a connection from {peer[0]}: {type(e).__name__}: {e}")
                    conn.close()
                    continue
                s = socket.socket(fileno=conn.fileno())
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
                s.detach()
                self.log(f"learner connected from {peer[0]}")
                try:
                    if self._serve_connection(conn, should_stop, poll_s):
                        return
                finally:
                    conn.close()
        finally:
            self.close_engine()
            self.sock.close()

    def _serve_connection(self, conn: Connection, should_stop, poll_s: float) -> bool:
        """Requests from one learner until it disconnects; True when it asked the host to shut down."""
        send_lock = self._send_lock = threading.Lock()
        while not should_stop():
            try:
                if not conn.poll(poll_s):
                    continue
                msg = conn.recv()
            except (EOFError, OSError):
                self.log("learner disconnected")
                return False
            op, kw = msg[0], (msg[1] if len(msg) > 1 else {})
            if op == "ctl":  # a control message for a streaming op that has already ended
                continue
            self.calls[op] = self.calls.get(op, 0) + 1
            done = threading.Event()
            beat = threading.Thread(target=self._heartbeat, args=(conn, send_lock, done), daemon=True)
            beat.start()
            try:
                reply = ("ok", self._handle(op, kw, conn))
            except _Stop:
                raise
            except BaseException as e:  # noqa: BLE001 -- every failure goes back to the learner
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                self.log(f"{op} failed: {type(e).__name__}: {e}")
                reply = ("error", self.node, type(e).__name__, str(e), traceback.format_exc())
            finally:
                done.set()
                beat.join()
            try:
                with send_lock:
                    conn.send(reply)
            except (EOFError, OSError):
                self.log(f"learner went away before the reply to {op}")
                return False
            if op == "shutdown":
                return True
        return False

    def _heartbeat(self, conn: Connection, lock: threading.Lock, done: threading.Event) -> None:
        while not done.wait(self.heartbeat_s):
            try:
                with lock:
                    conn.send(("hb",))
            except (EOFError, OSError):
                return

    def _buckets(self, conn: Connection) -> Iterator[tuple[str, Any]]:
        from safetensors.torch import load

        while True:
            msg = conn.recv()
            if msg[0] == "end":
                return
            if msg[0] != "bucket":
                raise RolloutEngineError(f"update_weights: unexpected message {msg[0]!r} in the weight stream")
            yield from load(msg[1]).items()

    def _drain(self, conn: Connection) -> None:
        """Read the rest of an update_weights stream that failed half way (up to its 'end')."""
        with contextlib.suppress(EOFError, OSError):
            while conn.recv()[0] != "end":
                pass

    def _engine(self):
        if self.engine is None:
            raise RolloutEngineError("no engine: the learner must call start first")
        return self.engine

    def _handle(self, op: str, kw: dict, conn: Connection):
        if op == "start":
            from vllm_bridge.engine import RolloutEngine

            if self.engine is not None:  # a reconnecting learner (restart): start afresh
                self.close_engine()
            self.log(f"starting the vLLM engine for {kw['model_dir']}")
            self.engine = RolloutEngine(kw["model_dir"], **{**kw.get("kwargs", {}), **self.engine_extra})
            info = {"node": self.node, "host_pid": os.getpid(), "engine_pids": self.engine.engine_pids(),
                    "worker_pids": self.engine.worker_pids(), "startup_s": self.engine.startup_s,
                    "eos_token_id": self.engine.eos_token_id, "vocab_size": self.engine.vocab_size}
            self.info["engine"] = info
            _write_json_atomic(self.json_path, self.info)
            self.log(f"engine started in {self.engine.startup_s:.1f} s (engine-core pids {info['engine_pids']}, "
                     f"worker pids {info['worker_pids']})")
            return info
        if op == "generate":
            t0 = time.perf_counter()
            out = self._engine().generate(**kw)
            self.log(f"generate: {len(kw['prompt_ids'])} prompt(s) x {kw['n']} -> {len(out)} samples in "
                     f"{time.perf_counter() - t0:.2f} s (weight version {self.engine.weight_version})")
            return out
        if op == "score":
            return self._engine().score(**kw)
        if op == "update_weights":
            try:
                info = self._engine().update_weights(self._buckets(conn), version=kw["version"],
                                                     _reload=kw.get("_reload", True))
            except BaseException:
                self._drain(conn)
                raise
            self.log(f"weights: version {info['version']}, {info['num_tensors']} tensors, "
                     f"{info['bytes'] / 1e6:.1f} MB, reload {info['reload_s']:.2f} s")
            return info
        if op == "engine_checksums":
            return self._engine().engine_checksums(kw.get("names"))
        if op == "weight_version":
            return self._engine().weight_version
        if op == "info":
            return {**self.info, "calls": dict(self.calls)}
        if op in self.streams:
            t0 = time.perf_counter()
            self.log(f"{op}: started")
            out = self.streams[op]({**kw, "engine_extra": self.engine_extra}, _ResultsChannel(conn, self._send_lock),
                                   _ControlChannel(conn))
            self.log(f"{op}: finished after {time.perf_counter() - t0:.1f} s ({out})")
            return out
        if op in ("close", "shutdown"):
            self.close_engine()
            return None
        raise RolloutEngineError(f"unknown request {op!r}")

    def close_engine(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.close()
            self.engine = None
            self.log(f"engine closed (calls served: {self.calls})")


class _ResultsChannel:
    """Queue-like sender for a streaming op: ``put(msg)`` -> ("data", msg) to the learner."""

    def __init__(self, conn: Connection, lock: threading.Lock):
        self.conn, self.lock = conn, lock

    def put(self, msg, timeout: float | None = None) -> None:
        with self.lock:  # shared with the heartbeat thread
            self.conn.send(("data", msg))

    def cancel_join_thread(self) -> None:  # multiprocessing.Queue's interface; nothing buffered here
        pass


class _ControlChannel:
    """Queue-like receiver for a streaming op: the learner's ("ctl", msg) messages.

    ``get`` raises queue.Empty on timeout and EOFError / OSError once the learner has gone."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def get(self, timeout: float | None = None):
        import queue

        if not self.conn.poll(timeout):
            raise queue.Empty
        msg = self.conn.recv()
        if msg[0] != "ctl":
            raise RolloutEngineError(f"streaming op: unexpected message {msg[0]!r} from the learner")
        return msg[1]

    def get_nowait(self):
        return self.get(0)


# ============================================================================ client


class _HostConn:
    def __init__(self, info: dict, authkey: bytes, connect_timeout_s: float):
        self.info = info
        self.node = str(info.get("node"))
        self.addr = (info.get("addr") or info.get("host") or "127.0.0.1", int(info["port"]))
        try:
            s = socket.create_connection(self.addr, timeout=connect_timeout_s)
        except OSError as e:
            raise RolloutEngineError(
                f"rollout host on node {self.node} is gone: cannot connect to {self.addr[0]}:{self.addr[1]} "
                f"({type(e).__name__}: {e})"
            ) from None
        s.setblocking(True)
        self.conn = Connection(s.detach())
        try:
            if not self.conn.poll(connect_timeout_s):
                raise TimeoutError(f"no handshake within {connect_timeout_s:.0f} s")
            answer_challenge(self.conn, authkey)
            deliver_challenge(self.conn, authkey)
        except Exception as e:
            self.conn.close()
            raise RolloutEngineError(
                f"rollout host on node {self.node} ({self.addr[0]}:{self.addr[1]}) refused the connection: "
                f"{type(e).__name__}: {e} (same {KEY_FILE} / ${ENV_KEY} on both sides?)"
            ) from None
        self.dead: str | None = None

    def gone(self, why: str) -> RolloutEngineError:
        """Mark the host dead and say so (the caller raises it)."""
        self.dead = why
        return RolloutEngineError(
            f"rollout host on node {self.node} is gone: {why}. Its engine cannot be reached; see the "
            f"rollout component's lines ([rz rollout] {self.node}) in the job log"
        )

    def send(self, msg) -> None:
        if self.dead:
            raise RolloutEngineError(f"rollout host on node {self.node} is gone: {self.dead}")
        try:
            self.conn.send(msg)
        except (EOFError, OSError) as e:
            raise self.gone(f"connection lost while sending {msg[0]!r} ({type(e).__name__}: {e})") from None

    def next_message(self, timeout_s: float, heartbeat_timeout_s: float, during: str, too_long: str):
        """The host's next message other than a heartbeat. Raises (marking the host dead) when the
        connection closes, when nothing at all arrives for heartbeat_timeout_s, or when timeout_s
        passes with only heartbeats (``too_long`` says why); a host error becomes RolloutHostError."""
        if self.dead:
            raise RolloutEngineError(f"rollout host on node {self.node} is gone: {self.dead}")
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.gone(too_long)
            try:
                if not self.conn.poll(min(heartbeat_timeout_s, left)):
                    if deadline - time.monotonic() <= 0:
                        continue
                    raise self.gone(f"no answer and no heartbeat for {heartbeat_timeout_s:.0f} s during {during} "
                                    "(RZ_ROLLOUT_HEARTBEAT_TIMEOUT_S): process stopped or node down")
                msg = self.conn.recv()
            except (EOFError, OSError) as e:
                raise self.gone(f"connection closed during {during} ({type(e).__name__}"
                                f"{': ' + str(e) if str(e) else ''}): the host process exited") from None
            if msg[0] == "hb":
                continue
            if msg[0] == "error":
                _, node, kind, message, tb = msg
                raise RolloutHostError(node, kind, message, tb)
            return msg


class RemoteRolloutEngine:
    """RolloutEngine's trainer-facing interface, served by rollout hosts on other nodes."""

    def __init__(self, hosts: list[dict], authkey: bytes, *, connect_timeout_s: float = 30.0,
                 heartbeat_timeout_s: float | None = None, call_timeout_s: float | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if not hosts:
            raise RolloutEngineError("RemoteRolloutEngine needs at least one rollout host")
        self.heartbeat_timeout_s = heartbeat_timeout_s or _env_float("RZ_ROLLOUT_HEARTBEAT_TIMEOUT_S", 60.0)
        self.call_timeout_s = call_timeout_s or _env_float("RZ_ROLLOUT_CALL_TIMEOUT_S", 3600.0)
        self.bucket_bytes = int(bucket_bytes)
        self._hosts: list[_HostConn] = []
        try:
            for h in hosts:
                self._hosts.append(_HostConn(h, authkey, connect_timeout_s))
        except BaseException:
            self._close_conns()
            raise
        self._version = 0
        self._closed = False
        self.last_sync: dict = {}
        self.started: list[dict] = []

    @classmethod
    def from_run_dir(cls, run_dir: str | os.PathLike, *, expected: int | None = None, wait_s: float = 600.0,
                     **kw) -> "RemoteRolloutEngine":
        hosts = wait_for_hosts(run_dir, expected, timeout_s=wait_s)
        return cls(hosts, read_authkey(run_dir), **kw)

    @property
    def nodes(self) -> list[str]:
        return [h.node for h in self._hosts]

    # ---- plumbing ---------------------------------------------------------------------------------
    def _send(self, h: _HostConn, msg) -> None:
        if self._closed:
            raise RolloutEngineError("RemoteRolloutEngine is closed")
        h.send(msg)

    def _reply(self, h: _HostConn, op: str):
        msg = h.next_message(self.call_timeout_s, self.heartbeat_timeout_s, op,
                             f"{op} did not finish within {self.call_timeout_s:.0f} s (RZ_ROLLOUT_CALL_TIMEOUT_S)")
        if msg[0] == "ok":
            return msg[1]
        raise h.gone(f"unexpected message {msg[0]!r}")

    def _call_all(self, op: str, kws: list[dict] | dict) -> list:
        """Send `op` to every host (its own kwargs each, or the same), then collect every reply."""
        kws = kws if isinstance(kws, list) else [kws] * len(self._hosts)
        for h, kw in zip(self._hosts, kws):
            self._send(h, (op, kw))
        out, first_err = [], None
        for h in self._hosts[: len(kws)]:
            try:
                out.append(self._reply(h, op))
            except RolloutEngineError as e:  # still collect the others' replies: the channels stay in step
                first_err = first_err or e
                out.append(None)
        if first_err is not None:
            raise first_err
        return out

    def _chunks(self, n_items: int) -> list[tuple[int, int]]:
        k = len(self._hosts)
        base, extra = divmod(n_items, k)
        spans, start = [], 0
        for j in range(k):
            size = base + (1 if j < extra else 0)
            spans.append((start, start + size))
            start += size
        return spans

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self, model_dir: str, **engine_kwargs) -> list[dict]:
        """Build the RolloutEngine on every host (RolloutEngine(model_dir, **engine_kwargs) there)."""
        self.started = self._call_all("start", {"model_dir": str(model_dir), "kwargs": engine_kwargs})
        self.eos_token_id = self.started[0]["eos_token_id"]
        self.vocab_size = self.started[0]["vocab_size"]
        self.startup_s = max(s["startup_s"] for s in self.started)
        return self.started

    def info(self) -> list[dict]:
        return self._call_all("info", {})

    def _close_conns(self) -> None:
        for h in self._hosts:
            with contextlib.suppress(Exception):
                h.conn.close()

    def close(self, shutdown: bool = False) -> None:
        """Close the engines (and with shutdown=True end the host processes); idempotent."""
        if self._closed:
            return
        for h in self._hosts:
            if h.dead:
                continue
            with contextlib.suppress(RolloutEngineError):
                self._send(h, ("shutdown" if shutdown else "close", {}))
                self._reply(h, "close")
        self._closed = True
        self._close_conns()

    def __enter__(self) -> "RemoteRolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- engine interface ---------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def remote_weight_versions(self) -> list[int]:
        return self._call_all("weight_version", {})

    def generate(self, prompt_ids: list[list[int]], n: int, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, seed: int | None = None, top_k: int = -1, **sampling_kwargs) -> list:
        spans = [s for s in self._chunks(len(prompt_ids)) if s[1] > s[0]]
        kws = [dict(prompt_ids=[list(map(int, p)) for p in prompt_ids[a:b]], n=n, temperature=temperature,
                    top_p=top_p, max_new_tokens=max_new_tokens, top_k=top_k, **sampling_kwargs,
                    seed=None if seed is None else int(seed) + a * n) for a, b in spans]
        samples = []
        for (a, _), part in zip(spans, self._call_all("generate", kws)):
            for s in part:
                s.group += a
            samples.extend(part)
        return samples

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float | None]]:
        spans = [s for s in self._chunks(len(sequences)) if s[1] > s[0]]
        kws = [dict(sequences=[list(map(int, q)) for q in sequences[a:b]], temperature=temperature) for a, b in spans]
        return [row for part in self._call_all("score", kws) for row in part]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int, *, verify: bool = False,
                       _reload: bool = True) -> dict:
        """Stream the HF-named tensors to every host (safetensors buckets), which reload them in place."""
        from safetensors.torch import save

        t0 = time.perf_counter()
        check = {}
        for h in self._hosts:
            self._send(h, ("update_weights", {"version": int(version), "_reload": bool(_reload)}))
        n_tensors = n_bytes = 0
        try:
            for bucket in _iter_buckets(named_tensors, self.bucket_bytes):
                if verify:
                    check.update(bucket)
                payload = save(bucket)
                n_tensors += len(bucket)
                n_bytes += len(payload)
                for h in self._hosts:
                    self._send(h, ("bucket", payload))
        finally:
            for h in self._hosts:
                if not h.dead:
                    with contextlib.suppress(RolloutEngineError):
                        self._send(h, ("end",))
        t1 = time.perf_counter()
        infos, first_err = [], None
        for h in self._hosts:
            try:
                infos.append(self._reply(h, "update_weights"))
            except RolloutEngineError as e:
                first_err = first_err or e
        if first_err is not None:
            raise first_err
        self._version = int(version)
        self.last_sync = {
            "version": int(version), "num_tensors": n_tensors, "bytes": n_bytes, "hosts": len(self._hosts),
            "send_s": t1 - t0, "reload_s": max(i["reload_s"] for i in infos),
            "total_s": time.perf_counter() - t0,
        }
        if verify:
            self.verify_sync(check.items())
            self.last_sync["total_s"] = time.perf_counter() - t0
        return dict(self.last_sync)

    def engine_checksums(self, names: list[str] | None = None) -> dict[str, dict]:
        """The first host's checksums (verify_sync checks every host)."""
        return self._call_all("engine_checksums", {"names": names})[0]

    def verify_sync(self, named_tensors: Iterable[tuple[str, Any]], *, rtol: float = 1e-6, min_checked: int = 1) -> dict:
        """RolloutEngine.verify_sync against every host's engine (only checksums cross the network)."""
        named = [(n, t) for n, t in named_tensors if is_readable_name(n)]
        names = sorted({n for n, _ in named})
        result = {}
        for h, got in zip(self._hosts, self._call_all("engine_checksums", {"names": names})):
            try:
                result = check_weights(named, got, self._version, rtol=rtol, min_checked=min_checked)
            except Exception as e:
                raise type(e)(f"rollout host on node {h.node}: {e}") from None
        return result


class RolloutStreams:
    """Learner side of a streaming op on every host: one long request per host, messages both ways.

    ``open(op, kws)`` starts ``op`` on host j with ``kws[j]``; ``recv(j)`` returns host j's next data
    message (heartbeats skipped; ("end", result) once its op returned; a host error raises
    RolloutHostError; silence past the heartbeat timeout or a closed connection raise
    RolloutEngineError naming the node); ``send(j, msg)`` sends it a control message."""

    def __init__(self, hosts: list[dict], authkey: bytes, *, connect_timeout_s: float = 30.0,
                 heartbeat_timeout_s: float | None = None):
        self.heartbeat_timeout_s = heartbeat_timeout_s or _env_float("RZ_ROLLOUT_HEARTBEAT_TIMEOUT_S", 60.0)
        self.hosts: list[_HostConn] = []
        try:
            for h in hosts:
                self.hosts.append(_HostConn(h, authkey, connect_timeout_s))
        except BaseException:
            self.close()
            raise

    @property
    def nodes(self) -> list[str]:
        return [h.node for h in self.hosts]

    def open(self, op: str, kws: list[dict]) -> None:
        for j, kw in enumerate(kws):
            self.hosts[j].send((op, kw))

    def send(self, j: int, msg) -> None:
        self.hosts[j].send(("ctl", msg))

    def recv(self, j: int, timeout_s: float, what: str):
        h = self.hosts[j]
        try:
            msg = h.next_message(timeout_s, self.heartbeat_timeout_s, f"the wait for {what}",
                                 f"no {what} within {timeout_s:.0f} s (heartbeats kept coming: the host is alive "
                                 "but made no progress)")
        except RolloutHostError as e:
            h.dead = f"{e.kind}: {e.remote_message}"  # its streaming op has ended
            raise
        if msg[0] == "data":
            return msg[1]
        if msg[0] == "ok":
            return ("end", msg[1])
        raise h.gone(f"unexpected message {msg[0]!r}")

    def close(self) -> None:
        for h in self.hosts:
            with contextlib.suppress(Exception):
                h.conn.close()
