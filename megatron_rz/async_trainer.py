"""The asynchronous REINFORCE Zero loop: rollout and learner run at once, with a policy-lag bound.

Selected by ``schedule.max_lag = k > 0`` (``trainer.train`` hands over to ``train_async``).

Processes
    learner ranks   the main process(es) (torchrun for tp/ep/dp > 1): Megatron learner, metrics.
    rollout         ``run_rollout``: it owns the task, the tokenizer and the vLLM engine
                    (trainer.RolloutSide, so the same engine settings as the synchronous trainer)
                    driven by vllm_bridge.streaming.StreamingGenerator, plus vLLM's own
                    engine-core/worker processes under it. Either one process spawned by global
                    rank 0 (multiprocessing "spawn"; ``RolloutProcess``), or, in an ``rz submit``
                    job (RZ_REMOTE_ROLLOUT=1), one per rollout node inside its rollout host
                    (megatron_rz.rollout_host; ``RemoteRollout``), each generating a contiguous
                    share of every batch's prompts (prompt i keeps its seed whichever host runs it).

Channels (rank 0 <-> rollout: multiprocessing queues, or the hosts' authenticated TCP connections)
    results  rollout -> learner, bounded (max_lag + 2): ("ready", info), ("eval", tag, value),
             ("batch", k, samples, meta), ("error", traceback), ("done", info).
    control  learner -> rollout: ("weights", version, path), ("stop", final_eval).
    weights  rank 0 writes every new version as one safetensors file under
             ``run_dir/async_weights/`` (written to ``*.tmp``, then ``os.replace``: a reader never
             sees a partial file; in a job the run directory is on the shared filesystem) and
             sends (version, path). Between two engine steps the rollout applies only the newest
             version it has received (StreamingGenerator.swap_weights: pause at a step boundary,
             in-place reload, relabel, resume; requests in flight keep going and keep their KV
             cache). A local rollout process deletes the files of every version it has applied or
             skipped; with remote hosts the learner deletes a file once every host has moved past it.

Lag bound (max_lag = k)
    Batch i (0-based) is the one the learner trains at version v0 + i (one update per batch).
    Its tokens' versions must be >= v0 + i - k. Versions only grow, and a prompt's first token is
    sampled with the weights loaded at or after its submission, so it is enough that the rollout
    submits the prompts of batch i only once it has loaded a version >= v0 + i - k; when that is
    not the case it stops submitting and waits for weights (producer side; time logged as
    ``rollout_blocked_s``). The learner checks every batch (consumer side) and raises if the
    oldest token version is below ``version - k``. A swap never makes an in-flight sample older,
    so in-flight generations need not be interrupted. A sample's lag is
    learner version - its oldest token version; a token's lag is learner version - its version.

Failure handling
    The learner waits for the rollout with short queue timeouts and checks that the rollout
    process is alive (remote: heartbeats; a silent or disconnected host is named): a dead rollout process raises RolloutProcessError with its exit code (its
    own traceback is forwarded when it could send one), never a hang. On success, learner
    exception or Ctrl-C the rollout process is told to stop, then terminated (SIGTERM: it closes
    its engine), then killed, and finally the vLLM engine-core/worker pids it reported at start
    are reaped (start-time checked). The rollout process exits by itself when its parent dies.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import time
import traceback
from pathlib import Path

import torch

from megatron_rz.recipe import Recipe, dump_recipe
from megatron_rz.resume import checkpoint_after_step, checkpoint_dir, resolve_load, step_rng, truncate_metrics
from megatron_rz.resume import eval_before as logged_eval_before

WEIGHTS_DIR = "async_weights"
POLL_S = 0.5


class RolloutProcessError(RuntimeError):
    """The rollout process died, failed, or stopped answering."""


# ============================================================================ weights channel


def write_weights_file(named_tensors, directory: Path, version: int) -> Path:
    """All HF-named tensors of one version as one safetensors file, atomically (tmp + rename)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"v{int(version):06d}.safetensors"
    tmp = final.with_suffix(".safetensors.tmp")
    # safetensors needs contiguous tensors that share no storage (tied embeddings): clone.
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in named_tensors}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, final)
    return final


def _unlink(path) -> None:
    with contextlib.suppress(FileNotFoundError, TypeError):
        os.unlink(path)


# ============================================================================ rollout process


class _Stop(Exception):
    pass


def _raise_exit(signum, frame):  # SIGTERM in the rollout process: unwind, close the engine
    raise SystemExit(128 + signum)


def _rollout_main(recipe_dict: dict, base: str, v0: int, start_step: int, init_path: str | None,
                  results_q, control_q) -> None:
    """Entry point of the local rollout process (spawned by global rank 0)."""
    signal.signal(signal.SIGTERM, _raise_exit)
    parent = mp.parent_process()
    try:
        run_rollout(recipe_dict, base, v0, start_step, init_path, results_q, control_q,
                    learner_alive=lambda: parent is None or parent.is_alive())
    except (KeyboardInterrupt, SystemExit, _Stop):
        results_q.cancel_join_thread()  # nobody may read what is still queued: do not block exit
    except BaseException:
        with contextlib.suppress(Exception):
            results_q.put(("error", traceback.format_exc()), timeout=10)


def run_rollout(recipe_dict: dict, base: str, v0: int, start_step: int, init_path: str | None, results_q,
                control_q, *, learner_alive=lambda: True, share: tuple[int, int] | None = None,
                host_index: int = 0, owns_weight_files: bool = True, engine_extra: dict | None = None) -> None:
    """The rollout side of the async trainer: build the engine, report, evaluate, produce batches.

    Runs in the local rollout process (``_rollout_main``) or, in an ``rz submit`` job, inside a
    rollout host on a rollout node (``serve_rollout``), where ``results_q`` / ``control_q`` are the
    TCP channel to learner rank 0. With several hosts, host ``host_index`` generates the prompts
    ``share = (a, b)`` of every batch (the learner concatenates the shares) and only host 0 runs the
    held-out evaluations; the weight files are then shared, so the learner deletes them
    (``owns_weight_files=False``). The engine is closed on the way out, whatever happens."""
    from megatron_rz.trainer import RolloutSide
    from vllm_bridge.engine import _proc_start_time
    from vllm_bridge.streaming import StreamingGenerator

    recipe = Recipe.model_validate(recipe_dict)
    side = RolloutSide(recipe, Path(base), engine_extra=engine_extra)
    try:
        gen = StreamingGenerator(side.engine)
        if init_path is not None:  # resumed run: start from the learner's weights
            gen.swap_weights(v0, path=init_path)
            if owns_weight_files:
                _unlink(init_path)
        eng = side.engine
        procs = [(p.pid, None) for p in eng._engine_processes()] + list(eng._worker_procs)
        procs = [(pid, start or _proc_start_time(pid)) for pid, start in procs]
        import socket

        results_q.put(("ready", {"pid": os.getpid(), "procs": procs, "pad_id": side.tok.pad_token_id,
                                 "startup_s": eng.startup_s, "host": socket.gethostname()}))
        evaluates = host_index == 0
        if evaluates:
            results_q.put(("eval", "before", side.evaluate()))
        _Producer(recipe, side, gen, v0, start_step, results_q, control_q, learner_alive=learner_alive,
                  share=share, host_index=host_index, evaluates=evaluates,
                  owns_weight_files=owns_weight_files).run()
    finally:
        with contextlib.suppress(BaseException):
            side.engine.close()


def serve_rollout(kw: dict, results_q, control_q) -> dict:
    """A rollout host's handler for the async trainer (vllm_bridge.remote.RolloutHost op "rollout")."""
    try:
        run_rollout(kw["recipe"], kw["base"], kw["v0"], kw["start_step"], kw.get("init_path"), results_q,
                    control_q, share=tuple(kw["share"]), host_index=int(kw["host_index"]),
                    owns_weight_files=bool(kw.get("owns_weight_files", False)), engine_extra=kw.get("engine_extra"))
    except _Stop as e:  # the learner went away or stopped us: not an error of this host
        return {"stopped": str(e)}
    return {"stopped": None}


class _Producer:
    """The rollout loop: submit, step, swap, emit batches in order, respect the lag bound."""

    def __init__(self, recipe: Recipe, side, gen, v0: int, start_step: int, results_q, control_q, *,
                 learner_alive=lambda: True, share: tuple[int, int] | None = None, host_index: int = 0,
                 evaluates: bool = True, owns_weight_files: bool = True):
        self.recipe, self.side, self.gen = recipe, side, gen
        self.v0, self.start_step = v0, start_step
        self.results_q, self.control_q = results_q, control_q
        self.max_lag = recipe.schedule.max_lag
        self.total = recipe.schedule.steps - start_step
        self.learner_alive = learner_alive
        P = recipe.rollout.prompts_per_step
        self.share = (0, P) if share is None else (int(share[0]), int(share[1]))
        self.host_index, self.evaluates, self.owns_files = host_index, evaluates, owns_weight_files
        self.next_submit = 0  # next batch index to submit
        self.next_emit = 0  # next batch index to hand to the learner
        self.batches: dict[int, dict] = {}
        self.newest: tuple[int, str] | None = None  # (version, path) received, not applied yet
        self.stopping = False
        self.final_eval = False
        self.blocked_s = 0.0  # waiting for weights because of the lag bound (since last batch)
        self.swap_s = 0.0

    # ---- control channel -----------------------------------------------------------------------
    def _check_parent(self) -> None:
        if not self.learner_alive():
            raise _Stop("learner process is gone")

    def _drop(self, path) -> None:
        if self.owns_files:
            _unlink(path)

    def poll_control(self, timeout: float = 0.0) -> None:
        block = timeout > 0
        while True:
            try:
                msg = self.control_q.get(timeout=timeout) if block else self.control_q.get_nowait()
            except queue.Empty:
                return
            except (EOFError, OSError) as e:  # remote channel closed: the learner is gone
                raise _Stop(f"learner disconnected ({type(e).__name__})") from None
            block = False
            if msg[0] == "weights":
                _, v, path = msg
                if v <= self.gen.version or (self.newest is not None and v <= self.newest[0]):
                    self._drop(path)
                    continue
                if self.newest is not None:
                    self._drop(self.newest[1])  # superseded before it was applied
                self.newest = (int(v), str(path))
            elif msg[0] == "stop":
                self.stopping, self.final_eval = True, bool(msg[1])
            else:
                raise RuntimeError(f"rollout: unknown control message {msg[0]!r}")

    def apply_newest(self) -> None:
        if self.newest is None:
            return
        v, path = self.newest
        self.newest = None
        t0 = time.perf_counter()
        self.gen.swap_weights(v, path=path)
        r = self.recipe.rollout
        if r.verify_sync and (v % r.verify_every == 0 or v == self.v0 + self.total):
            from safetensors.torch import load_file

            self.side.engine.verify_sync(load_file(path).items())
        self._drop(path)
        self.swap_s += time.perf_counter() - t0

    # ---- batches -------------------------------------------------------------------------------
    def allowed(self, k: int) -> bool:
        """Lag bound: batch k is trained at version v0 + k; its tokens need version >= v0 + k - max_lag."""
        return self.gen.version >= self.v0 + k - self.max_lag

    def submit_batch(self, k: int) -> None:
        step = self.start_step + k
        rng = step_rng(self.recipe.schedule.seed, step)  # the same prompts as the sync trainer's step
        problems = self.side.task.sample(rng, self.recipe.rollout.prompts_per_step)
        a, b = self.share
        if self.host_index:  # refills must not repeat another host's: a stream of its own
            rng = random.Random(f"rz-refill-{self.recipe.schedule.seed}-{step}-{self.host_index}")
        self.batches[k] = {"problems": [], "groups": [], "dropped": 0, "refills": 0, "rng": rng,
                           "t_submit": time.perf_counter(), "submit_version": self.gen.version}
        base_seed = self.recipe.schedule.seed * 100003 + step * 101
        # one submit per prompt so that a group's index is its problem's index in the batch list;
        # prompt i of the batch has the same seed whichever host generates it
        for i in range(a, b):
            self._submit_prompts_indexed(k, problems[i], base_seed + i * self.recipe.rollout.samples_per_prompt)

    def _submit_prompts_indexed(self, k: int, problem, seed: int) -> None:
        r = self.recipe.rollout
        b = self.batches[k]
        idx = len(b["problems"])
        b["problems"].append(problem)
        self.gen.submit(self.side.encode([problem]), n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens,
                        seed=seed, tag=(k, idx), **r.sampling_kwargs())

    def collect(self, fg) -> None:
        """Rewards and the algorithm's per-group shaping for one finished group."""
        from megatron_rz.batch_filters import overlong_shaping

        k, idx = fg.tag
        b = self.batches[k]
        problem = b["problems"][idx]
        algo, r = self.recipe.algo, self.recipe.rollout
        for s in fg.samples:
            s.reward = self.side.task.reward(problem, self.side.decode(s.response_ids))
            s.info["task_reward"] = s.reward
        if algo.overlong_buffer > 0:
            shaped = overlong_shaping(torch.tensor([s.reward for s in fg.samples]),
                                      torch.tensor([len(s.response_ids) for s in fg.samples]),
                                      r.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
            for s, v in zip(fg.samples, shaped.tolist()):
                s.reward = v
        if algo.dynamic_sampling and len({s.reward for s in fg.samples}) == 1:
            # DAPO dynamic sampling, streaming form: drop the group, submit a fresh prompt for the
            # same batch (submitted now, so it still satisfies the batch's lag bound).
            b["dropped"] += 1
            if b["refills"] >= 8 * max(1, self.share[1] - self.share[0]):
                from megatron_rz.batch_filters import DynamicSamplingError

                raise DynamicSamplingError(
                    f"batch {k}: {b['dropped']} groups had all-equal rewards; could not fill "
                    f"{self.share[1] - self.share[0]} informative groups")
            b["refills"] += 1
            step = self.start_step + k
            self._submit_prompts_indexed(k, self.side.task.sample(b["rng"], 1)[0],
                                         self.recipe.schedule.seed * 100003 + step * 101 + 7919 * b["refills"]
                                         + 1_000_003 * self.host_index)
            return
        b["groups"].append(fg)

    def emit_ready(self) -> None:
        P = self.share[1] - self.share[0]  # this host's groups per batch
        while self.next_emit in self.batches and len(self.batches[self.next_emit]["groups"]) >= P:
            k = self.next_emit
            b = self.batches.pop(k)
            samples = []
            for gi, fg in enumerate(sorted(b["groups"], key=lambda g: g.tag[1])[:P]):
                for s in fg.samples:
                    s.group = gi
                    if b["dropped"]:
                        s.info["dynamic_sampling_dropped"] = b["dropped"]
                    samples.append(s)
            meta = {
                "time_generate": time.perf_counter() - b["t_submit"],
                "submit_version": b["submit_version"],
                "rollout_version": self.gen.version,
                "rollout_blocked_s": self.blocked_s,
                "rollout_swap_s": self.swap_s,
                "dynamic_sampling_dropped": b["dropped"],
            }
            self.blocked_s = self.swap_s = 0.0
            self._put(("batch", k, samples, meta))
            self.next_emit += 1

    def _put(self, msg) -> None:
        while True:
            try:
                self.results_q.put(msg, timeout=POLL_S)
                return
            except (EOFError, OSError) as e:  # remote channel closed: the learner is gone
                raise _Stop(f"learner disconnected ({type(e).__name__})") from None
            except queue.Full:
                self._check_parent()
                self.poll_control(0)
                if self.stopping:
                    return

    # ---- main loop -----------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            self.poll_control(0)
            self.apply_newest()
            while self.next_submit < self.total and self.allowed(self.next_submit):
                self.submit_batch(self.next_submit)
                self.next_submit += 1
            if self.gen.num_in_flight():
                for fg in self.gen.step():
                    self.collect(fg)
                self.emit_ready()
                self._check_parent()
                continue
            self.emit_ready()
            # Nothing in flight: either every batch is out (wait for stop) or the lag bound holds
            # the next batch back (wait for weights).
            t0 = time.perf_counter()
            self.poll_control(POLL_S)
            if self.next_emit < self.total:
                self.blocked_s += time.perf_counter() - t0
            self._check_parent()
        self.gen.abort_all()
        self.poll_control(0)
        self.apply_newest()  # the final weights, for the final evaluation
        if self.final_eval and self.evaluates:
            self._put(("eval", "after", self.side.evaluate()))
        self._put(("done", {"swaps": len(self.gen.swaps), "version": self.gen.version}))


# ============================================================================ learner side


class RolloutProcess:
    """Rank 0's handle on the rollout process: start, receive, send weights, stop, clean up."""

    def __init__(self, recipe: Recipe, base: Path, v0: int, start_step: int, init_path: Path | None,
                 timeout_s: float = 900.0):
        ctx = mp.get_context("spawn")
        self.results_q = ctx.Queue(maxsize=recipe.schedule.max_lag + 2)
        self.control_q = ctx.Queue()
        self.timeout_s = timeout_s
        self.info: dict = {}
        self.proc = ctx.Process(
            target=_rollout_main, name="rz-rollout",
            args=(recipe.model_dump(), str(base), v0, start_step, None if init_path is None else str(init_path),
                  self.results_q, self.control_q),
        )
        self.proc.start()
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def _dead_error(self, what: str) -> RolloutProcessError:
        return RolloutProcessError(
            f"the rollout process (pid {self.proc.pid}) exited with code {self.proc.exitcode} while the "
            f"learner was waiting for {what}. It was killed or crashed (out of memory? killed by hand?); "
            "its own log, if any, is above. The run cannot continue: restart it (schedule.max_lag=0 "
            "runs the synchronous trainer without a rollout process)."
        )

    def get(self, kind: str, what: str, timeout_s: float | None = None):
        """Next message, which must be of ``kind``; raises on error, death or timeout."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            try:
                msg = self.results_q.get(timeout=POLL_S)
            except queue.Empty:
                if not self.proc.is_alive():
                    try:  # it may have sent its last words just before exiting
                        msg = self.results_q.get(timeout=0.2)
                    except queue.Empty:
                        raise self._dead_error(what) from None
                elif time.monotonic() > deadline:
                    raise RolloutProcessError(
                        f"no answer from the rollout process (pid {self.proc.pid}) for "
                        f"{timeout_s or self.timeout_s:.0f} s while waiting for {what}") from None
                else:
                    continue
            if msg[0] == "error":
                raise RolloutProcessError(f"the rollout process failed while the learner waited for {what}:\n{msg[1]}")
            if msg[0] != kind:
                raise RolloutProcessError(f"rollout protocol error: expected {kind!r} ({what}), got {msg[0]!r}")
            return msg

    def send_weights(self, version: int, path: Path) -> None:
        if not self.proc.is_alive():
            raise self._dead_error(f"weights version {version} to be accepted")
        self.control_q.put(("weights", int(version), str(path)))

    def finish(self) -> float | None:
        """Normal end: stop the producer, get the final evaluation, wait for the process to exit."""
        self.control_q.put(("stop", True))
        value = self.get("eval", "the final evaluation")[2]
        self.get("done", "the rollout process to finish")
        self.close()
        return value

    def close(self, join_s: float = 60.0) -> None:
        """Idempotent; stop -> SIGTERM -> SIGKILL, then reap the vLLM processes it reported."""
        if self._closed:
            return
        self._closed = True
        from vllm_bridge.engine import _reap

        with contextlib.suppress(Exception):
            self.control_q.put(("stop", False))
        # Keep draining the results queue while waiting: a child whose queue pipe is full cannot
        # exit (its feeder thread flushes on exit).
        deadline = time.monotonic() + join_s
        while self.proc.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                while True:
                    self.results_q.get_nowait()
            self.proc.join(0.2)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        for pid, start in self.info.get("procs", []):
            _reap(pid, start, wait_s=5.0)
        for q in (self.results_q, self.control_q):
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
                q.close()


class RemoteRollout:
    """Rank 0's handle on the rollout loops of an ``rz submit`` job's rollout hosts (RZ_REMOTE_ROLLOUT=1).

    The same interface as RolloutProcess. Host j runs ``run_rollout`` (engine on its own node) for
    the prompts ``share_j`` of every batch, over vllm_bridge.remote.RolloutStreams; the learner
    concatenates the shares of batch k in host order (groups renumbered to the batch's prompt
    order) and sends every new weight version to every host. The weight files live in the run
    directory on the shared filesystem; a file is deleted once every host reports (batch meta
    ``rollout_version``) having applied that version or a newer one."""

    def __init__(self, recipe: Recipe, run_dir: Path, base: Path, v0: int, start_step: int,
                 init_path: Path | None, timeout_s: float | None = None):
        from vllm_bridge.remote import RolloutStreams, read_authkey, wait_for_hosts

        hosts = wait_for_hosts(run_dir, timeout_s=float(os.environ.get("RZ_ROLLOUT_WAIT_S", "600")))
        P = recipe.rollout.prompts_per_step
        hosts = hosts[: max(1, min(len(hosts), P))]  # every host gets at least one prompt per batch
        self.streams = RolloutStreams(hosts, read_authkey(run_dir))
        n = len(hosts)
        edges = [j * P // n for j in range(n + 1)]
        self.shares = [(edges[j], edges[j + 1]) for j in range(n)]
        # the longest wait for one message while heartbeats keep coming (a full-size batch of long
        # responses can take many minutes): the remote calls' limit, RZ_ROLLOUT_CALL_TIMEOUT_S
        self.timeout_s = timeout_s or float(os.environ.get("RZ_ROLLOUT_CALL_TIMEOUT_S", "3600"))
        self.info: dict = {}
        self.applied = [v0] * n  # newest version each host reported applied
        self.files: dict[int, str] = {} if init_path is None else {v0: str(init_path)}
        self._closed = self._finished = False
        self.streams.open("rollout", [
            {"recipe": recipe.model_dump(), "base": str(Path(base).resolve()), "v0": v0, "start_step": start_step,
             "init_path": None if init_path is None else str(Path(init_path).resolve()),
             "share": list(share), "host_index": j, "owns_weight_files": False}
            for j, share in enumerate(self.shares)])

    def _recv(self, j: int, kind: str, what: str):
        try:
            msg = self.streams.recv(j, self.timeout_s, what)
        except Exception as e:
            raise RolloutProcessError(f"while the learner waited for {what}: {e}") from None
        if msg[0] != kind:
            raise RolloutProcessError(f"rollout protocol error (node {self.streams.nodes[j]}): expected {kind!r} "
                                      f"({what}), got {msg[0]!r}")
        return msg

    def get(self, kind: str, what: str, timeout_s: float | None = None):
        if kind == "eval":  # only host 0 evaluates
            return self._recv(0, kind, what)
        msgs = [self._recv(j, kind, what) for j in range(len(self.shares))]
        if kind == "ready":
            info = dict(msgs[0][1])
            info["procs"] = []  # on other nodes: each host closes its own engine
            info["hosts"] = [{"node": node, **m[1]} for node, m in zip(self.streams.nodes, msgs)]
            info["startup_s"] = max(m[1]["startup_s"] for m in msgs)
            return ("ready", info)
        if kind == "batch":
            ks = {m[1] for m in msgs}
            if len(ks) != 1:
                raise RolloutProcessError(f"rollout hosts sent different batches {sorted(ks)} for {what}")
            samples = []
            for (a, _), m in zip(self.shares, msgs):
                for smp in m[2]:
                    smp.group += a
                    samples.append(smp)
            metas = [m[3] for m in msgs]
            for j, mt in enumerate(metas):
                self.applied[j] = max(self.applied[j], int(mt["rollout_version"]))
            self._delete_applied()
            meta = {
                "time_generate": max(mt["time_generate"] for mt in metas),
                "submit_version": min(mt["submit_version"] for mt in metas),
                "rollout_version": min(mt["rollout_version"] for mt in metas),
                "rollout_blocked_s": max(mt["rollout_blocked_s"] for mt in metas),
                "rollout_swap_s": max(mt["rollout_swap_s"] for mt in metas),
                "dynamic_sampling_dropped": sum(mt["dynamic_sampling_dropped"] for mt in metas),
                "rollout_hosts": len(metas),
            }
            return ("batch", msgs[0][1], samples, meta)
        if kind == "done":
            return ("done", {"hosts": [m[1] for m in msgs]})
        raise RolloutProcessError(f"unknown message kind {kind!r}")

    def _delete_applied(self) -> None:
        oldest = min(self.applied)  # a host only ever loads a newer version than it has
        for v in [v for v in self.files if v <= oldest]:
            _unlink(self.files.pop(v))

    def send_weights(self, version: int, path: Path) -> None:
        self.files[int(version)] = str(path)
        for j in range(len(self.shares)):
            try:
                self.streams.send(j, ("weights", int(version), str(Path(path).resolve())))
            except Exception as e:
                raise RolloutProcessError(f"sending weights version {version}: {e}") from None

    def finish(self) -> float | None:
        for j in range(len(self.shares)):
            self.streams.send(j, ("stop", True))
        value = self.get("eval", "the final evaluation")[2]
        self.get("done", "the rollout hosts to finish")
        for j in range(len(self.shares)):  # the op's own reply: the host closed its engine
            self._recv(j, "end", "the rollout hosts to close their engines")
        self._finished = True
        self.close()
        return value

    def close(self) -> None:
        """Idempotent. Unfinished: ask every host to stop, then drop the connections (a host whose
        learner disconnects stops its loop and closes its engine by itself)."""
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            for j in range(len(self.shares)):
                with contextlib.suppress(Exception):
                    self.streams.send(j, ("stop", False))
        self.streams.close()


def lag_stats(versions: torch.Tensor, mask: torch.Tensor, learner_version: int, max_lag: int) -> dict:
    """Per-token and per-sample lag (learner version - token version) over response tokens."""
    sel = mask.bool()
    lag = (learner_version - versions)[sel]
    vmin = torch.where(sel, versions, torch.full_like(versions, 1 << 40)).min(dim=1).values
    sample_lag = learner_version - vmin
    n = max(1, lag.numel())
    out = {
        "lag_mean": lag.double().mean().item() if lag.numel() else 0.0,
        "lag_max": int(lag.max()) if lag.numel() else 0,
        "sample_lag_mean": sample_lag.double().mean().item(),
        "frac_samples_span_versions": ((versions.masked_fill(~sel, -(1 << 40)).max(dim=1).values) != vmin).double().mean().item(),
    }
    for j in range(max_lag + 1):
        out[f"frac_tokens_lag_{j}"] = (lag == j).sum().item() / n
    return out


def _pure_lag0_bitwise(learner_logp, batch, learner_version: int) -> dict:
    """Bitwise agreement over samples generated entirely (prompt prefill included) by the learner's
    current weights: there, and only there, w == 1 exactly is expected in aligned mode."""
    sel = batch.loss_mask.bool()
    pure_rows = ((batch.versions == learner_version) | ~sel).all(dim=1) & sel.any(dim=1)
    tok = sel & pure_rows[:, None]
    if not tok.any():
        return {"lag0_pure_tokens": 0}
    eq = learner_logp[tok] == batch.old_logprobs[tok]
    return {"lag0_pure_tokens": int(tok.sum()), "lag0_pure_frac_bitwise": eq.double().mean().item(),
            "lag0_pure_max_abs_dlogp": (learner_logp[tok] - batch.old_logprobs[tok]).abs().max().item()}


def _train_step(learner, batch, loss_fn, recipe: Recipe) -> dict:
    return learner.train_step(
        batch.input_ids, loss_fn, **recipe.rollout.sampling_contract(),
        micro_batch_size=recipe.algo.micro_batch_size, old_logprobs=batch.old_logprobs,
        advantages=batch.advantages, loss_mask=batch.loss_mask, token_weight=batch.token_weight)


def train_async(recipe: Recipe) -> dict:
    """Run the recipe with rollout and learner overlapped; summary on rank 0 ({} elsewhere)."""
    from tqdm import tqdm

    from megatron_rz.diagnostics import RunningRatio, mismatch_stats
    from megatron_rz.guards import install_nonfinite_guard
    from megatron_rz.learner import Learner
    from megatron_rz.losses import make_loss_fn
    from megatron_rz.metrics import MetricsLogger, plot_run, run_summary
    from megatron_rz.model import init_parallel
    from megatron_rz.trainer import _broadcast, _rank, build_batch, export_hf_checkpoint, prepare_base_model

    max_lag = recipe.schedule.max_lag
    if max_lag < 1:
        raise ValueError("train_async needs schedule.max_lag >= 1 (0 is the synchronous trainer)")
    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    init_parallel(recipe.parallel, seed=recipe.schedule.seed)
    base = prepare_base_model(recipe, run_dir)
    learner = Learner(recipe.model, recipe.parallel, recipe.algo, hf_dir=str(base), seed=recipe.schedule.seed,
                      mode=recipe.mode)
    rank0 = _rank() == 0
    ckpt = resolve_load(recipe.checkpoint.load, run_dir)
    start_step = learner.load_checkpoint(ckpt) if ckpt is not None else 0
    if ckpt is not None and rank0:
        print(f"[rz] resumed from {ckpt} (step {start_step})", flush=True)
    v0 = learner.version
    wdir = run_dir / WEIGHTS_DIR
    init_path = None
    if start_step:
        weights = learner.hf_weights_on_rank0()  # collective
        if rank0:
            init_path = write_weights_file(weights.items(), wdir, v0)
        del weights
    rollout = logger = None
    earlier: list[dict] = []
    times = {"rollout_wait": 0.0, "learner": 0.0, "sync": 0.0}
    try:
        if rank0:
            dump_recipe(recipe, run_dir / "recipe.yaml")
            if recipe.schedule.eval_every:
                print("[rz] async trainer: schedule.eval_every is not used (evaluation before and after only)", flush=True)
            from vllm_bridge.remote import remote_rollout_requested

            if remote_rollout_requested():  # rz submit job: the engines run on the rollout nodes
                rollout = RemoteRollout(recipe, run_dir, base, v0, start_step, init_path)
                rollout.info = rollout.get("ready", "the rollout engines to start")[1]
                print("[rz] async rollout on the rollout nodes: " + ", ".join(
                    f"{h['node']} (prompts {a}..{b - 1} of each batch, rollout pid {h['pid']}, start-up "
                    f"{h['startup_s']:.1f} s)" for h, (a, b) in zip(rollout.info["hosts"], rollout.shares))
                    + f"; max_lag={max_lag}", flush=True)
            else:
                rollout = RolloutProcess(recipe, base, v0, start_step, init_path)
                rollout.info = rollout.get("ready", "the rollout engine to start")[1]
                print(f"[rz] rollout process pid {rollout.pid} ready (vLLM pids "
                      f"{[p for p, _ in rollout.info['procs']]}, start-up {rollout.info['startup_s']:.1f} s); "
                      f"max_lag={max_lag}", flush=True)
            earlier = truncate_metrics(run_dir / "metrics.jsonl", start_step) if start_step else []
            logger = MetricsLogger(recipe, run_dir, resume=bool(start_step))
            eval_before = rollout.get("eval", "the initial evaluation")[2]
            if logged_eval_before(earlier) is None:
                logger.log(start_step, {"eval_reward": eval_before})
            else:
                eval_before = logged_eval_before(earlier)
        guard = install_nonfinite_guard(learner)  # NaN/inf loss or gradients: the update is skipped, counted
        loss_fn = guard.wrap_loss(make_loss_fn(recipe.algo))
        d3_ratio = RunningRatio()
        for r in earlier if rank0 else []:  # a resumed run continues the same running statistic
            if "d3" in r:
                d3_ratio.add(r["d3"])
        from megatron_rz.preemption import arm_sigterm_checkpoint

        arm_sigterm_checkpoint()  # from here SIGTERM checkpoints the current step, then exits
        bar = tqdm(range(start_step, recipe.schedule.steps), desc=f"REINFORCE Zero async (lag<={max_lag})",
                   disable=not (rank0 and recipe.logging.progress))
        for step in bar:
            k = step - start_step
            t0 = time.perf_counter()
            payload = None
            if rank0:
                try:
                    _, kk, samples, meta = rollout.get("batch", f"batch {k} (update {step + 1})")
                    if kk != k:
                        raise RolloutProcessError(f"rollout sent batch {kk}, expected {k}")
                    batch = build_batch(samples, rollout.info["pad_id"])
                    oldest = int(batch.versions[batch.loss_mask.bool()].min())
                    if oldest < learner.version - max_lag:  # consumer-side check of the bound
                        raise RolloutProcessError(
                            f"lag bound violated: learner version {learner.version}, oldest token version "
                            f"{oldest}, max_lag {max_lag}")
                    payload = ("ok", batch, meta)
                except BaseException as e:
                    payload = ("abort", f"{type(e).__name__}: {e}", None)
                    _broadcast(payload)
                    raise
            payload = _broadcast(payload)
            if payload[0] == "abort":
                raise RolloutProcessError(f"rank 0 stopped the run: {payload[1]}")
            _, batch, meta = payload
            t1 = time.perf_counter()

            version = learner.version
            out = _train_step(learner, batch, loss_fn, recipe)
            # the learner logprobs the loss used (weights at `version`, before the update)
            learner_logp = out.pop("logprobs")
            guard.after_update(out, step + 1)  # raises RunStopped after algo.max_bad_updates in a row
            stats = mismatch_stats(learner_logp, batch.old_logprobs, batch.loss_mask)
            t2 = time.perf_counter()

            weights = learner.hf_weights_on_rank0()  # collective
            if rank0:
                rollout.send_weights(learner.version, write_weights_file(weights.items(), wdir, learner.version))
            del weights
            t3 = time.perf_counter()

            times["rollout_wait"] += t1 - t0
            times["learner"] += t2 - t1
            times["sync"] += t3 - t2
            if rank0:
                resp = batch.loss_mask.sum(dim=1)
                rewards = batch.task_rewards
                row = {
                    **stats,
                    **out,
                    "d3_peak_over_median": d3_ratio.add(stats.get("d3", 0.0)),
                    "reward_mean": rewards.mean().item(),
                    "shaped_reward_mean": batch.rewards.mean().item(),
                    "response_len": resp.mean().item(),
                    **lag_stats(batch.versions, batch.loss_mask, version, max_lag),
                    **_pure_lag0_bitwise(learner_logp, batch, version),
                    "weight_version": learner.version,
                    "max_lag_bound": max_lag,
                    "time_rollout": t1 - t0,  # what the learner waited for (rollout not hidden)
                    "time_rollout_wait": t1 - t0,
                    "time_learner": t2 - t1,
                    "time_sync": t3 - t2,
                    "time_step": t3 - t0,
                    "samples_per_s": batch.input_ids.shape[0] / (t3 - t0),
                    "tokens_per_s": resp.sum().item() / (t3 - t0),
                    **meta,
                }
                logger.log(step + 1, row)
                bar.set_postfix(reward=f"{row['reward_mean']:.2f}", lag=f"{row['lag_mean']:.2f}",
                                wait=f"{t1 - t0:.2f}s")
            checkpoint_after_step(learner, recipe, run_dir, step + 1)  # periodic + SLURM preemption

        learner.save_checkpoint(checkpoint_dir(run_dir, recipe.schedule.steps), step=recipe.schedule.steps)
        final_weights = learner.hf_weights_on_rank0()  # collective
        if not rank0:
            return {}
        export_hf_checkpoint(final_weights.items(), base, run_dir / "hf_final")
        eval_after = rollout.finish()
        logger.log(recipe.schedule.steps, {"eval_reward": eval_after})
        summary = run_summary(recipe, run_dir, start_step, eval_before, eval_after, times)
        logger.close()
        logger = None
        if recipe.logging.plots:
            plot_run(run_dir)
        return summary
    finally:
        if rollout is not None:
            rollout.close()
        if logger is not None:
            with contextlib.suppress(Exception):
                logger.close()
        if rank0:
            shutil.rmtree(wdir, ignore_errors=True)


# ============================================================================ benchmark


def bench_async_vs_sync(recipe: Recipe, steps: int = 10, max_lag: int = 2) -> dict:
    """Same recipe, ``steps`` updates with the synchronous trainer (max_lag=0) and the asynchronous
    one (max_lag=2), in one invocation; updates/s is over the update loop (sum of per-update
    wall times: rollout wait + learner + sync; start-up and evaluation excluded). Both runs share
    one base model (warm start made once). Prints and returns the numbers and the ratio."""
    from megatron_rz.trainer import prepare_base_model, train

    root = recipe.run_dir / "bench_async"
    shared = prepare_base_model(recipe.model_copy(deep=True), root)
    res = {}
    for name, lag in (("sync", 0), ("async", max_lag)):
        r = recipe.model_copy(deep=True)
        r.schedule.steps, r.schedule.max_lag, r.schedule.eval_every = steps, lag, 0
        r.logging.run_dir = str(root / name)
        r.logging.wandb, r.logging.plots, r.logging.progress = False, False, False
        r.checkpoint.every, r.checkpoint.load = 0, None
        if not (r.run_dir / "base_model" / "config.json").exists():
            shutil.copytree(shared, r.run_dir / "base_model", dirs_exist_ok=True)
        t0 = time.perf_counter()
        train(r)
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
        tr = [x for x in rows if "max_abs_dlogp" in x]
        loop = sum(x["time_step"] for x in tr)
        res[name] = {"updates": len(tr), "loop_s": loop, "updates_per_s": len(tr) / loop, "wall_s": wall,
                     "time_rollout_mean": sum(x["time_rollout"] for x in tr) / len(tr),
                     "time_learner_mean": sum(x["time_learner"] for x in tr) / len(tr),
                     "time_sync_mean": sum(x["time_sync"] for x in tr) / len(tr),
                     "lag_mean": sum(x.get("lag_mean", 0.0) for x in tr) / len(tr)}
    res["async_over_sync"] = res["async"]["updates_per_s"] / res["sync"]["updates_per_s"]
    res["cpu_count"] = os.cpu_count()
    print(f"sync (max_lag=0): {res['sync']['updates_per_s']:.3f} updates/s; async (max_lag={max_lag}): "
          f"{res['async']['updates_per_s']:.3f} updates/s; async/sync = {res['async_over_sync']:.2f}", flush=True)
    print(json.dumps(res), flush=True)
    return res
