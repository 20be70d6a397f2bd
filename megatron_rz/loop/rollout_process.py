"""The rollout process, for schedule.max_lag > 0: rollout and learner run at once.

The training loop is megatron_rz.loop.trainer.train (one loop for every max_lag); this module is the
rollout it talks to when rollout and learner overlap.

Processes
    learner ranks   the main process(es) (torchrun for tp/ep/dp > 1): Megatron learner, metrics.
    rollout         one process spawned by global rank 0 (multiprocessing "spawn"; ``RolloutProcess``)
                    running ``run_rollout``: task, tokenizer and engine (megatron_rz.loop.rollout.RolloutSide:
                    a local vLLM engine with its engine-core/worker processes under it, or the job's
                    vLLM servers for rollout.where=servers) and the one producer
                    (megatron_rz.loop.rollout.Producer: groups, rewards, shaping, dynamic sampling, seeds,
                    lag bound) over vllm_bridge.streaming.StreamingGenerator (or the servers'
                    stream, the same surface over HTTP).

Channels (rank 0 <-> rollout process: multiprocessing queues)
    results  rollout -> learner, bounded (max_lag + 2): ("ready", info), ("eval", tag, value) (tag
             "before" / "after", or the weights version of a periodic evaluation),
             ("batch", k, samples, meta), ("error", traceback), ("done", info).
    control  learner -> rollout: ("weights", version, bucket paths), ("stop", final_eval).
    weights  the filesystem transport (what rollout.weight_transport resolves to here): rank 0
             copies every new version to host memory and a background thread writes it (the
             learner goes on; rollout.background_write_gb bounds the host copies waiting) as a
             directory of safetensors bucket files under
             ``run_dir/rollout/weights/`` (under a temporary name, then renamed: a reader never sees a
             partial version; in a job the run directory is on the shared filesystem, where the
             servers' workers read it) and sends the paths once the version is complete. Between two engine steps the rollout
             applies only the newest version it has received (swap_weights: pause at a step
             boundary, the engine's staging protocol, relabel, resume; requests in flight keep going
             with their KV cache) and deletes every version it has applied or skipped.

Periodic evaluation (schedule.eval_every = E > 0): once the engine holds a version at or past the next
multiple of E (and before the last version, whose evaluation is the final one), the rollout submits no
new batch until its requests in flight finish, evaluates with the weights it holds, sends ("eval",
version, metrics) and goes on. The learner logs it with its next training row (``eval_version``: the
weights it measured; the synchronous loop's evaluation after update E is version E exactly).

Lag bound: Producer.allowed on the producer side (a batch's prompts are submitted only once the
engine holds a recent enough version; the wait is logged as ``rollout_blocked_s``), and the loop
checks every batch's oldest token version on the consumer side.

Failure handling
    The learner waits for the rollout with short queue timeouts and checks that the rollout
    process is alive: a dead rollout process raises RolloutProcessError with its exit code (its own
    traceback is forwarded when it could send one; a dead server is named by the server client),
    never a hang. A local engine that dies or stalls inside the rollout process is restarted there
    (schedule.engine_restarts, as the synchronous loop does; _ProcessLoop.restart). On success,
    learner exception or Ctrl-C the rollout process is told to stop, then terminated (SIGTERM: it
    closes its engine), then killed, and finally the vLLM engine-core/worker pids it reported (at
    start and after each engine restart) are reaped (start-time checked). The rollout process exits
    by itself when its parent dies.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from pathlib import Path

from megatron_rz.recipe import Recipe
from vllm_bridge.weights import make_transport
from vllm_bridge.weights.buckets import WeightUpdate
from vllm_bridge.weights.filesystem import FilesystemTransport
from vllm_bridge.weights.verify import SyncCheck

POLL_S = 0.5


class RolloutProcessError(RuntimeError):
    """The rollout process died, failed, or stopped answering."""


def _release(paths) -> None:
    if paths:
        FilesystemTransport.release(WeightUpdate(0, list(paths)))


# ============================================================================ rollout process


class _Stop(Exception):
    pass


def _raise_exit(signum, frame):  # SIGTERM in the rollout process: unwind, close the engine
    raise SystemExit(128 + signum)


def _rollout_main(recipe_dict: dict, base: str, run_dir: str, v0: int, start_step: int, init_path: list[str] | None,
                  results_q, control_q) -> None:
    """Entry point of the rollout process (spawned by global rank 0)."""
    signal.signal(signal.SIGTERM, _raise_exit)
    parent = mp.parent_process()
    try:
        run_rollout(recipe_dict, base, run_dir, v0, start_step, init_path, results_q, control_q,
                    learner_alive=lambda: parent is None or parent.is_alive())
    except (KeyboardInterrupt, SystemExit, _Stop):
        results_q.cancel_join_thread()  # nobody may read what is still queued: do not block exit
    except BaseException:
        # The learner may not read for a while (batches queued ahead of this message fill the
        # bounded queue): keep trying while it lives, so its error names the cause (a dead server).
        msg, deadline = ("error", traceback.format_exc()), time.monotonic() + 600
        while time.monotonic() < deadline and (parent is None or parent.is_alive()):
            try:
                results_q.put(msg, timeout=POLL_S)
                break
            except queue.Full:
                continue
            except Exception:
                break


def run_rollout(recipe_dict: dict, base: str, run_dir: str, v0: int, start_step: int, init_path: list[str] | None,
                results_q, control_q, *, learner_alive=lambda: True, engine_extra: dict | None = None) -> None:
    """The rollout side for max_lag > 0, in the rollout process: the engine (local, or the job's
    vLLM servers for rollout.where=servers), ready report, first evaluation, then batches. The
    engine is closed on the way out, whatever happens."""
    import socket

    from megatron_rz.loop.rollout import Producer, RolloutSide, connect_engine
    from vllm_bridge.streaming import StreamingGenerator

    recipe = Recipe.model_validate(recipe_dict)
    side = RolloutSide(recipe, Path(base), engine_extra=engine_extra, engine=connect_engine(recipe, Path(run_dir)))
    try:
        eng = side.engine
        gen = StreamingGenerator(eng) if side.restartable else eng.stream()  # servers: their own stream
        kept = None
        if init_path is not None:  # resumed run: start from the learner's weights (bucket files)
            gen.swap_weights(v0, update=WeightUpdate(v0, list(init_path)))
            if side.restartable:
                kept = (v0, list(init_path))  # what a restarted engine loads until a newer version is applied
            else:
                _release(init_path)
        procs = eng.process_ids() if side.restartable else []  # a server's processes are its node's
        results_q.put(("ready", {"pid": os.getpid(), "procs": procs, "pad_id": side.tok.pad_token_id,
                                 "startup_s": getattr(eng, "startup_s", 0.0), "host": socket.gethostname()}))
        loop = _ProcessLoop(Producer(recipe, side, gen, v0, start_step), results_q, control_q,
                            learner_alive=learner_alive, kept=kept)
        results_q.put(("eval", "before", loop.evaluate()))
        loop.run()
    finally:
        with contextlib.suppress(BaseException):
            side.engine.close()


class _ProcessLoop:
    """The rollout process's loop around the producer: control messages (newest weights, stop),
    in-flight swaps between engine steps, batches out in order.

    A local engine that dies (or stalls: RolloutEngine's watch) is restarted here, at most
    schedule.engine_restarts times per run, as the synchronous loop does: the new engine loads the
    newest applied version from its bucket files (kept until the next version is applied, for this
    purpose), every batch not handed out yet is generated again from its first prompt (same prompts
    and seeds; the lag bound holds: those are the newest weights the rollout has), and the learner
    is told the new engine's processes ("restarted"), so it can reap them too."""

    def __init__(self, producer, results_q, control_q, *, learner_alive=lambda: True,
                 kept: tuple[int, list[str]] | None = None):
        self.p, self.gen, self.side, self.recipe = producer, producer.gen, producer.side, producer.recipe
        self.results_q, self.control_q = results_q, control_q
        self.learner_alive = learner_alive
        self.newest: tuple[int, list[str]] | None = None  # (version, bucket paths) received, not applied yet
        self.kept = kept  # (version, bucket paths) of the weights the engine holds (local engines)
        self.restarts = 0
        self.stopping = False
        self.final_eval = False
        # periodic evaluation: the next version to evaluate at (a multiple of eval_every), and whether
        # the engine holds one at or past it (then submissions wait for the requests in flight)
        self.eval_every = self.recipe.schedule.eval_every
        self.next_eval = (producer.v0 // self.eval_every + 1) * self.eval_every if self.eval_every else None
        self.eval_due = False

    def _check_parent(self) -> None:
        if not self.learner_alive():
            raise _Stop("learner process is gone")

    def _drop(self, paths) -> None:
        _release(paths)

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
                _, v, paths = msg
                if v <= self.gen.version or (self.newest is not None and v <= self.newest[0]):
                    self._drop(paths)
                    continue
                if self.newest is not None:
                    self._drop(self.newest[1])  # superseded before it was applied
                self.newest = (int(v), list(paths))
            elif msg[0] == "stop":
                self.stopping, self.final_eval = True, bool(msg[1])
            else:
                raise RuntimeError(f"rollout: unknown control message {msg[0]!r}")

    def swap_waits(self) -> bool:
        """Newest weights received but not appliable yet: this vLLM cannot swap under requests in
        flight (StreamingGenerator.in_flight_swaps), so submission pauses until they finish."""
        return self.newest is not None and not self.gen.in_flight_swaps and self.gen.num_in_flight() > 0

    def apply_newest(self) -> None:
        if self.newest is None or self.swap_waits():
            return
        v, paths = self.newest
        self.newest = None
        t0 = time.perf_counter()
        update = WeightUpdate(v, paths)
        r = self.recipe.rollout
        if r.verify_sync:
            # before the swap: asking a stock class (mode=fast) for its layout is what makes its worker
            # take each checkpoint tensor's bits as loaded, before vLLM packs it (worker_ext
            # rz_verify_layout / _rz_capture_loaded); asked after, the first verified sync finds nothing
            self._layout()
        self.gen.swap_weights(v, update=update)
        if r.verify_sync and (v % r.verify_every == 0 or v == self.p.v0 + self.p.total):
            self._verify(update)
        if self.next_eval is not None and self.next_eval <= v < self.p.v0 + self.p.total:
            self.eval_due = True
        if self.side.restartable:  # keep the files of the weights the engine holds (a restart loads them)
            if self.kept is not None:
                self._drop(self.kept[1])
            self.kept = (v, list(paths))
        else:
            self._drop(paths)
        self.p.swap_s += time.perf_counter() - t0

    def _layout(self) -> list[dict]:
        """The engine workers' verification layout, asked once per engine (a restart asks again)."""
        if getattr(self, "_verify_of", None) is not self.side.engine:
            self._verify_layout, self._verify_of = SyncCheck.layout_of(self.side.engine), self.side.engine
        return self._verify_layout

    def _verify(self, update: WeightUpdate) -> None:
        """Every parameter of every worker against the version's files (vllm_bridge.weights.verify.SyncCheck)."""
        SyncCheck(self._layout()).named(update.named_tensors()).verify(self.side.engine, update.version)

    def restart(self, error: Exception) -> None:
        """A new local engine in place of the dead one (see the class docstring); re-raises
        ``error`` when that is not possible (the job's vLLM servers; the budget spent)."""
        from vllm_bridge.streaming import StreamingGenerator

        limit = self.recipe.schedule.engine_restarts
        if not self.side.restartable or self.restarts >= limit:
            raise error
        self.restarts += 1
        version = self.kept[0] if self.kept is not None else self.p.v0
        print(f"[rz] rollout engine died in the rollout process ({str(error).splitlines()[0][:200]}); restarting it "
              f"with the weights of version {version} (restart {self.restarts} of {limit})", flush=True)
        self.side.restart_engine()
        gen = StreamingGenerator(self.side.engine)
        if self.kept is not None:
            update = WeightUpdate(version, list(self.kept[1]))
            gen.swap_weights(version, update=update)
            if self.recipe.rollout.verify_sync:
                self._verify(update)
        self.p.use_generator(gen)
        self.gen = self.p.gen
        self._put(("restarted", {"procs": self.side.engine.process_ids(), "version": version,
                                 "restart": self.restarts, "limit": limit}))

    def evaluate(self) -> dict:
        """The held-out evaluation, on a restarted engine if the engine dies meanwhile."""
        from vllm_bridge.engine import RolloutEngineError

        while True:
            try:
                return self.side.evaluate()
            except RolloutEngineError as e:
                self.restart(e)

    def evaluate_now(self) -> None:
        """The periodic evaluation, nothing in flight: with the weights the engine holds, sent as
        ("eval", version, metrics); the next one is due at the next multiple of eval_every."""
        v = self.gen.version
        self._put(("eval", int(v), self.evaluate()))
        self.eval_due = False
        self.next_eval = (v // self.eval_every + 1) * self.eval_every

    def emit_ready(self) -> None:
        for k, samples, meta in self.p.pop_ready():
            self._put(("batch", k, samples, meta))

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

    def run(self) -> None:
        from vllm_bridge.engine import RolloutEngineError

        while not self.stopping:
            try:
                self._once()
            except RolloutEngineError as e:
                self.restart(e)
        while True:
            try:
                self.gen.abort_all()
                self.poll_control(0)
                self.apply_newest()  # the final weights, for the final evaluation
                break
            except RolloutEngineError as e:
                self.restart(e)
        if self.final_eval:
            self._put(("eval", "after", self.evaluate()))
        if self.kept is not None:
            self._drop(self.kept[1])
            self.kept = None
        self._put(("done", {"swaps": len(self.gen.swaps), "version": self.gen.version, "restarts": self.restarts}))

    def _once(self) -> None:
        """One pass: control, the newest weights, submissions, one engine step (or a wait)."""
        p = self.p
        self.poll_control(0)
        self.apply_newest()
        if self.eval_due and not self.gen.num_in_flight():
            self.evaluate_now()
        while (not self.eval_due and not self.swap_waits() and p.next_submit < p.total
               and p.allowed(p.next_submit)):
            p.submit_batch(p.next_submit)
        if self.gen.num_in_flight():
            for fg in self.gen.step():
                p.collect(fg)
            self.emit_ready()
            self._check_parent()
            return
        self.emit_ready()
        # Nothing in flight: either every batch is out (wait for stop) or the lag bound holds
        # the next batch back (wait for weights).
        t0 = time.perf_counter()
        self.poll_control(POLL_S)
        if p.next_emit < p.total:
            p.blocked_s += time.perf_counter() - t0
        self._check_parent()


# ============================================================================ learner side


class _OutOfProcess:
    """What the training loop calls on a rollout that runs in another process (RolloutProcess;
    megatron_rz.loop.rollout.InlineRollout is the in-process one): weights go out
    through the filesystem transport, batches and evaluations come back as messages."""

    pad_id = None

    def start(self) -> None:
        self.info = self.get("ready", "the rollout engine(s) to start")[1]
        self.pad_id = self.info["pad_id"]

    def eval_before(self) -> float:
        return self.get("eval", "the initial evaluation")[2]

    def evaluate(self) -> float | None:
        return None  # evaluations run in the rollout process (before, every eval_every versions, after)

    def periodic_evals(self) -> list[tuple[int, dict]]:
        """The periodic evaluations received since the last call: [(weights version, metrics)]."""
        got, self._periodic = self._periodic, []
        return got

    def batch(self, k: int) -> tuple[list, dict]:
        _, kk, samples, meta = self.get("batch", f"batch {k}")
        if kk != k:
            raise RolloutProcessError(f"rollout sent batch {kk}, expected {k}")
        return samples, meta

    def push_weights(self, buckets, version: int, *, verify: bool = False) -> dict:
        """One version as bucket files; the rollout verifies it where it applies it. The files are
        written in the background (rollout.background_write_gb > 0: the call returns once the
        buckets are copied to host memory) and the rollout is told once the version is complete."""
        control = self.control_q
        return self.transport.push_background(
            buckets, version, lambda update: control.put(("weights", int(update.version), list(update.paths))))

    def restart(self, error: Exception, step: int, version: int) -> bool:
        return False


class RolloutProcess(_OutOfProcess):
    """Rank 0's handle on the local rollout process: start, receive, send weights, stop, clean up."""

    def __init__(self, recipe: Recipe, base: Path, run_dir: Path, v0: int, start_step: int,
                 init_path: list[str] | None, timeout_s: float = 900.0):
        ctx = mp.get_context("spawn")
        self.results_q = ctx.Queue(maxsize=recipe.schedule.max_lag + 2)
        self.control_q = ctx.Queue()
        self.timeout_s = timeout_s
        self.max_lag = recipe.schedule.max_lag
        self.info: dict = {}
        self._periodic: list[tuple[int, dict]] = []  # periodic evaluations received, not logged yet
        self.proc = ctx.Process(
            target=_rollout_main, name="rz-rollout",
            args=(recipe.model_dump(), str(base), str(run_dir), v0, start_step,
                  None if init_path is None else list(init_path),
                  self.results_q, self.control_q),
        )
        self.proc.start()
        self._closed = False
        r = recipe.rollout
        self.transport = make_transport(r.weight_transport, run_dir=run_dir, where=r.where, max_lag=recipe.schedule.max_lag,
                                        background_bytes=int(r.background_write_gb * (1 << 30)))

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def start(self) -> None:
        super().start()
        print(f"[rz] rollout process pid {self.pid} ready (vLLM pids {[p for p, _ in self.info['procs']]}, "
              f"start-up {self.info['startup_s']:.1f} s); max_lag={self.max_lag}", flush=True)

    def _dead_error(self, what: str) -> RolloutProcessError:
        return RolloutProcessError(
            f"the rollout process (pid {self.proc.pid}) exited with code {self.proc.exitcode} while the "
            f"learner was waiting for {what}. It was killed or crashed (out of memory? killed by hand?); "
            "its own log, if any, is above. The run cannot continue: restart it (schedule.max_lag=0 "
            "runs the synchronous trainer without a rollout process)."
        )

    def get(self, kind: str, what: str, timeout_s: float | None = None, skip: tuple[str, ...] = ()):
        """Next message, which must be of ``kind`` (messages of a kind in ``skip`` are dropped);
        raises on error, death or timeout."""
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
            if msg[0] == "restarted":  # its engine died and was restarted: reap the new one's processes too
                info = msg[1]
                self.info.setdefault("procs", []).extend(info["procs"])
                print(f"[rz] rollout engine restarted in the rollout process (vLLM pids {[p for p, _ in info['procs']]}, "
                      f"weights version {info['version']}, restart {info['restart']} of {info['limit']})", flush=True)
                continue
            if msg[0] == "eval" and isinstance(msg[1], int):  # a periodic evaluation: the loop logs it
                self._periodic.append((msg[1], msg[2]))
                continue
            if msg[0] in skip:
                continue
            if msg[0] != kind:
                raise RolloutProcessError(f"rollout protocol error: expected {kind!r} ({what}), got {msg[0]!r}")
            return msg

    def send_weights(self, version: int, paths: list[str]) -> None:
        if not self.proc.is_alive():
            what = f"weights version {version} to be accepted"
            with contextlib.suppress(queue.Empty):  # its last words, if it sent any, behind the batches
                while True:
                    msg = self.results_q.get(timeout=0.2)
                    if msg[0] == "error":
                        raise RolloutProcessError(f"the rollout process failed while the learner waited for {what}:\n{msg[1]}")
            raise self._dead_error(what)
        self.control_q.put(("weights", int(version), list(paths)))

    def finish(self) -> float | None:
        """Normal end: stop the producer, get the final evaluation, wait for the process to exit.
        A run that ends early (schedule.time_limit_s) leaves batches generated ahead of the learner
        (up to max_lag of them) in the queue: they are dropped (a resumed run generates its own)."""
        self.transport.flush()  # the last version reaches the rollout before its final evaluation
        self.control_q.put(("stop", True))
        value = self.get("eval", "the final evaluation", skip=("batch",))[2]
        self.get("done", "the rollout process to finish")
        self.close()
        return value

    def close(self, join_s: float = 60.0) -> None:
        """Idempotent; stop -> SIGTERM -> SIGKILL, then reap the vLLM processes it reported."""
        if self._closed:
            return
        self._closed = True
        from vllm_bridge.engine import reap_process

        with contextlib.suppress(Exception):
            self.transport.close()  # the background writer (nothing is flushed on this path)

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
            reap_process(pid, start, wait_s=5.0)
        for q in (self.results_q, self.control_q):
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
                q.close()
