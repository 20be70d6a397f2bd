"""The one REINFORCE Zero training loop, for every schedule: synchronous training is max_lag = 0.

Every learner rank runs ``train`` (torchrun for tp/ep/dp > 1); global rank 0 also owns the rollout,
the task and the logs. One update is

    batch k   <- the rollout (rank 0; broadcast to the other ranks), lag bound checked
    update    learner.train_step on batch k (weights v0 + k -> v0 + k + 1)
    weights   megatron_rz.loop.weights.hf_buckets(learner) (collective bucket stream in HF names) -> the rollout's
              weight transport (vllm_bridge.weights), version v0 + k + 1

and the rollout behind ``rollout`` depends on the schedule (``open_rollout``):

* max_lag = 0: megatron_rz.loop.rollout.InlineRollout, the producer in rank 0's own process: batch k
  is generated after update k's weights are in the engine (in-process transport; the filesystem
  transport for the vLLM servers of rollout.where=servers), so every token has lag 0. A local
  engine that dies is restarted (schedule.engine_restarts) with the current weights and the batch,
  the push or the evaluation is re-run identically (same prompts, same seeds).
* max_lag = m > 0: megatron_rz.loop.rollout_process.RolloutProcess, a rollout process beside the learner
  running the same producer with in-flight weight swaps (filesystem transport); batch k holds
  tokens of versions v0 + k - m .. v0 + k.

The engine is a local vLLM engine, or the job's vLLM servers (rollout.where=servers; those are
never restarted here: a dead server stops the run, naming it).

    learner --weights (HF names, version)--> vLLM engine --samples (ids, logprobs, versions)--> learner
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rz.launch.rundir import prepare_base_model
from megatron_rz.loop.rollout_process import RolloutProcessError
from megatron_rz.rl.batch_filters import token_weights_for_token_mean
from megatron_rz.rl.diagnostics import RunningRatio, mismatch_stats
from megatron_rz.rl.guards import install_nonfinite_guard
from megatron_rz.rl.losses import group_advantages, make_loss_fn
from megatron_rz.loop.metrics import MetricsLogger, plot_run, run_summary
from megatron_rz.learner.ranks import broadcast_object as broadcast, rank
from megatron_rz.recipe import Recipe, dump_recipe
from vllm_bridge.weights import make_transport
from megatron_rz.loop.resume import (checkpoint_after_step, checkpoint_dir, eval_before as logged_eval_before, prune_after_save,
                                     resolve_load, truncate_metrics)
from megatron_rz.loop import weights
from megatron_rz.loop.rollout import InlineRollout, RolloutSide  # noqa: F401 (RolloutSide: rz check / bench import it here)


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
    # [B] long, the weight version an agentic episode started under (its first turn's submission;
    # megatron_rz.rl.agentic); single-turn samples: their oldest token's version
    episode_versions: torch.Tensor | None = None


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
        # multi-turn episodes: only the tokens the model sampled (environment tokens are context)
        model = s.info.get("model_mask")
        mask[i, p : p + r] = 1.0 if model is None else torch.tensor(model, dtype=torch.float32)
        old[i, p : p + r] = torch.tensor(s.logprobs, dtype=torch.float32)
        ver[i, p : p + r] = torch.tensor(s.versions, dtype=torch.long)
    ver[mask == 0] = -1
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples])
    task_rewards = torch.tensor([s.info.get("task_reward", s.reward) for s in samples], dtype=torch.float32)
    episode = torch.tensor([s.info.get("episode_version", s.min_version) for s in samples], dtype=torch.long)
    return Batch(ids, mask, old, rewards, group_advantages(rewards, groups), ver,
                 token_weights_for_token_mean(mask), task_rewards, episode)


class RankZeroStopped(RolloutProcessError):
    """Rank 0 stopped the run (its own error is raised there); what the other ranks raise."""


def _drain(stream) -> None:
    with contextlib.suppress(Exception):
        for _ in stream:
            pass


def _agree(status: str, error: BaseException | None, what: str) -> str:
    """Rank 0's ``status`` on every rank; "error": rank 0 raises ``error``, the others RankZeroStopped."""
    said = broadcast(status if error is None else f"error: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    if said.startswith("error: "):
        if error is not None:
            raise error
        raise RankZeroStopped(f"rank 0 stopped the run during {what}: {said[7:]}")
    return said


def _counted(buckets, tally: list):
    """The bucket stream, adding each bucket's bytes to tally[0] as it passes and the seconds spent
    making it (the learner's export: gathers, HF names, bucketing) to tally[1]; the transport's own
    time (files, copies, RPCs) is what the push takes beyond that."""
    it = iter(buckets)
    while True:
        t0 = time.perf_counter()
        b = next(it, None)
        tally[1] += time.perf_counter() - t0
        if b is None:
            return
        tally[0] += sum(t.numel() * t.element_size() for t in b.values())
        yield b


def _on_rank0(rollout, step: int, version: int, fn, cleanup=lambda: None) -> tuple[str, BaseException | None]:
    """Rank 0's share of a collective step of the weight push: run ``fn``. On an error, ``cleanup``
    first (e.g. walk the rest of a collective stream, so the other ranks are not left waiting), then a
    dead local engine is restarted ("restart": the caller re-runs the step) and any other error is
    returned for _agree to raise on every rank. Other ranks: ("ok", None)."""
    from vllm_bridge.engine import RolloutEngineError

    if rank() != 0:
        return "ok", None
    try:
        fn()
    except RolloutEngineError as e:
        cleanup()
        return ("restart", None) if rollout.restart(e, step, version) else ("ok", e)
    except BaseException as e:
        cleanup()
        return "ok", e
    return "ok", None


def collective_sync(recipe: Recipe) -> bool:
    """Does every learner rank take part in delivering the weights (rollout.weight_transport=reshard)?"""
    from vllm_bridge.weights import resolve

    r = recipe.rollout
    return resolve(r.weight_transport, where=r.where, max_lag=recipe.schedule.max_lag) == "reshard"


def push_weights(learner, rollout, step: int, *, verify: bool, collective: bool = False) -> dict:
    """Collective: the learner's weights (version learner.version) into the rollout, bucket by
    bucket through its weight transport. A local engine that dies meanwhile is restarted and the
    push re-run (every rank walks the stream again); any other error stops every rank. Returns
    {"bytes": what this rank pushed (rank 0: the whole model's; the other ranks yield no buckets: 0),
    "export_s": the time this rank spent making the buckets (the rest of the push is the transport's)}.
    ``collective`` (rollout.weight_transport=reshard, known on every rank: the rollout lives on
    rank 0 only): every rank writes its slices of the engine workers' shards instead
    (push_resharded); the bytes are then this rank's share and ``export_s`` None (no bucket stream)."""
    if collective:
        return {"bytes": push_resharded(learner, rollout, step, verify=verify), "export_s": None}
    while True:
        tally = [0, 0.0]
        buckets = _counted(weights.hf_buckets(learner), tally)
        status, error = _on_rank0(rollout, step, learner.version,
                                  lambda: rollout.push_weights(buckets, learner.version, verify=verify),
                                  cleanup=lambda: _drain(buckets))
        _drain(buckets)  # the other ranks walk the stream (collective) without pushing
        if _agree(status, error, f"the weight push of update {step + 1}") == "ok":
            return {"bytes": tally[0], "export_s": tally[1]}


def push_resharded(learner, rollout, step: int, *, verify: bool) -> int:
    """Collective, rollout.weight_transport=reshard (docs/tp.md "Resharding learner -> engine"): rank 0
    asks the local engine for its layout and broadcasts it with the parts directory, every rank
    writes its parts (weights.write_resharded: no full tensor on any rank), rank 0 loads them into
    the engine (each worker reads only its own) and, with ``verify``, checks every parameter's
    bytes. A dead engine is restarted and the push re-run, as push_weights does."""
    from vllm_bridge.weights.reshard import ShardedFilesystemTransport

    while True:
        target: list = []
        status, error = _on_rank0(rollout, step, learner.version, lambda: target.append(rollout.reshard_target()))
        if _agree(status, error, f"the engine layout for the weight push of update {step + 1}") == "restart":
            continue
        layout, directory = broadcast(target[0] if target else None)
        written = weights.write_resharded(learner, layout, ShardedFilesystemTransport(directory), learner.version)
        status, error = _on_rank0(rollout, step, learner.version,
                                  lambda: rollout.apply_resharded(written, verify=verify))
        if _agree(status, error, f"the resharded weight push of update {step + 1}") == "ok":
            return written["sent_bytes"]


def fetch_batch(learner, rollout, k: int, step: int, max_lag: int, collective: bool = False, verify: bool = True,
                lag_bound: str = "token"):
    """Collective: batch k (of update ``step`` + 1) from the rollout on rank 0, broadcast, after the
    consumer-side lag-bound check. A dead local engine is restarted (the current weights re-pushed,
    ``verify``: and verified like every other sync) and the batch generated again with the same
    prompts and seeds."""
    from vllm_bridge.engine import RolloutEngineError

    while True:
        status, error, payload = "ok", None, None
        if rank() == 0:
            try:
                samples, meta = rollout.batch(k)
                batch = build_batch(samples, rollout.pad_id)
                # task.lag_bound: every model token's version, or every episode's start version
                # (<= its tokens' versions), within max_lag of the learner's
                unit = "episode" if lag_bound == "episode" else "token"
                oldest = int(batch.episode_versions.min() if unit == "episode"
                             else batch.versions[batch.loss_mask.bool()].min())
                if oldest < learner.version - max_lag:
                    raise RolloutProcessError(f"lag bound violated: learner version {learner.version}, oldest {unit} "
                                       f"version {oldest}, max_lag {max_lag}")
                payload = (batch, meta)
            except RolloutEngineError as e:
                if rollout.restart(e, step, learner.version):
                    status = "restart"
                else:
                    error = e
            except BaseException as e:
                error = e
        if _agree(status, error, f"batch {k} (update {step + 1})") == "restart":
            if learner.version > 0:  # the new engine holds the base model's weights (version 0)
                push_weights(learner, rollout, step, verify=verify, collective=collective)
            continue
        return broadcast(payload)


def evaluate(learner, rollout, step: int, *, final: bool = False, collective: bool = False, verify: bool = True):
    """Collective: the evaluation after update ``step`` + 1 on rank 0 (``final``: rollout.finish, the
    last one, which also closes the rollout; else rollout.evaluate); its value on rank 0, None
    elsewhere. A local engine that dies meanwhile is restarted, the current weights pushed
    (``verify``: and verified) and the evaluation run again, as fetch_batch does for a batch."""
    from vllm_bridge.engine import RolloutEngineError

    while True:
        status, error, value = "ok", None, None
        if rank() == 0:
            try:
                value = rollout.finish() if final else rollout.evaluate()
            except RolloutEngineError as e:
                if rollout.restart(e, step, learner.version):
                    status = "restart"
                else:
                    error = e
            except BaseException as e:
                error = e
        if _agree(status, error, f"the evaluation after update {step + 1}") == "restart":
            if learner.version > 0:
                push_weights(learner, rollout, step, verify=verify, collective=collective)
            continue
        return value


def open_rollout(recipe: Recipe, base: Path, run_dir: Path, learner, start_step: int):
    """Collective. The rollout of this schedule on rank 0 (None elsewhere), holding the learner's
    weights when the run resumes (version v0 > 0). Its engine: rollout.where (local, or the vLLM
    servers of an rz submit job)."""
    from megatron_rz.loop import rollout_process
    from megatron_rz.loop.rollout import connect_engine

    v0, rank0, resumed = learner.version, rank() == 0, bool(start_step)
    if recipe.schedule.max_lag == 0:
        rollout = None
        if rank0:
            rollout = InlineRollout(recipe, base, run_dir, v0, start_step, engine=connect_engine(recipe, run_dir))
        if resumed:
            push_weights(learner, rollout, start_step, verify=recipe.rollout.verify_sync,
                         collective=collective_sync(recipe))
        return rollout
    init = None
    if resumed:  # the rollout starts from the learner's weights: that version on disk first
        buckets = weights.hf_buckets(learner)
        if rank0:
            r = recipe.rollout
            init = make_transport(r.weight_transport, run_dir=run_dir, where=r.where,
                                  max_lag=recipe.schedule.max_lag).push(buckets, v0).paths
        else:
            _drain(buckets)
    if not rank0:
        return None
    return rollout_process.RolloutProcess(recipe, base, run_dir, v0, start_step, init)


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


def episode_lag_stats(episode_versions: torch.Tensor, learner_version: int, max_lag: int) -> dict:
    """Per-episode lag (learner version - the version the episode started under) of agentic
    episodes: mean, max and the histogram (share of episodes per lag 0..max_lag)."""
    lag = learner_version - episode_versions
    n = max(1, lag.numel())
    out = {"episode_lag_mean": lag.double().mean().item(), "episode_lag_max": int(lag.max())}
    for j in range(max_lag + 1):
        out[f"frac_episodes_lag_{j}"] = (lag == j).sum().item() / n
    return out


def pure_lag0_bitwise(learner_logp, batch, learner_version: int) -> dict:
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


def train(recipe: Recipe) -> dict:
    """Run the recipe, whatever its schedule; returns the final summary on rank 0 ({} elsewhere)."""
    from tqdm import tqdm

    from megatron_rz.learner.learner import Learner
    from megatron_rz.learner.model import init_parallel
    from megatron_rz.launch.preemption import arm_sigterm_checkpoint

    max_lag, steps = recipe.schedule.max_lag, recipe.schedule.steps
    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    init_parallel(recipe.parallel, seed=recipe.schedule.seed)
    base = prepare_base_model(recipe, run_dir)
    learner = Learner(recipe.model, recipe.parallel, recipe.algo, hf_dir=str(base), seed=recipe.schedule.seed,
                      mode=recipe.mode, te=recipe.runtime.te)
    if rank() == 0:
        print(f"[rz] learner layers: {learner.spec} (mode={recipe.mode}, runtime.te={recipe.runtime.te})", flush=True)
    rank0 = rank() == 0
    start_step = 0
    ckpt = resolve_load(recipe.checkpoint.load, run_dir)
    if ckpt is not None:
        start_step = learner.load_checkpoint(ckpt)
        if rank0:
            print(f"[rz] resumed from {ckpt} (step {start_step})", flush=True)
    rollout = logger = None
    earlier: list[dict] = []
    eval_before = None
    times = {"rollout": 0.0, "learner": 0.0, "sync": 0.0}
    try:
        rollout = open_rollout(recipe, base, run_dir, learner, start_step)
        if rank0:
            dump_recipe(recipe, run_dir / "recipe.yaml")
            rollout.start()
            earlier = truncate_metrics(run_dir / "metrics.jsonl", start_step) if start_step else []
            logger = MetricsLogger(recipe, run_dir, resume=bool(start_step))
            eval_before = logged_eval_before(earlier)
            if eval_before is None or max_lag > 0:  # a rollout process always sends its first evaluation
                fresh = rollout.eval_before()  # the evaluation's metrics (megatron_rz.rl.evaluation)
                if eval_before is None:
                    eval_before = fresh["eval_reward"]
                    logger.log(start_step, fresh)
        guard = install_nonfinite_guard(learner)  # NaN/inf loss or gradients: the update is skipped, counted
        loss_fn = guard.wrap_loss(make_loss_fn(recipe.algo))
        d3_ratio = RunningRatio()
        for r in earlier:  # a resumed run continues the same running statistic
            if "d3" in r:
                d3_ratio.add(r["d3"])
        arm_sigterm_checkpoint()  # from here SIGTERM checkpoints the current step, then exits
        bar = tqdm(range(start_step, steps), desc=f"REINFORCE Zero (lag<={max_lag})",
                   disable=not (rank0 and recipe.logging.progress))
        end, stopped_by = steps, None
        limit, t_loop = recipe.schedule.time_limit_s, time.perf_counter()
        for step in bar:
            k = step - start_step
            t0 = time.perf_counter()
            batch, meta = fetch_batch(learner, rollout, k, step, max_lag, collective_sync(recipe),
                                      recipe.rollout.verify_sync, recipe.task.lag_bound)
            t1 = time.perf_counter()

            version = learner.version
            out = learner.train_step(
                batch.input_ids, loss_fn, **recipe.rollout.sampling_contract(),  # the distribution sampled from
                micro_batch_size=recipe.algo.micro_batch_size, old_logprobs=batch.old_logprobs,
                advantages=batch.advantages, loss_mask=batch.loss_mask, token_weight=batch.token_weight)
            # The learner's logprobs that the loss used (weights `version`, before the update): at lag 0
            # every difference from the rollout logprobs is kernel mismatch.
            learner_logp = out.pop("logprobs")
            guard.after_update(out, step + 1)  # raises RunStopped after algo.max_bad_updates in a row
            stats = mismatch_stats(learner_logp, batch.old_logprobs, batch.loss_mask)
            t2 = time.perf_counter()

            r = recipe.rollout
            pushed = push_weights(learner, rollout, step, collective=collective_sync(recipe),
                                  verify=r.verify_sync and (step % r.verify_every == 0 or step == steps - 1))
            t3 = time.perf_counter()
            # (the last step's evaluation is the final one, after the loop)
            value = None
            if recipe.schedule.eval_every and (step + 1) % recipe.schedule.eval_every == 0 and step + 1 < steps:
                value = evaluate(learner, rollout, step, collective=collective_sync(recipe), verify=r.verify_sync)

            times["rollout"] += t1 - t0
            times["learner"] += t2 - t1
            times["sync"] += t3 - t2
            if rank0:
                resp = batch.loss_mask.sum(dim=1)
                row = {
                    **stats,
                    **out,
                    "d3_peak_over_median": d3_ratio.add(stats.get("d3", 0.0)),
                    "reward_mean": batch.task_rewards.mean().item(),
                    "shaped_reward_mean": batch.rewards.mean().item(),
                    "response_len": resp.mean().item(),
                    **lag_stats(batch.versions, batch.loss_mask, version, max_lag),
                    **(episode_lag_stats(batch.episode_versions, version, max_lag) if "agentic/episodes" in meta
                       else {}),
                    **pure_lag0_bitwise(learner_logp, batch, version),
                    "weight_version": learner.version,
                    "max_lag_bound": max_lag,
                    "time_rollout": t1 - t0,  # what the learner waited for its batch
                    "time_rollout_wait": t1 - t0,
                    "time_learner": t2 - t1,
                    "time_sync": t3 - t2,
                    "sync_bytes": pushed["bytes"],  # the weights pushed after this update (all of them)
                    # of time_sync: the learner's export of the buckets (the rest is the transport's)
                    **({"time_sync_export": pushed["export_s"]} if pushed["export_s"] is not None else {}),
                    "time_step": t3 - t0,
                    "samples_per_s": batch.input_ids.shape[0] / (t3 - t0),
                    "tokens_per_s": resp.sum().item() / (t3 - t0),
                    **meta,
                }
                if value is not None:
                    row.update(value)
                # an asynchronous run's periodic evaluations, made in the rollout process with the
                # weights version it held then (eval_version); the synchronous loop's is `value`
                periodic = rollout.periodic_evals()
                for v, ev in periodic[:-1]:  # more than one since the last row: each its own row
                    logger.log(step + 1, {**ev, "eval_version": v})
                if periodic:
                    row.update({**periodic[-1][1], "eval_version": periodic[-1][0]})
                logger.log(step + 1, row)
                bar.set_postfix(reward=f"{row['reward_mean']:.2f}", lag=f"{row['lag_mean']:.2f}",
                                dlogp=f"{stats.get('max_abs_dlogp', 0):.1e}")
            checkpoint_after_step(learner, recipe, run_dir, step + 1)  # periodic + SLURM preemption
            # rank 0's clock decides for every rank (one collective per update)
            if limit and step + 1 < steps and broadcast(time.perf_counter() - t_loop >= limit):
                end, stopped_by = step + 1, "schedule.time_limit_s"
                if rank0:
                    bar.close()
                    print(f"[rz] schedule.time_limit_s={limit:g} reached after update {end} of {steps}: "
                          f"finishing here (continue with checkpoint.load=latest)", flush=True)
                break

        learner.save_checkpoint(checkpoint_dir(run_dir, end), step=end)
        prune_after_save(recipe, run_dir)
        r = recipe.rollout
        final_eval = evaluate(learner, rollout, end - 1, final=True, collective=collective_sync(recipe), verify=r.verify_sync)
        buckets = weights.hf_buckets(learner)  # collective: every rank walks it
        if not rank0:
            _drain(buckets)
            return {}
        export_hf_checkpoint(buckets, base, run_dir / "hf_final")
        for v, ev in rollout.periodic_evals():  # made after the last training row was logged
            logger.log(end, {**ev, "eval_version": v})
        logger.log(end, final_eval)
        summary = run_summary(recipe, run_dir, start_step, eval_before, final_eval["eval_reward"], times, end_step=end,
                              stopped_by=stopped_by, learner_spec=learner.spec)
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
            from vllm_bridge.weights import WEIGHTS_DIR

            shutil.rmtree(run_dir / WEIGHTS_DIR, ignore_errors=True)  # versions in flight to the rollout process


def _bench_legs(recipe: Recipe, name: str, legs: list[tuple[str, str, int]], steps: int) -> tuple[Path, dict]:
    """Run ``legs`` [(leg name, mode, max_lag)] of ``steps`` updates each from one base model (made
    once), each in a fresh process, into a new RUN_DIR/<name>/run<i>/ (earlier results are kept).
    Returns (that folder, {leg: its training rows of metrics.jsonl, plus "wall_s"})."""
    import multiprocessing as mp

    root = recipe.run_dir / name
    shared = prepare_base_model(recipe.model_copy(deep=True), root)
    _release_device_memory()  # a warm start on the GPU leaves the allocator's cache in this process
    i = 1
    while (root / f"run{i}").exists():  # an earlier bench's results stay: each invocation gets its own folder
        i += 1
    out = root / f"run{i}"
    got: dict = {}
    for leg_name, mode, lag in legs:
        r = recipe.model_copy(deep=True)
        r.mode = mode
        r.schedule.steps, r.schedule.max_lag, r.schedule.eval_every = steps, lag, 0
        r.schedule.time_limit_s = 0.0  # every run does all its steps
        r.logging.run_dir = str(out / leg_name)
        r.logging.wandb, r.logging.plots, r.logging.progress = False, False, False
        r.checkpoint.every, r.checkpoint.load = 0, None
        if not (r.run_dir / "base_model" / "config.json").exists():
            shutil.copytree(shared, r.run_dir / "base_model", dirs_exist_ok=True)
        # Each leg in a fresh process: the learner and allocator of one leg would otherwise still hold
        # device memory when the next leg's vLLM engine checks the free memory at its start.
        t0 = time.perf_counter()
        leg = mp.get_context("spawn").Process(target=_bench_leg, args=(r.model_dump(),), name=f"rz-bench-{leg_name}")
        leg.start()
        leg.join()
        wall = time.perf_counter() - t0
        if leg.exitcode != 0:
            raise RuntimeError(f"rz bench {name.removeprefix('bench_')}: the {leg_name} run (mode={mode}, max_lag={lag}) "
                               f"failed with exit code {leg.exitcode}; its output is above, its run dir is {r.run_dir}")
        rows = [json.loads(x) for x in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = r.run_dir / "summary.json"
        spec = json.loads(summary.read_text()).get("learner_spec") if summary.is_file() else None
        got[leg_name] = {"rows": [x for x in rows if "max_abs_dlogp" in x], "wall_s": wall, "learner_spec": spec}
    return out, got


def bench_async_vs_sync(recipe: Recipe, steps: int = 10, lags: tuple[int, ...] = (2,)) -> dict:
    """Same recipe, ``steps`` updates at max_lag=0 (sync) and at each of ``lags``, in one invocation;
    updates/s is over the update loop (sum of per-update wall times: rollout wait + learner + sync;
    start-up and evaluation excluded). Every run starts from one base model (warm start made once);
    each invocation writes to a new RUN_DIR/bench_async/run<i>/ (earlier results are kept).
    Also the weight sync per update: bytes pushed, seconds on the learner's critical path and their
    ratio (sync: the in-process reload into the engine; async: the write for the rollout process,
    which loads it off the critical path), and on CUDA the host <-> device copy bandwidth of the
    machine (the link a one-GPU sync crosses). Prints and returns the numbers and the ratios."""
    runs = [("sync", 0)] + [(f"async_lag{lag}", lag) for lag in lags]
    out, got = _bench_legs(recipe, "bench_async", [(n, recipe.mode, lag) for n, lag in runs], steps)
    res: dict = {"steps": steps, "lags": list(lags), "dir": str(out)}
    for name, lag in runs:
        tr, wall = got[name]["rows"], got[name]["wall_s"]
        loop = sum(x["time_step"] for x in tr)
        mean = lambda key: sum(x.get(key, 0.0) for x in tr) / len(tr)  # noqa: E731
        res[name] = {"max_lag": lag, "updates": len(tr), "loop_s": loop, "updates_per_s": len(tr) / loop,
                     "wall_s": wall, "time_rollout_mean": mean("time_rollout"),
                     "time_learner_mean": mean("time_learner"), "time_sync_mean": mean("time_sync"),
                     "sync_bytes": mean("sync_bytes"),
                     "sync_gb_per_s": mean("sync_bytes") / max(mean("time_sync"), 1e-9) / 1e9,
                     "lag_mean": mean("lag_mean"), "frac_bitwise_mean": mean("frac_bitwise"),
                     "learner_spec": got[name]["learner_spec"]}
    for name, _ in runs[1:]:
        res[f"{name}_over_sync"] = res[name]["updates_per_s"] / res["sync"]["updates_per_s"]
    res["async_over_sync"] = res[f"{runs[1][0]}_over_sync"]
    res["cpu_count"] = os.cpu_count()
    res["link"] = _copy_bandwidth()
    line = "; ".join(f"{n} {res[n]['updates_per_s']:.3f} updates/s" for n, _ in runs)
    ratios = ", ".join(f"{n}/sync = {res[f'{n}_over_sync']:.2f}" for n, _ in runs[1:])
    (out / "bench_async.json").write_text(json.dumps(res, indent=1))
    print(f"learner layers {res['sync']['learner_spec']}; {line}; {ratios}; weight sync {res['sync']['sync_bytes'] / 1e9:.3f} GB in "
          f"{res['sync']['time_sync_mean']:.3f} s (sync) / {res[runs[1][0]]['time_sync_mean']:.3f} s (async)", flush=True)
    return res


STEP_PARTS = ("time_rollout", "time_learner", "time_sync", "time_step")


def step_split(rows: list[dict]) -> dict:
    """Per-update medians of the RL step's parts over training rows of metrics.jsonl, the first
    update left out when there are more (it pays one-off compilation and allocator growth):
    rollout (what the learner waited for its batch), learner, weight sync, the whole step; with each
    part's min-max over the updates kept."""
    import statistics

    use = rows[1:] if len(rows) > 1 else rows
    out: dict = {"updates": len(rows), "updates_timed": len(use)}
    for k in STEP_PARTS:
        v = [float(x.get(k, 0.0)) for x in use]
        out[k] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    if use and all("time_sync_export" in x for x in use):  # of the sync: the learner's export of the buckets
        v = [float(x["time_sync_export"]) for x in use]
        out["time_sync_export"] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    return out


def bench_step(recipe: Recipe, steps: int = 10) -> dict:
    """The whole RL step, aligned vs fast, in one invocation: ``steps`` updates of each mode at the
    recipe's max_lag from the same base model and seeds, each mode in a fresh process, one after the
    other (never two on a device at once); per mode the per-update medians of rollout wait, learner,
    weight sync and the whole step (:func:`step_split`), and aligned / fast for each. Written to a
    new RUN_DIR/bench_step/run<i>/bench_step.json (earlier results are kept); prints one line."""
    lag = recipe.schedule.max_lag
    out, got = _bench_legs(recipe, "bench_step", [("aligned", "aligned", lag), ("fast", "fast", lag)], steps)
    res: dict = {"steps": steps, "max_lag": lag, "dir": str(out), "arch": recipe.model.arch,
                 "dtype": recipe.model.dtype, "cpu_count": os.cpu_count()}
    for mode in ("aligned", "fast"):
        res[mode] = {**step_split(got[mode]["rows"]), "wall_s": got[mode]["wall_s"],
                     "learner_spec": got[mode]["learner_spec"]}
    res["aligned_over_fast"] = {k.removeprefix("time_"): res["aligned"][k]["median"] / max(res["fast"][k]["median"], 1e-12)
                                for k in STEP_PARTS}
    (out / "bench_step.json").write_text(json.dumps(res, indent=1))
    parts = ", ".join(f"{k} {res['aligned'][f'time_{k}']['median']:.3f} / {res['fast'][f'time_{k}']['median']:.3f} s "
                      f"({v:.2f}x)" for k, v in res["aligned_over_fast"].items())
    print(f"RL step, aligned / fast (learner layers {res['aligned']['learner_spec']} / {res['fast']['learner_spec']}), "
          f"median per update over {res['aligned']['updates_timed']} updates: {parts}", flush=True)
    return res


def _bench_leg(recipe_dict: dict) -> None:
    train(Recipe.model_validate(recipe_dict))


def _release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _copy_bandwidth(gib: float = 1.0) -> dict | None:
    """Host <-> device copy bandwidth (GB/s, pinned host memory, median of 5) on CUDA; None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = int(gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("device_to_host_gb_per_s", host, dev), ("host_to_device_gb_per_s", dev, host)):
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = n / sorted(times[1:])[2] / 1e9
    out["device"] = torch.cuda.get_device_name()
    del dev, host
    return out


def export_hf_checkpoint(buckets, base: Path, out: Path) -> None:
    """Write a bucket stream ({HF name: tensor} dicts) as a Hugging Face checkpoint next to the base
    model's config/tokenizer: model.safetensors for one bucket, else one shard per bucket
    (model-0000i-of-0000N.safetensors) and model.safetensors.index.json. One bucket in memory."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():  # config, tokenizer, generation config; not the weights or their index
        weights_file = f.suffix in (".safetensors", ".bin", ".pt", ".pth") or f.name.endswith(".index.json")
        if f.is_file() and not weights_file and f.name != "warm_start.json":
            shutil.copy(f, out / f.name)
    parts: list[tuple[Path, list[str], int]] = []
    for i, bucket in enumerate(buckets):
        tmp = out / f"part-{i:05d}.safetensors.tmp"
        save_file({k: v.detach().cpu().contiguous() for k, v in bucket.items()}, str(tmp), metadata={"format": "pt"})
        parts.append((tmp, list(bucket), sum(v.numel() * v.element_size() for v in bucket.values())))
    if len(parts) == 1:
        parts[0][0].replace(out / "model.safetensors")
        return
    weight_map, n = {}, len(parts)
    for i, (tmp, names, _) in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tmp.replace(out / name)
        weight_map.update({k: name for k in names})
    index = {"metadata": {"total_size": sum(p[2] for p in parts)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
