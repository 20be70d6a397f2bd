"""The rollout producer, in one place: prompt groups, rewards, overlong shaping, dynamic sampling,
per-step seeds and the policy-lag bound, for every schedule.

``Producer`` turns update index k into batch k: the prompts of training step ``start_step + k``
(``resume.step_rng``: the same prompts whatever the lag or restart), each prompt's G samples
with the seeds ``rollout_seed`` gives, task rewards, DAPO overlong shaping, and (dynamic sampling)
a fresh prompt submitted for every group whose rewards are all equal. It drives a *generator*:

* ``BlockingGenerator(engine)``: submit / step over the blocking ``generate`` of any
  RolloutEngine-like client (a local RolloutEngine or the vLLM servers' RolloutClient): the
  synchronous schedule, where batch k is produced between update k-1's weight push and update k.
* ``vllm_bridge.streaming.StreamingGenerator`` (or the servers' ``RolloutClient.stream()``, the
  same surface): submit / step with in-flight weight swaps, for max_lag > 0 in the rollout process
  (megatron_rz.loop.rollout_process).

The lag bound (max_lag = m): batch k is trained at learner version v0 + k; its prompts are
submitted only once the generator holds a version >= v0 + k - m (``allowed``). m = 0 is the
synchronous case: the weights of update k-1 are in the engine before batch k is asked for.

``InlineRollout`` is the max_lag = 0 rollout of the one training loop (megatron_rz.loop.trainer.train):
the producer in the trainer's own process, its engine restarted when it dies.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from megatron_rz.rl.batch_filters import DynamicSamplingError, dynamic_sampling_keep, overlong_shaping
from megatron_rz.recipe import Recipe
from megatron_rz.loop.resume import step_rng
from megatron_rz.rl import agentic
from megatron_rz.rl.evaluation import evaluate as evaluate_task, evaluate_episodes
from megatron_rz.rl.tasks import Problem, make_task, prompt_text, score, step_problems
from vllm_bridge.weights import make_transport

REFILL_SEED_STRIDE = 7919  # the r-th refill of a batch: seed offset r * this
MAX_REFILLS_PER_GROUP = 8


def rollout_seed(seed: int, step: int, offset: int = 0) -> int:
    """The one sampling-seed formula: prompt i of training step ``step`` gets seeds
    rollout_seed(seed, step, i * G) .. + G - 1 (G samples per prompt); refills add their offsets."""
    return int(seed) * 100003 + int(step) * 101 + int(offset)


def shape_rewards(samples, problem: Problem, task, decode, recipe: Recipe) -> None:
    """Task reward of every sample of one group (kept in s.info['task_reward']; a reward call that
    raised or timed out scores 0 and is marked s.info['reward_status']), then the algorithm's
    reward shaping (DAPO overlong penalty) into s.reward."""
    algo, r = recipe.algo, recipe.rollout
    for s in samples:
        if "episode_reward" in s.info:  # an agentic episode: its environment scored it (megatron_rz.rl.agentic)
            s.reward, status = s.info["episode_reward"], s.info.get("reward_status")
        else:
            s.reward, status = score(task, problem, decode(s.response_ids))
        s.info["task_reward"] = s.reward
        if status:
            s.info["reward_status"] = status
    if algo.overlong_buffer > 0:
        shaped = overlong_shaping(torch.tensor([s.reward for s in samples]),
                                  torch.tensor([len(s.response_ids) for s in samples]),
                                  r.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        for s, v in zip(samples, shaped.tolist()):
            s.reward = v


class RolloutSide:
    """Task, tokenizer, rollout engine and evaluation, as one process holds them.

    The engine is a local vllm_bridge.engine.RolloutEngine built with the recipe's engine settings
    (Recipe.engine_kwargs), or ``engine``: any client with RolloutEngine's public API (the vLLM
    servers of an rz submit job: vllm_bridge.server_client.RolloutClient, ``connect_engine``)."""

    def __init__(self, recipe: Recipe, model_dir: Path, engine_extra: dict | None = None, engine=None):
        from transformers import AutoTokenizer

        self.recipe = recipe
        self.task = make_task(recipe.task)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self._restart_args = None
        if engine is not None:
            self.engine = engine
        else:
            from vllm_bridge.engine import RolloutEngine

            kwargs = {**recipe.engine_kwargs(), "stall_timeout_s": recipe.rollout.stall_timeout_s, **(engine_extra or {})}
            self.engine = RolloutEngine(str(model_dir), **kwargs)
            self._restart_args = (str(model_dir), kwargs)

    @property
    def restartable(self) -> bool:
        """A local engine this side built (a remote one is its hosts' business)."""
        return self._restart_args is not None

    def restart_engine(self) -> None:
        """A new local engine (the base model's weights) in place of a dead one."""
        from vllm_bridge.engine import RolloutEngine

        with contextlib.suppress(Exception):  # reaps what is left of the dead one
            self.engine.close()
        model_dir, kwargs = self._restart_args
        self.engine = RolloutEngine(model_dir, **kwargs)

    def encode(self, problems: list[Problem]) -> list[list[int]]:
        return [self.tok.encode(prompt_text(self.task, self.tok, p), add_special_tokens=False) for p in problems]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def rollout(self, problems: list[Problem], seed: int):
        """One generate call for ``problems`` (G samples each, prompt i seeds seed + i*G) with task
        rewards and shaping (rz bench rollout)."""
        r = self.recipe.rollout
        samples = self.engine.generate(self.encode(problems), n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens,
                                       seed=seed, **r.sampling_kwargs())
        for i, p in enumerate(problems):
            shape_rewards([s for s in samples if s.group == i], p, self.task, self.decode, self.recipe)
        return samples

    def evaluate(self) -> dict:
        """The held-out evaluation's metrics (megatron_rz.rl.evaluation): ``eval_reward`` (the first
        set's greedy accuracy) and eval/<set>/greedy, avg@k, pass@1, pass@k for every eval set
        (episodes for an agentic task: megatron_rz.rl.agentic.evaluate_episodes)."""
        if agentic.environment_of(self.task) is not None:
            return evaluate_episodes(lambda: agentic.make_generator(BlockingGenerator(self.engine), self, self.recipe),
                                     self.task, self.encode, self.recipe)
        return evaluate_task(self.engine, self.task, self.encode, self.decode, self.recipe)

    def close_task(self) -> None:
        """Stop the task's reward worker and its environment's tool worker, if it has them."""
        for obj in (self.task, agentic.environment_of(self.task)):
            close = getattr(obj, "close", None)
            if close is not None:
                close()


def connect_engine(recipe: Recipe, run_dir: Path):
    """The engine client of ``rollout.where``: None for "local" (RolloutSide builds a RolloutEngine),
    the job's vLLM servers for "servers" (rollout.num_engines records under RUN_DIR/rollout/servers)."""
    if recipe.rollout.where != "servers":
        return None
    from vllm_bridge.server_client import connect

    return connect(run_dir, expected=recipe.rollout.num_engines, wait_s=recipe.rollout.server_wait_s,
                   dead_after_s=recipe.rollout.server_dead_after_s)


class BlockingGenerator:
    """StreamingGenerator's submit / step / version over a blocking ``engine.generate`` (the narrow
    client API): ``step`` generates everything submitted since the last step and returns the
    finished groups. Consecutive single-prompt submits whose seeds follow generate's own pattern
    (prompt i: seed + i * n) go out as one generate call, so a batch is one call."""

    def __init__(self, engine):
        self.engine = engine
        self._pending: list[tuple] = []
        self.swaps: list[dict] = []

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def num_in_flight(self) -> int:
        return len(self._pending)

    def submit(self, prompt_ids: list[list[int]], n: int, *, seed: int | None = None, tag=None, **kw) -> None:
        for i, p in enumerate(prompt_ids):
            self._pending.append((list(p), n, None if seed is None else int(seed) + i * n, tag, i, kw))

    def step(self) -> list:
        from vllm_bridge.streaming import FinishedGroup

        pending, self._pending = self._pending, []
        done = []
        i = 0
        while i < len(pending):
            p0, n, seed0, _, _, kw = pending[i]
            j = i + 1
            while (j < len(pending) and pending[j][1] == n and pending[j][5] == kw and seed0 is not None
                   and pending[j][2] == seed0 + (j - i) * n):
                j += 1
            run = pending[i:j]
            now, version = time.perf_counter(), self.version
            samples = self.engine.generate([e[0] for e in run], n, seed=seed0, **kw)
            for g, e in enumerate(run):
                group = [s for s in samples if s.group == g]
                for s in group:
                    s.group = e[4]
                done.append(FinishedGroup(e[3], e[4], group, version, now))
            i = j
        return done

    def abort_all(self) -> None:
        self._pending.clear()


class Producer:
    """Batch k of this run (update start_step + k + 1) from a generator; see the module docstring."""

    def __init__(self, recipe: Recipe, side: RolloutSide, gen, v0: int, start_step: int):
        self.recipe, self.side = recipe, side
        self.gen = agentic.make_generator(gen, side, recipe)  # episodes, for an agentic task
        self.agentic = self.gen is not gen
        self.v0, self.start_step = int(v0), int(start_step)
        self.max_lag = recipe.schedule.max_lag
        self.total = recipe.schedule.steps - start_step
        self.next_submit = 0  # next batch index to submit
        self.next_emit = 0  # next batch index to hand out
        self.batches: dict[int, dict] = {}
        self.blocked_s = 0.0  # waiting for weights because of the lag bound (since the last batch)
        self.swap_s = 0.0

    def allowed(self, k: int) -> bool:
        """Lag bound: batch k is trained at version v0 + k; its tokens need version >= v0 + k - max_lag."""
        return self.gen.version >= self.v0 + k - self.max_lag

    def submit_batch(self, k: int) -> None:
        step = self.start_step + k
        rng = step_rng(self.recipe.schedule.seed, step)  # the same prompts whatever the schedule
        problems = step_problems(self.side.task, rng, step, self.recipe.rollout.prompts_per_step)
        self.batches[k] = {"problems": [], "groups": [], "dropped": 0, "refills": 0, "rng": rng, "reward_errors": 0,
                           "reward_timeouts": 0,
                           "t_submit": time.perf_counter(), "submit_version": self.gen.version}
        G = self.recipe.rollout.samples_per_prompt
        # one submit per prompt: a group's index is its problem's index in the batch's list
        for i in range(len(problems)):
            self._submit(k, problems[i], rollout_seed(self.recipe.schedule.seed, step, i * G))
        self.next_submit = max(self.next_submit, k + 1)

    def _submit(self, k: int, problem: Problem, seed: int) -> None:
        r = self.recipe.rollout
        b = self.batches[k]
        idx = len(b["problems"])
        b["problems"].append(problem)
        episode = {"problem": problem} if self.agentic else {}
        self.gen.submit(self.side.encode([problem]), n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens,
                        seed=seed, tag=(k, idx), **episode, **r.sampling_kwargs())

    def collect(self, fg) -> None:
        """Rewards and shaping for one finished group; DAPO dynamic sampling drops a group whose
        rewards are all equal and submits a fresh prompt for the same batch (now: so it still
        satisfies the batch's lag bound)."""
        k, idx = fg.tag
        b = self.batches[k]
        shape_rewards(fg.samples, b["problems"][idx], self.side.task, self.side.decode, self.recipe)
        for s in fg.samples:  # counted for every group, dropped ones too
            status = s.info.get("reward_status")
            if status:
                b[f"reward_{status}s"] += 1
        rewards = torch.tensor([s.reward for s in fg.samples])
        if self.recipe.algo.dynamic_sampling and not dynamic_sampling_keep(rewards, torch.zeros(len(rewards))).any():
            b["dropped"] += 1
            groups = self.recipe.rollout.prompts_per_step
            if b["refills"] >= MAX_REFILLS_PER_GROUP * groups:
                raise DynamicSamplingError(
                    f"batch {k}: {b['dropped']} groups had all-equal rewards; could not fill {groups} "
                    "informative groups (the task is too easy or too hard for the policy now: lower "
                    "rollout.prompts_per_step, raise rollout.samples_per_prompt, or set algo.dynamic_sampling=false)")
            b["refills"] += 1
            offset = REFILL_SEED_STRIDE * b["refills"]
            self._submit(k, self.side.task.sample(b["rng"], 1)[0],
                         rollout_seed(self.recipe.schedule.seed, self.start_step + k, offset))
            return
        b["groups"].append(fg)

    def pop_ready(self) -> list[tuple[int, list, dict]]:
        """Finished batches in order: (k, samples with groups renumbered 0.., meta)."""
        P = self.recipe.rollout.prompts_per_step
        out = []
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
                "reward_errors": b["reward_errors"],  # reward calls that raised (scored 0)
                "reward_timeouts": b["reward_timeouts"],  # ... or ran past task.reward_timeout_s
                **agentic.episode_counts(samples),  # turns, tool calls and faults of agentic episodes
            }
            self.blocked_s = self.swap_s = 0.0
            out.append((k, samples, meta))
            self.next_emit += 1
        return out

    def use_generator(self, gen) -> None:
        """After an engine restart (the rollout process's engine died): ``gen`` over the new engine;
        every batch not handed out yet is dropped and submitted again (same prompts and seeds, at
        the new engine's version)."""
        self.gen = agentic.make_generator(gen, self.side, self.recipe)
        for k in range(self.next_emit, self.next_submit):
            self.forget(k)

    def forget(self, k: int) -> None:
        """Drop what batch k has so far (its engine died): submit_batch(k) redoes it identically."""
        self.batches.pop(k, None)
        self.next_submit = min(self.next_submit, k)


class InlineRollout:
    """The max_lag = 0 rollout of the training loop, in rank 0's process: the producer over a
    BlockingGenerator, weights through the run's transport (rollout.weight_transport: in-process
    for a local engine by default, bucket files on the run directory for the job's vLLM servers),
    local engine restarts on death.

    Interface shared with rollout_process.RolloutProcess (what train() calls):
    ``push_weights(buckets, version, verify=)``, ``batch(k) -> (samples, meta)``, ``evaluate()``
    (None where the evaluations run elsewhere), ``periodic_evals()`` (those made elsewhere since the
    last call: the rollout process's, every schedule.eval_every versions), ``eval_before()``,
    ``finish()``, ``close()``, ``restart(error, step, version)``, ``pad_id``."""

    def __init__(self, recipe: Recipe, base: Path, run_dir: Path, v0: int, start_step: int, *, engine=None):
        self.recipe, self.run_dir, self.v0, self.start_step = recipe, Path(run_dir), int(v0), int(start_step)
        self.side = RolloutSide(recipe, base, engine=engine)
        self.pad_id = self.side.tok.pad_token_id
        r = recipe.rollout
        self.transport = make_transport(r.weight_transport, run_dir=self.run_dir, engine=self.side.engine,
                                        where=r.where, max_lag=0, cuda=torch.cuda.is_available())
        self.restarts = 0
        self._new_producer()

    def _new_producer(self) -> None:
        self.producer = Producer(self.recipe, self.side, BlockingGenerator(self.side.engine), self.v0, self.start_step)
        self.gen = self.producer.gen  # (agentic tasks: the episodes over it)

    @property
    def engine(self):
        return self.side.engine

    def start(self) -> None:
        return None

    def eval_before(self) -> dict:
        return self.side.evaluate()

    def evaluate(self) -> dict | None:
        return self.side.evaluate()

    def periodic_evals(self) -> list[tuple[int, dict]]:
        return []  # this loop evaluates in train() itself (evaluate(), after every eval_every updates)

    def batch(self, k: int) -> tuple[list, dict]:
        p = self.producer
        if not p.allowed(k):
            raise RuntimeError(f"batch {k} asked before the engine holds version {self.v0 + k} "
                               f"(it holds {self.gen.version}): the loop pushes weights before every batch")
        p.forget(k)
        p.submit_batch(k)
        while True:
            ready = p.pop_ready()
            if ready:
                _, samples, meta = ready[0]
                return samples, meta
            for fg in self.gen.step():
                p.collect(fg)

    def push_weights(self, buckets, version: int, *, verify: bool = False) -> dict:
        """One version into the engine through the run's weight transport (rollout.weight_transport,
        vllm_bridge.weights.select: in-process bytes over collective_rpc for a local engine by default,
        bucket files on the run directory for the job's vLLM servers). ``verify``: every parameter of
        every worker (of every server) against the bytes of the learner's tensors
        (vllm_bridge.weights.verify.SyncCheck), computed as they stream past."""
        check = self.sync_check() if verify else None
        stream = check.stream(buckets) if check is not None else buckets
        info = self.transport.deliver(stream, version, self.engine)
        if check is not None:
            info["verify"] = check.verify(self.engine, version)
        return info

    def sync_check(self):
        """A fresh SyncCheck for this engine (its workers' layout asked once per engine)."""
        from vllm_bridge.weights.verify import SyncCheck

        if getattr(self, "_verify_of", None) is not self.engine:
            self._verify_layout, self._verify_of = SyncCheck.layout_of(self.engine), self.engine
            check = SyncCheck(self._verify_layout)
            if check.unverified:
                print(f"[rz] weight sync verification: {len(check.unverified)} engine parameters "
                      f"({sum(check.unverified.values()) / 1e6:.1f} MB) are filled by stock vLLM's loaders in a "
                      f"way the check cannot map box by box (mode=fast) and are not compared: "
                      f"{', '.join(sorted(check.unverified)[:4])}{' ...' if len(check.unverified) > 4 else ''}; "
                      f"the {sum(len(x) for x in check.layout)} (worker, checkpoint tensor) pieces held are "
                      "checked exactly", flush=True)
            return check
        return SyncCheck(self._verify_layout)

    def reshard_target(self) -> tuple:
        """(engine layout, directory) of a resharded sync (rollout.weight_transport=reshard): the
        layout the engine's workers report (vllm_bridge.weights.reshard.engine_layout, asked once per
        engine) and the run's weights directory every learner rank writes its parts to."""
        from vllm_bridge.weights.reshard import engine_layout

        if getattr(self, "_layout_of", None) is not self.engine:
            self._layout, self._layout_of = engine_layout(self.engine), self.engine
        return self._layout, str(self.transport.directory)

    def apply_resharded(self, written: dict, *, verify: bool = False) -> dict:
        """Load a committed resharded version (megatron_rz.loop.weights.write_resharded's result on rank 0) into the
        local engine; ``verify``: every parameter of every worker against the bytes the learner
        ranks sent (vllm_bridge.weights.reshard.check_resharded). The files are deleted afterwards."""
        from vllm_bridge.weights.reshard import check_resharded, worker_checksums

        update = written["update"]
        try:
            info = self.transport.apply(update, self.engine)
            if verify:
                info["verify"] = check_resharded(written["expected"], worker_checksums(self.engine), self._layout,
                                                 update.version)
        finally:
            self.transport.release(update)
        return info

    def restart(self, error: Exception, step: int, version: int) -> bool:
        """After the engine died (RolloutEngineError) in update ``step`` (0-based): a new local
        engine, at most schedule.engine_restarts per run; False when that is not possible (remote
        engines, budget spent): the caller then stops the run with the error. The new engine
        holds the base weights; the caller pushes version ``version`` if the learner is past them."""
        if not self.side.restartable or self.restarts >= self.recipe.schedule.engine_restarts:
            return False
        self.restarts += 1
        print(f"[rz] rollout engine died during update {step + 1} ({str(error).splitlines()[0][:200]}); "
              f"restarting it with the weights of version {version} (restart {self.restarts} of "
              f"{self.recipe.schedule.engine_restarts})", flush=True)
        self.side.restart_engine()
        self._new_producer()
        return True

    def finish(self) -> dict:
        value = self.side.evaluate()
        self.close()
        return value

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.transport.close()
        with contextlib.suppress(Exception):
            self.side.engine.close()
        with contextlib.suppress(Exception):
            self.side.close_task()

