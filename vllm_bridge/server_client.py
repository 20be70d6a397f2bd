"""RolloutClient: the rollout engines of a job's rollout nodes, reached through vLLM's own server.

Every rollout node runs ``python -m vllm_bridge.serve`` (vLLM's ``vllm serve`` with the in-process
engine's settings, our plugin, ``--api-key``; vllm_bridge/serve.py). This client gives the learner
the RolloutEngine surface the training loop uses, over HTTP:

* ``generate(prompt_ids, n, seed=...)``: one POST /inference/v1/generate per prompt (vLLM's
  token-in/token-out route: token ids in; sampled token ids, the sampled token's processed logprob
  and per-token weight-version spans out), sampling parameters exactly RolloutEngine.generate's
  (prompt i: ``SamplingParams(n=n, seed=seed + i*n, logprobs=0, ...)``). With several servers the
  prompts are cut in contiguous chunks, one per server, and prompt i keeps its seeds: the samples
  do not depend on how many servers there are.
* ``score(sequences, temperature)``: prompt logprobs (``prompt_logprobs=0``), the temperature
  applied in the worker as RolloutEngine.score does (rz_set_logit_scale over /collective_rpc).
* weights: ``apply_weights(paths, version)`` is the engine's staging protocol over vLLM's RL admin
  routes -- /collective_rpc rz_abort_weights, rz_stage_weights(path) per safetensors bucket file (the
  worker reads the shared run directory itself), rz_commit_weights(version) (one in-place reload),
  /update_weight_version (vLLM's per-token label), /reset_prefix_cache -- on every server;
  ``update_weights(named_tensors, version)`` writes the buckets with the filesystem transport
  (vllm_bridge.weights.filesystem.FilesystemTransport, RUN_DIR/rollout/weights) and applies them.
  ``paused()`` wraps /pause?mode=keep ... /resume (in-flight requests stay, as in streaming.py).
* ``verify_sync`` / ``update_weights(verify=True)``: every parameter of every worker of every server
  against the learner's bytes (transport.SyncCheck over /collective_rpc rz_verify_layout and
  rz_shard_checksums; only checksums cross the network). ``engine_checksums``: the readable
  parameters' checksums (rz_checksums).

Per-token weight versions are exact over the server: vLLM 0.32's engine core labels every step's
output with its weight version and the generate route returns the spans; a swap pauses the
scheduler (mode keep), applies, relabels and resumes, so no step runs under a wrong label.

Failures: every call names the node. A refused / reset connection or an HTTP error raises
RolloutEngineError at once; while a call waits, each server's GET /health is polled every
``health_every_s`` (5 s) and a server that does not answer it for ``dead_after_s`` (30 s) is named
dead, so a killed or stopped server is reported within 60 s, never a hang.

Must not import megatron.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_bridge.engine import RolloutEngineError
from vllm_bridge.samples import Sample
from vllm_bridge.weights.buckets import DEFAULT_BUCKET_BYTES, WeightUpdate, iter_buckets, stage_and_commit
from vllm_bridge.weights.filesystem import FilesystemTransport
from vllm_bridge.weights.verify import SyncCheck

SERVERS_DIR = "rollout/servers"  # RUN_DIR/rollout/servers/<node>.json, written by each server when ready
KEY_FILE = "rollout.key"  # RUN_DIR/rollout.key, mode 0600 (the batch script writes it)
WEIGHTS_DIR = "rollout/weights"  # filesystem-transport versions for the servers


@dataclass
class Server:
    node: str
    url: str  # http://addr:port


def read_key(run_dir: str | os.PathLike) -> str:
    """The servers' API key, RUN_DIR/rollout.key (refused unless only its owner can read it)."""
    from vllm_bridge.serve import read_key as _read

    try:
        return _read(Path(run_dir) / KEY_FILE)
    except SystemExit as e:
        raise RolloutEngineError(str(e).removeprefix("[rz serve] ")) from None


def write_key(run_dir: str | os.PathLike) -> Path:
    """A fresh random key in RUN_DIR/rollout.key, created with mode 0600 (tests; the batch script
    writes its own with umask 077)."""
    import secrets

    path = Path(run_dir) / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.replace(tmp, path)
    return path


def read_servers(run_dir: str | os.PathLike) -> list[Server]:
    """The servers recorded under RUN_DIR/rollout/servers/, by node name."""
    out = []
    for p in sorted((Path(run_dir) / SERVERS_DIR).glob("*.json")):
        with contextlib.suppress(ValueError, OSError, KeyError):
            info = json.loads(p.read_text())
            out.append(Server(str(info["node"]), str(info["url"])))
    return out


def connect(run_dir: str | os.PathLike, *, servers: list[str] | list[Server] | None = None, expected: int = 1,
            wait_s: float = 600.0, **kw: Any) -> "RolloutClient":
    """THE factory: a RolloutClient for the rollout servers of ``run_dir``.

    ``servers``: explicit URLs (node name = host:port) or Server records; default: wait until
    ``expected`` servers have recorded themselves in RUN_DIR/rollout/servers/*.json (the batch
    script starts them; each records itself once its /health answers). Key: RUN_DIR/rollout.key."""
    if servers is None:
        t0 = time.monotonic()
        while len(found := read_servers(run_dir)) < expected:
            if time.monotonic() - t0 > wait_s:
                raise RolloutEngineError(
                    f"only {len(found)} of {expected} rollout server(s) recorded in {Path(run_dir) / SERVERS_DIR} "
                    f"within {wait_s:.0f} s ({[s.node for s in found]}); see the [rz serve] lines in the job log")
            time.sleep(1.0)
        servers = found
    recs = [s if isinstance(s, Server) else Server(str(s).split("//", 1)[-1], str(s).rstrip("/")) for s in servers]
    client = RolloutClient(recs, read_key(run_dir), weights_dir=Path(run_dir) / WEIGHTS_DIR, **kw)
    print(f"[rz] rollout on {len(recs)} vLLM server(s): " + ", ".join(f"{s.node} ({s.url})" for s in recs), flush=True)
    return client


# Direct connections only: an http_proxy / https_proxy of the learner's environment (common on
# clusters) must not carry the traffic to the rollout nodes.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Http:
    """One server: JSON over HTTP with the bearer key; errors become RolloutEngineError naming it."""

    def __init__(self, server: Server, key: str):
        self.node, self.url, self.key = server.node, server.url.rstrip("/"), key
        self.dead: str | None = None

    def error(self, why: str) -> RolloutEngineError:
        return RolloutEngineError(f"rollout server on node {self.node} ({self.url}) {why}")

    def request(self, method: str, path: str, body: Any = None, timeout: float = 3600.0) -> Any:
        if self.dead:
            raise self.error(f"is gone: {self.dead}")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.key}",
                                              "Content-Type": "application/json"})
        try:
            with _OPENER.open(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code == 401:
                raise self.error(f"refused the API key (HTTP 401 on {path}): same {KEY_FILE} on both sides?") from None
            raise self.error(f"answered HTTP {e.code} on {path}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            self.dead = f"{type(reason).__name__}: {reason} on {path}"
            raise self.error(f"is gone: cannot reach it ({self.dead}); see its [rz serve] log lines") from None
        return json.loads(raw) if raw else None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with _OPENER.open(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except Exception:
            return False

    def rpc(self, method: str, *args: Any, timeout: float = 600.0) -> list:
        out = self.request("POST", "/collective_rpc", {"method": method, "args": list(args), "timeout": timeout},
                           timeout=timeout + 30)
        return (out or {}).get("results", [])


class RolloutClient:
    """RolloutEngine's interface served by `vllm serve` processes (one engine each)."""

    def __init__(self, servers: list[Server], key: str, *, weights_dir: str | os.PathLike | None = None,
                 call_timeout_s: float = 3600.0, health_every_s: float = 5.0, dead_after_s: float = 30.0,
                 concurrency: int = 64, bucket_bytes: int = DEFAULT_BUCKET_BYTES, log_updates: bool = True):
        if not servers:
            raise RolloutEngineError("RolloutClient needs at least one rollout server")
        self._servers = [_Http(s, key) for s in servers]
        self.weights_dir = None if weights_dir is None else Path(weights_dir)
        self.call_timeout_s, self.health_every_s, self.dead_after_s = call_timeout_s, health_every_s, dead_after_s
        self.bucket_bytes = int(bucket_bytes)
        self.log_updates = log_updates
        self._pool = ThreadPoolExecutor(max_workers=max(4, concurrency * len(servers)), thread_name_prefix="rz-http")
        self._version = 0
        self._closed = False
        self.last_sync: dict = {}
        for s in self._servers:  # the key is checked at once (a protected route), not at the first generate
            s.request("GET", "/weight_info", timeout=30)
        models = self._servers[0].request("GET", "/v1/models", timeout=30)
        self.model_dir = str(models["data"][0].get("root") or models["data"][0]["id"])
        cfg = {}
        with contextlib.suppress(Exception):
            cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        self.eos_token_id = cfg.get("eos_token_id")
        self.vocab_size = cfg.get("vocab_size")
        self.startup_s = 0.0

    # ---- plumbing ---------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return [s.node for s in self._servers]

    def _wait(self, futures: list, what: str) -> list:
        """Results of ``futures`` (each bound to one server, in order); meanwhile every server's
        /health is polled so a dead server is named even while its connection hangs."""
        owners = [f.rz_server for f in futures]
        last_ok = {id(s): time.monotonic() for s in owners}
        next_check = time.monotonic() + self.health_every_s
        deadline = time.monotonic() + self.call_timeout_s
        pending = set(range(len(futures)))
        while pending:
            for i in list(pending):
                if futures[i].done():
                    pending.discard(i)
                    futures[i].result()  # a server's error (naming it) is raised here
            if not pending:
                break
            now = time.monotonic()
            if now > deadline:
                raise RolloutEngineError(f"{what} did not finish within {self.call_timeout_s:.0f} s")
            if now >= next_check:
                for s in {id(owners[i]): owners[i] for i in pending}.values():
                    if s.healthy(timeout=min(5.0, self.dead_after_s)):
                        last_ok[id(s)] = time.monotonic()
                    elif time.monotonic() - last_ok[id(s)] > self.dead_after_s:
                        s.dead = f"no answer to /health for {self.dead_after_s:.0f} s during {what}"
                        raise s.error(f"is gone: {s.dead} (process killed or stopped, node down)")
                next_check = time.monotonic() + self.health_every_s
            time.sleep(0.05)
        return [f.result() for f in futures]

    def _submit(self, server: _Http, fn, *args):
        fut = self._pool.submit(fn, *args)
        fut.rz_server = server
        return fut

    def _all(self, fn, what: str, *args) -> list:
        """fn(server, *args) on every server at once."""
        return self._wait([self._submit(s, fn, s, *args) for s in self._servers], what)

    def _chunks(self, n_items: int) -> list[tuple[int, int]]:
        k = len(self._servers)
        base, extra = divmod(n_items, k)
        spans, start = [], 0
        for j in range(k):
            size = base + (1 if j < extra else 0)
            spans.append((start, start + size))
            start += size
        return spans

    # ---- generation ---------------------------------------------------------------------------------
    @staticmethod
    def sampling_params(n: int, *, temperature: float, top_p: float, top_k: int, max_new_tokens: int,
                        seed: int | None, **extra: Any) -> dict:
        """RolloutEngine.generate's SamplingParams for one prompt, as the generate route's JSON."""
        sp = dict(n=int(n), temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                  max_tokens=int(max_new_tokens), logprobs=0, skip_special_tokens=False, detokenize=False, **extra)
        if seed is not None:
            sp["seed"] = int(seed)
        return sp

    def _generate_one(self, server: _Http, prompt: list[int], sp: dict, group: int, meta: dict) -> list[Sample]:
        out = server.request("POST", "/inference/v1/generate", {"token_ids": list(map(int, prompt)),
                                                                "sampling_params": sp}, timeout=self.call_timeout_s)
        return samples_from_response(out, prompt, group, sp, server.node, **meta)

    def generate(self, prompt_ids: list[list[int]], n: int, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, seed: int | None = None, top_k: int = -1,
                 **sampling_kwargs: Any) -> list[Sample]:
        """n samples per prompt, grouped by prompt (result[i*n + j]); prompt i uses seeds
        seed + i*n .. seed + i*n + n - 1 whichever server generates it."""
        futures = []
        for j, (a, b) in enumerate(self._chunks(len(prompt_ids))):
            for i in range(a, b):
                sp = self.sampling_params(n, temperature=temperature, top_p=top_p, top_k=top_k,
                                          max_new_tokens=max_new_tokens,
                                          seed=None if seed is None else int(seed) + i * n, **sampling_kwargs)
                futures.append(self._submit(self._servers[j], self._generate_one, self._servers[j], prompt_ids[i],
                                            sp, i, {"temperature": temperature, "top_p": top_p, "top_k": top_k}))
        return [s for part in self._wait(futures, "generate") for s in part]

    def _score_part(self, server: _Http, seqs: list[list[int]], temperature: float) -> list[list[float | None]]:
        scaled = temperature != 1.0
        if scaled:
            server.rpc("rz_set_logit_scale", 1.0 / float(temperature))
        try:
            rows = []
            for seq in seqs:
                out = server.request("POST", "/inference/v1/generate", {
                    "token_ids": list(map(int, seq)),
                    "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}},
                    timeout=self.call_timeout_s)
                pl = out.get("prompt_logprobs") or []
                row: list[float | None] = [None]
                for t in range(1, len(seq)):
                    d = pl[t] if t < len(pl) else None
                    if not d or str(int(seq[t])) not in d:
                        raise server.error(f"score: no prompt logprob for position {t}")
                    row.append(float(d[str(int(seq[t]))]["logprob"]))
                rows.append(row)
            return rows
        finally:
            if scaled and not server.dead:
                server.rpc("rz_reset_logit_scale")

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float | None]]:
        """RolloutEngine.score over the servers (contiguous chunks)."""
        if temperature <= 0:
            raise ValueError("score: temperature must be > 0")
        futures = [self._submit(self._servers[j], self._score_part, self._servers[j], sequences[a:b], temperature)
                   for j, (a, b) in enumerate(self._chunks(len(sequences))) if b > a]
        return [row for part in self._wait(futures, "score") for row in part]

    # ---- weights ------------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def server_weight_versions(self) -> list[str]:
        """vLLM's own version label on every server (GET /weight_info)."""
        return [o["weight_version"] for o in self._all(lambda s: s.request("GET", "/weight_info", timeout=30),
                                                         "weight_info")]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Every server's scheduler paused with in-flight requests kept (their KV cache too), resumed
        on exit: weights change between two engine steps."""
        self._all(lambda s: s.request("POST", "/pause?mode=keep", timeout=600), "pause")
        try:
            yield
        finally:
            live = [s for s in self._servers if not s.dead]
            self._wait([self._submit(s, lambda s: s.request("POST", "/resume", timeout=600), s) for s in live],
                       "resume")

    def _apply_one(self, server: _Http, paths: list[str], version: int, reload: bool) -> dict:
        info = stage_and_commit(server.rpc, paths, version, reload=reload, alive=lambda: not server.dead)
        server.request("POST", "/update_weight_version", {"new_version": str(int(version))}, timeout=60)
        server.request("POST", "/reset_prefix_cache", timeout=60)
        return info

    def apply_weights(self, payloads: Iterable[str | os.PathLike | bytes], version: int, *, reload: bool = True) -> dict:
        """The staging protocol on every server; ``payloads`` are safetensors bucket files on a
        filesystem the servers see (FilesystemTransport). ``reload=False``: test hook (no load)."""
        paths = []
        for p in payloads:
            if isinstance(p, (bytes, bytearray)):
                raise TypeError("RolloutClient.apply_weights takes bucket file paths (the servers read them); "
                                "use update_weights(named_tensors, version) to write them first")
            paths.append(str(p))
        t0 = time.perf_counter()
        infos = self._all(self._apply_one, "apply_weights", paths, int(version), bool(reload))
        self._version = int(version)
        self.last_sync = {"version": int(version), "buckets": len(paths), "servers": len(self._servers),
                          "reload_s": max(float(i.get("reload_s", 0.0)) for i in infos),
                          "total_s": time.perf_counter() - t0}
        if self.log_updates:
            print(f"[rz] weights version {int(version)} on {', '.join(self.nodes)}: {len(paths)} bucket file(s), "
                  f"{self.last_sync['total_s']:.2f} s", flush=True)
        return dict(self.last_sync)

    def set_weight_version(self, version: int) -> None:
        """Label + prefix-cache reset only (weights delivered by another transport, e.g. NCCL)."""
        def one(s: _Http) -> None:
            s.request("POST", "/update_weight_version", {"new_version": str(int(version))}, timeout=60)
            s.request("POST", "/reset_prefix_cache", timeout=60)

        self._all(one, "set_weight_version")
        self._version = int(version)

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int, *, verify: bool = False,
                       _reload: bool = True) -> dict:
        """Write the tensors as safetensors buckets (filesystem transport, WEIGHTS_DIR of the run
        directory), apply them on every server, then delete the files. ``verify``: every parameter
        of every worker of every server against the bytes written (transport.SyncCheck)."""
        if self.weights_dir is None:
            raise RolloutEngineError("RolloutClient.update_weights needs weights_dir (a directory the servers read)")
        t0 = time.perf_counter()
        check = SyncCheck(SyncCheck.layout_of(self)) if verify else None
        buckets = iter_buckets(named_tensors, self.bucket_bytes)
        transport = FilesystemTransport(self.weights_dir)
        update: WeightUpdate = transport.push(check.stream(buckets) if check else buckets, int(version))
        try:
            info = self.apply_weights(update.paths, update.version, reload=_reload)
        finally:
            transport.release(update)
        self.last_sync = {**update.info, **info, "total_s": time.perf_counter() - t0}
        if check is not None:
            self.last_sync["verify"] = check.verify(self, int(version))
            self.last_sync["total_s"] = time.perf_counter() - t0
        return dict(self.last_sync)

    def worker_rpcs(self) -> list[tuple[str, Any]]:
        """(label, rpc) per server: what transport.SyncCheck verifies (every worker of every server);
        each call polls the server's /health while it waits, as every other call does."""
        def bound(s: _Http):
            return lambda method, *args: self._wait([self._submit(s, s.rpc, method, *args)], method)[0]

        return [(f"rollout server on node {s.node}", bound(s)) for s in self._servers]

    def engine_checksums(self, names: list[str] | None = None) -> dict[str, dict]:
        """The first server's readable-parameter checksums, every worker's merged (a pipeline stage
        reports only its layers)."""
        merged: dict[str, dict] = {}
        for part in self._servers[0].rpc("rz_checksums", names):
            for n, e in part.items():
                merged.setdefault(n, e)
        return merged

    def verify_sync(self, named_tensors: Iterable[tuple[str, Any]], **_: Any) -> dict:
        """Every parameter of every worker of every server against ``named_tensors`` (the full
        version: transport.SyncCheck; only checksums cross the network)."""
        return SyncCheck(SyncCheck.layout_of(self)).named(named_tensors).verify(self, self._version)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the connections (the servers keep running: the batch script owns them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self) -> "ServerStream":
        """A StreamingGenerator-like producer handle over these servers (submit / step / swap)."""
        return ServerStream(self)


def samples_from_response(out: dict, prompt: list[int], group: int, sp: dict, node: str, *, temperature: float,
                          top_p: float, top_k: int) -> list[Sample]:
    """The generate route's JSON -> Samples (the sampled token's logprob, per-token versions)."""
    comps = sorted(out.get("choices") or [], key=lambda c: c["index"])
    if len(comps) != sp["n"]:
        raise RolloutEngineError(f"rollout server on node {node}: prompt {group}: {len(comps)} samples, wanted {sp['n']}")
    samples = []
    for c in comps:
        ids = [int(t) for t in c.get("token_ids") or []]
        content = (c.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids) or any(int(e["token_id"]) != t for e, t in zip(content, ids)):
            raise RolloutEngineError(f"rollout server on node {node}: prompt {group}: {len(ids)} tokens but "
                                     f"{len(content)} matching logprobs")
        versions = spans_to_versions(c.get("weight_versions"), len(ids), node)
        samples.append(Sample(prompt_ids=list(map(int, prompt)), response_ids=ids,
                              logprobs=[float(e["logprob"]) for e in content], versions=versions,
                              finish_reason=str(c.get("finish_reason") or "length"), group=group,
                              index_in_group=int(c["index"]), temperature=temperature, top_p=top_p, top_k=top_k))
    return samples


def spans_to_versions(spans: list[dict] | None, num_tokens: int, node: str = "?") -> list[int]:
    """vLLM's weight-version spans ({version, start, end}) -> one int per output token. The label
    "default" (a server that never had a version set) is version 0."""
    out: list[int | None] = [None] * num_tokens
    for sp in spans or []:
        v = 0 if sp["version"] == "default" else int(sp["version"])
        for i in range(int(sp["start"]), min(int(sp["end"]), num_tokens)):
            out[i] = v
    if any(v is None for v in out):
        raise RolloutEngineError(f"rollout server on node {node}: weight-version spans {spans} do not cover all "
                                 f"{num_tokens} output tokens")
    return out  # type: ignore[return-value]


@dataclass
class FinishedGroup:
    """All n samples of one submitted prompt (streaming.FinishedGroup's fields)."""

    tag: Any
    group: int
    samples: list[Sample]
    submit_version: int
    submit_time: float


class ServerStream:
    """StreamingGenerator's producer surface over the servers: submit() sends each prompt's request
    at once (its server chosen by its position in the call, as generate() cuts chunks: the caller
    keeps seeds per prompt), step() returns the groups finished since the last call (waiting up to
    ``poll_s`` for one), swap_weights() pauses every server (in-flight requests kept), applies a
    filesystem-transport update, relabels and resumes; the per-token versions come from vLLM."""

    def __init__(self, client: RolloutClient, poll_s: float = 0.5):
        self.client, self.poll_s = client, poll_s
        self._done: queue.Queue = queue.Queue()
        self._in_flight: dict[int, tuple[Any, Any]] = {}
        self._ids = itertools.count()
        self._rr = itertools.count()
        self.swaps: list[dict] = []
        self._lock = threading.Lock()
        self._health_at = time.monotonic()
        # Swaps under requests in flight (StreamingGenerator.in_flight_swaps): the servers' vLLM
        # labels every token with its weight version (0.32; vllm_compat item 4).
        self.in_flight_swaps = True

    @property
    def version(self) -> int:
        return self.client.weight_version

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def in_flight_tags(self) -> list:
        return [t for t, _ in self._in_flight.values()]

    def submit(self, prompt_ids: list[list[int]], n: int, *, temperature: float = 1.0, top_p: float = 1.0,
               max_new_tokens: int = 64, seed: int | None = None, top_k: int = -1, tag: Any = None,
               server: int | None = None, **sampling_kwargs: Any) -> list[int]:
        c = self.client
        ids, now, version = [], time.perf_counter(), self.version
        for i, p in enumerate(prompt_ids):
            s = c._servers[(next(self._rr) if server is None else int(server)) % len(c._servers)]
            sp = c.sampling_params(n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                   seed=None if seed is None else int(seed) + i * n, **sampling_kwargs)
            rid = next(self._ids)
            meta = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
            fut = c._submit(s, c._generate_one, s, p, sp, i, meta)
            self._in_flight[rid] = (tag, fut)
            fut.add_done_callback(lambda f, rid=rid, i=i: self._done.put((rid, i, f)))
            fut.rz_meta = (version, now)
            ids.append(rid)
        return ids

    def step(self) -> list[FinishedGroup]:
        if not self._in_flight:
            return []
        out = []
        try:
            item = self._done.get(timeout=self.poll_s)
        except queue.Empty:
            self._check_health()
            return []
        while True:
            rid, i, fut = item
            tag, _ = self._in_flight.pop(rid)
            version, t = fut.rz_meta
            out.append(FinishedGroup(tag, i, fut.result(), version, t))  # a server error names the node
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return out

    def _check_health(self) -> None:
        c = self.client
        if time.monotonic() - self._health_at < c.health_every_s:
            return
        self._health_at = time.monotonic()
        busy = {id(f.rz_server): f.rz_server for _, f in self._in_flight.values()}
        for s in busy.values():
            if not s.healthy(timeout=min(5.0, c.dead_after_s)):
                t0 = time.monotonic()
                while time.monotonic() - t0 < c.dead_after_s:
                    time.sleep(1.0)
                    if s.healthy(timeout=5.0):
                        break
                else:
                    s.dead = f"no answer to /health for {c.dead_after_s:.0f} s"
                    raise s.error(f"is gone: {s.dead} (process killed or stopped, node down)")

    def drain(self) -> list[FinishedGroup]:
        done = []
        while self._in_flight:
            done += self.step()
        return done

    def abort_all(self) -> None:
        """Abort every request in flight on every server (vLLM's /abort_requests) and forget them."""
        c = self.client
        if self._in_flight:
            for s in c._servers:
                if not s.dead:
                    with contextlib.suppress(RolloutEngineError):
                        s.request("POST", "/abort_requests", {}, timeout=60)
        self._in_flight.clear()
        with contextlib.suppress(queue.Empty):
            while True:
                self._done.get_nowait()

    def swap_weights(self, version: int, *, update: WeightUpdate | None = None,
                     named_tensors: Iterable[tuple[str, Any]] | None = None) -> dict:
        if (update is None) == (named_tensors is None):
            raise ValueError("swap_weights: give exactly one of update= or named_tensors=")
        c = self.client
        t0 = time.perf_counter()
        transport = None
        if update is None:
            transport = FilesystemTransport(c.weights_dir)
            update = transport.push(iter_buckets(named_tensors, c.bucket_bytes), int(version))
        try:
            with c.paused():
                t1 = time.perf_counter()
                info = c.apply_weights(update.paths, int(version))
        finally:
            if transport is not None:
                transport.release(update)
        rec = {"version": int(version), "pause_s": t1 - t0, "reload_s": info["reload_s"],
               "total_s": time.perf_counter() - t0, "in_flight": len(self._in_flight)}
        c.last_sync = dict(rec)
        self.swaps.append(rec)
        return rec
