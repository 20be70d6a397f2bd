"""The synchronous REINFORCE Zero loop: rollout -> learner update -> weight sync, every step.

Every learner rank runs this function (torchrun for tp/ep/dp > 1). Global rank 0 also owns the
vLLM rollout engine, the task and the logs; the batch it builds is broadcast to the other ranks,
and the new weights flow back to it through the collective `export_hf_weights()` stream. In an
`rz submit` job (RZ_REMOTE_ROLLOUT=1) rank 0's engine is a vllm_bridge.remote.RemoteRolloutEngine:
the same engine, started on the job's rollout nodes and driven over TCP (docs/slurm.md).

    learner --weights (HF names, version)--> vLLM engine --samples (ids, logprobs, version)--> learner
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rz.batch_filters import flatten_groups, overlong_shaping, refill_groups, token_weights_for_token_mean
from megatron_rz.diagnostics import RunningRatio, mismatch_stats
from megatron_rz.guards import install_nonfinite_guard
from megatron_rz.losses import group_advantages, make_loss_fn
from megatron_rz.metrics import MetricsLogger, plot_run, run_summary
from megatron_rz.recipe import Recipe, RecipeError, dump_recipe
from megatron_rz.resume import checkpoint_after_step, checkpoint_dir, eval_before as logged_eval_before, resolve_load, step_rng, truncate_metrics
from megatron_rz.tasks import Problem, make_task


@dataclass
class Batch:
    """Right-padded learner batch built from rollout samples (what rank 0 broadcasts)."""

    input_ids: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] float, 1 on response tokens
    old_logprobs: torch.Tensor  # [B, S] float32, rollout logprob of token t at position t
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B]
    versions: torch.Tensor  # [B, S] long, weight version that produced each response token (-1 elsewhere)
    token_weight: torch.Tensor  # [B], B / (response tokens in the batch): token-level aggregation (DAPO)
    task_rewards: torch.Tensor  # [B], the task's reward before any shaping


def build_batch(samples, pad_id: int) -> Batch:
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    n, S = len(seqs), max(map(len, seqs))
    ids = torch.full((n, S), pad_id, dtype=torch.long)
    mask = torch.zeros((n, S), dtype=torch.float32)
    old = torch.zeros((n, S), dtype=torch.float32)
    ver = torch.full((n, S), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, : p + r] = torch.tensor(seqs[i])
        mask[i, p : p + r] = 1.0
        old[i, p : p + r] = torch.tensor(s.logprobs, dtype=torch.float32)
        ver[i, p : p + r] = torch.tensor(s.versions, dtype=torch.long)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples])
    task_rewards = torch.tensor([s.info.get("task_reward", s.reward) for s in samples], dtype=torch.float32)
    return Batch(ids, mask, old, rewards, group_advantages(rewards, groups), ver,
                 token_weights_for_token_mean(mask), task_rewards)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(obj):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


class RolloutSide:
    """Rank 0's half: task, tokenizer, vLLM engine, evaluation.

    The engine is a local vllm_bridge.engine.RolloutEngine, or with ``remote`` (a connected
    vllm_bridge.remote.RemoteRolloutEngine: the rollout hosts of an `rz submit` job) the same
    engine started on the rollout nodes with the same settings."""

    def __init__(self, recipe: Recipe, model_dir: Path, remote=None, engine_extra: dict | None = None):
        from transformers import AutoTokenizer

        self.recipe = recipe
        self.task = make_task(recipe.task)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        r = recipe.rollout
        engine_kwargs = dict(
            dtype=recipe.rollout.dtype or recipe.model.dtype,
            seed=recipe.schedule.seed,
            max_num_seqs=r.max_num_seqs,
            kv_cache_gb=r.kv_cache_gb,
            max_model_len=recipe.model.max_position_embeddings,
            aligned=recipe.mode == "aligned",
            tensor_parallel_size=r.tensor_parallel_size,
            fp8=recipe.model.fp8,  # the same blockwise FP8 linears as the learner (or none)
        )
        self.restarts = 0  # engine restarts after it died (restart_engine; local engines only)
        self._restart_args = None
        if remote is not None:
            started = remote.start(str(Path(model_dir).resolve()), **engine_kwargs)
            print("[rz] rollout engines on the rollout nodes: " + ", ".join(
                f"{s['node']} (host pid {s['host_pid']}, engine-core pids {s['engine_pids']}, "
                f"started in {s['startup_s']:.1f} s)" for s in started), flush=True)
            self.engine = remote
        else:
            from vllm_bridge.engine import RolloutEngine

            self.engine = RolloutEngine(str(model_dir), **engine_kwargs, **(engine_extra or {}))
            self._restart_args = (str(model_dir), {**engine_kwargs, **(engine_extra or {})})

    def restart_engine(self, weights: dict | None, version: int) -> None:
        """A new local engine in place of a dead one, holding `weights` (None: the base model's)."""
        import contextlib

        from vllm_bridge.engine import RolloutEngine

        with contextlib.suppress(Exception):  # reaps what is left of the dead one
            self.engine.close()
        model_dir, kwargs = self._restart_args
        self.engine = RolloutEngine(model_dir, **kwargs)
        if weights is not None:
            self.engine.update_weights(weights.items(), version=version)

    def encode(self, problems: list[Problem]) -> list[list[int]]:
        return [self.tok.encode(p.prompt, add_special_tokens=False) for p in problems]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def rollout(self, problems: list[Problem], seed: int):
        r = self.recipe.rollout
        samples = self.engine.generate(
            self.encode(problems),
            n=r.samples_per_prompt,
            max_new_tokens=r.max_new_tokens,
            seed=seed,
            **r.sampling_kwargs(),  # temperature, top_k, top_p (+ fast-mode extras)
        )
        for s in samples:
            s.reward = self.task.reward(problems[s.group], self.decode(s.response_ids))
        return samples

    def collect(self, rng: random.Random, step: int):
        """One step's training samples: task rewards, then the algorithm's batch shaping
        (DAPO overlong penalty, dynamic sampling refill). s.info['task_reward'] keeps the raw reward."""
        algo, r = self.recipe.algo, self.recipe.rollout
        base_seed = self.recipe.schedule.seed * 100003 + step * 101

        def generate(n: int, attempt: int):
            samples = self.rollout(self.task.sample(rng, n), seed=base_seed + attempt)
            for s in samples:
                s.info["task_reward"] = s.reward
            if algo.overlong_buffer > 0:
                shaped = overlong_shaping(
                    torch.tensor([s.reward for s in samples]),
                    torch.tensor([len(s.response_ids) for s in samples]),
                    r.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty,
                )
                for s, v in zip(samples, shaped.tolist()):
                    s.reward = v
            return samples

        if not algo.dynamic_sampling:
            return generate(r.prompts_per_step, 0)
        result = refill_groups(generate, r.prompts_per_step)
        samples = flatten_groups(result.groups)
        for s in samples:
            s.info["dynamic_sampling_dropped"] = result.dropped_groups
        return samples

    def evaluate(self) -> float:
        """Greedy exact-match accuracy on the task's held-out prompts."""
        problems = self.task.eval_set()
        samples = self.engine.generate(
            self.encode(problems), n=1, temperature=0.0, top_p=1.0, max_new_tokens=self.recipe.rollout.max_new_tokens
        )
        return sum(self.task.reward(problems[s.group], self.decode(s.response_ids)) for s in samples) / len(problems)


def restarting(side: RolloutSide, recipe: Recipe, step: int, weights: dict | None, version: int, call):
    """call() (an engine operation of update `step`, 0-based). When the local engine dies
    (RolloutEngineError: its engine core was killed, OOM, ...) a new one is started holding the
    current `weights` (None: the base model's) and call() runs again from its start. At most
    schedule.engine_restarts per run; then (and for remote engines) the error stops the run (rz
    train names the checkpoint to resume from)."""
    from vllm_bridge.engine import RolloutEngineError

    while True:
        try:
            return call()
        except RolloutEngineError as e:
            if side._restart_args is None or side.restarts >= recipe.schedule.engine_restarts:
                raise
            side.restarts += 1
            print(f"[rz] rollout engine died during update {step + 1} ({str(e).splitlines()[0][:200]}); "
                  f"restarting it with the weights of version {version} (restart {side.restarts} of "
                  f"{recipe.schedule.engine_restarts})", flush=True)
            side.restart_engine(weights, version)


def collect_restarting(side: RolloutSide, recipe: Recipe, step: int, weights: dict | None, version: int):
    """side.collect for `step`, through `restarting`: a rollout cut short by a dead engine runs again
    with the same prompts and seeds on the new engine (same weights), so the batch is the one the
    dead engine would have produced: nothing lost or counted twice."""
    return restarting(side, recipe, step, weights, version,
                      lambda: side.collect(step_rng(recipe.schedule.seed, step), step))


def prepare_base_model(recipe: Recipe, run_dir: Path) -> Path:
    """The starting checkpoint: model.pretrained (checked against the recipe), else the tiny model
    (tokenizer + random init + SFT warm start) made for this recipe's base-model hash: base_model/
    when it was made from the same settings, else base_model-<hash>/ (megatron_rz.rundir)."""
    from megatron_rz.rundir import base_model_dir, build_base_model

    if recipe.model.pretrained:
        from megatron_rz.pretrained import check_pretrained

        return check_pretrained(recipe)
    base, missing = base_model_dir(recipe, run_dir)
    if base.name != "base_model" and _rank() == 0:
        print(f"[rz] {run_dir / 'base_model'} was made from other model/task/warm-start settings: "
              f"{'making' if missing else 'using'} {base}", flush=True)
    if missing:
        if _rank() == 0:
            info = build_base_model(recipe, base, progress=recipe.logging.progress)
            print(f"[rz] warm start done: {json.dumps(info)}", flush=True)
        if dist.is_initialized():
            dist.barrier()
    return base


def connect_remote_rollout(recipe: Recipe, run_dir: Path):
    """Rank 0's client for the job's rollout hosts (RZ_REMOTE_ROLLOUT=1), or None for a local engine."""
    from vllm_bridge.remote import RemoteRolloutEngine, remote_rollout_requested

    if not remote_rollout_requested():
        return None
    wait_s = float(os.environ.get("RZ_ROLLOUT_WAIT_S", "600"))
    remote = RemoteRolloutEngine.from_run_dir(run_dir, wait_s=wait_s)
    print(f"[rz] remote rollout: connected to {len(remote.nodes)} host(s) on {remote.nodes}", flush=True)
    return remote


def train(recipe: Recipe) -> dict:
    """Run the recipe; returns the final summary on rank 0 (empty dict elsewhere)."""
    if recipe.schedule.max_lag > 0:
        from megatron_rz.async_trainer import train_async

        return train_async(recipe)
    from tqdm import tqdm

    from megatron_rz.learner import Learner
    from megatron_rz.model import init_parallel

    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    init_parallel(recipe.parallel, seed=recipe.schedule.seed)
    base = prepare_base_model(recipe, run_dir)
    learner = Learner(recipe.model, recipe.parallel, recipe.algo, hf_dir=str(base), seed=recipe.schedule.seed,
                      mode=recipe.mode)
    rank0 = _rank() == 0
    start_step = 0
    ckpt = resolve_load(recipe.checkpoint.load, run_dir)
    if ckpt is not None:
        start_step = learner.load_checkpoint(ckpt)
        if rank0:
            print(f"[rz] resumed from {ckpt} (step {start_step})", flush=True)
    side = RolloutSide(recipe, base, remote=connect_remote_rollout(recipe, run_dir)) if rank0 else None
    if rank0:
        dump_recipe(recipe, run_dir / "recipe.yaml")
    if start_step:
        weights = learner.hf_weights_on_rank0()  # collective
        if rank0:
            side.engine.update_weights(weights.items(), version=learner.version)
    earlier = truncate_metrics(run_dir / "metrics.jsonl", start_step) if (rank0 and start_step) else []
    logger = MetricsLogger(recipe, run_dir, resume=bool(start_step)) if rank0 else None
    guard = install_nonfinite_guard(learner)  # NaN/inf loss or gradients: the update is skipped, counted
    loss_fn = guard.wrap_loss(make_loss_fn(recipe.algo))
    d3_ratio = RunningRatio()
    for r in earlier:  # a resumed run continues the same running statistic
        if "d3" in r:
            d3_ratio.add(r["d3"])
    times = {"rollout": 0.0, "learner": 0.0, "sync": 0.0}

    eval_before = None
    if rank0:
        eval_before = logged_eval_before(earlier)
        if eval_before is None:
            eval_before = side.evaluate()
            logger.log(start_step, {"eval_reward": eval_before})
    from megatron_rz.preemption import arm_sigterm_checkpoint

    arm_sigterm_checkpoint()  # from here SIGTERM checkpoints the current step, then exits
    weights = weights if start_step else None  # what the engine holds (rank 0), for a restart
    steps = range(start_step, recipe.schedule.steps)
    bar = tqdm(steps, desc="REINFORCE Zero", disable=not (rank0 and recipe.logging.progress))
    for step in bar:
        t0 = time.perf_counter()
        batch = None
        if rank0:
            samples = collect_restarting(side, recipe, step, weights, learner.version)
            batch = build_batch(samples, side.tok.pad_token_id)
        batch = _broadcast(batch)
        t1 = time.perf_counter()

        out = learner.train_step(
            batch.input_ids,
            loss_fn,
            **recipe.rollout.sampling_contract(),  # the distribution the rollout sampled from
            micro_batch_size=recipe.algo.micro_batch_size,
            old_logprobs=batch.old_logprobs,
            advantages=batch.advantages,
            loss_mask=batch.loss_mask,
            token_weight=batch.token_weight,
        )
        # The learner's logprobs that the loss used, on the weights that generated the batch: at
        # lag 0 every difference from the rollout logprobs is kernel mismatch.
        stats = mismatch_stats(out.pop("logprobs"), batch.old_logprobs, batch.loss_mask)
        guard.after_update(out, step + 1)  # raises RunStopped after algo.max_bad_updates in a row
        t2 = time.perf_counter()

        # The stream is collective (TP/EP gathers): every rank walks it; rank 0 holds the full tensors.
        weights = learner.hf_weights_on_rank0()
        if rank0:
            restarting(side, recipe, step, weights, learner.version,
                       lambda: side.engine.update_weights(weights.items(), version=learner.version))
            r = recipe.rollout
            if r.verify_sync and (step % r.verify_every == 0 or step == recipe.schedule.steps - 1):
                side.engine.verify_sync(weights.items())
        t3 = time.perf_counter()

        times["rollout"] += t1 - t0
        times["learner"] += t2 - t1
        times["sync"] += t3 - t2
        if rank0:
            resp_len = batch.loss_mask.sum(dim=1)
            row = {
                **stats,
                **{k: v for k, v in out.items()},
                "d3_peak_over_median": d3_ratio.add(stats.get("d3", 0.0)),
                "reward_mean": batch.task_rewards.mean().item(),
                "shaped_reward_mean": batch.rewards.mean().item(),
                "response_len": resp_len.mean().item(),
                "lag_max": 0,
                "weight_version": learner.version,
                "time_rollout": t1 - t0,
                "time_learner": t2 - t1,
                "time_sync": t3 - t2,
                "time_step": t3 - t0,
            }
            # (the last step's evaluation is the final one, after the loop)
            if recipe.schedule.eval_every and (step + 1) % recipe.schedule.eval_every == 0 \
                    and step + 1 < recipe.schedule.steps:
                row["eval_reward"] = side.evaluate()
            logger.log(step + 1, row)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", dlogp=f"{stats.get('max_abs_dlogp', 0):.1e}")
        checkpoint_after_step(learner, recipe, run_dir, step + 1)  # periodic + SLURM preemption

    learner.save_checkpoint(checkpoint_dir(run_dir, recipe.schedule.steps), step=recipe.schedule.steps)
    final_weights = learner.hf_weights_on_rank0()  # collective
    if not rank0:
        return {}
    export_hf_checkpoint(final_weights.items(), base, run_dir / "hf_final")
    eval_after = side.evaluate()
    logger.log(recipe.schedule.steps, {"eval_reward": eval_after})
    summary = run_summary(recipe, run_dir, start_step, eval_before, eval_after, times)
    logger.close()
    if recipe.logging.plots:
        plot_run(run_dir)
    side.engine.close()
    return summary


def export_hf_checkpoint(weights, base: Path, out: Path) -> None:
    """Write the weight stream as a Hugging Face checkpoint next to the base model's config/tokenizer."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():  # config, tokenizer, generation config; not the weights or their index
        weights_file = f.suffix in (".safetensors", ".bin", ".pt", ".pth") or f.name.endswith(".index.json")
        if f.is_file() and not weights_file and f.name != "warm_start.json":
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in weights}, str(out / "model.safetensors"), metadata={"format": "pt"})
