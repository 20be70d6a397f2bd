"""Held-out evaluation as the seeds report it: greedy accuracy, avg@k, pass@1 and pass@k per named set.

For every eval set of the task (megatron_rz.rl.tasks.eval_sets: a dataset task's task.eval_sets
files, else one set "heldout") and the current weights:

* ``eval/<set>/greedy``: mean reward of the greedy response (temperature 0);
* with ``task.eval_samples`` = k > 0, k samples per prompt at the rollout's sampling settings
  (rollout.temperature / top_p / top_k, the same seeds at every evaluation):
  ``eval/<set>/avg@k`` the mean reward over all k samples (partial credit included),
  ``eval/<set>/pass@1`` the share of samples that are correct (reward >= 1), averaged over prompts,
  ``eval/<set>/pass@k`` the share of prompts with at least one correct sample among the k;
* ``eval/reward_errors`` / ``eval/reward_timeouts``: reward calls of this evaluation that raised or
  ran out of time (scored 0).

``eval_reward`` (the plots' and summary's held-out figure) is the first set's greedy accuracy, or
its avg@k when task.eval_greedy is false. Agentic tasks (megatron_rz.rl.agentic): ``evaluate_episodes``.
"""

from __future__ import annotations

from megatron_rz.rl.tasks import eval_sets, score

EVAL_SEED = 977_123  # sampled evaluations use the same seeds every time (comparable across updates)
CORRECT = 1.0 - 1e-9  # a sample counts as correct from this reward on (pass@1, pass@k)


def evaluate(engine, task, encode, decode, recipe) -> dict:
    """Every eval set of ``task`` on ``engine`` (anything with RolloutEngine.generate); see the module
    docstring for the keys."""
    t, r = recipe.task, recipe.rollout
    out: dict = {}
    status = {"error": 0, "timeout": 0}

    def scored(problems, samples):
        vals = []
        for s in samples:
            v, st = score(task, problems[s.group], decode(s.response_ids))
            if st:
                status[st] += 1
            vals.append((s.group, v))
        return vals

    first = None
    for name, problems in eval_sets(task).items():
        ids = encode(problems)
        key = f"eval/{name}"
        if t.eval_greedy:
            samples = engine.generate(ids, n=1, temperature=0.0, top_p=1.0, max_new_tokens=r.max_new_tokens)
            out[f"{key}/greedy"] = sum(v for _, v in scored(problems, samples)) / len(problems)
        k = t.eval_samples
        if k:
            samples = engine.generate(ids, n=k, max_new_tokens=r.max_new_tokens, seed=recipe.schedule.seed * 7 + EVAL_SEED,
                                      **r.sampling_kwargs())
            per: dict[int, list[float]] = {}
            for g, v in scored(problems, samples):
                per.setdefault(g, []).append(v)
            n = len(problems)
            out[f"{key}/avg@{k}"] = sum(sum(vs) / len(vs) for vs in per.values()) / n
            out[f"{key}/pass@1"] = sum(sum(v >= CORRECT for v in vs) / len(vs) for vs in per.values()) / n
            if k > 1:
                out[f"{key}/pass@{k}"] = sum(any(v >= CORRECT for v in vs) for vs in per.values()) / n
        if first is None:
            first = out[f"{key}/greedy"] if t.eval_greedy else out[f"{key}/avg@{k}"]
    out["eval_reward"] = first
    out["eval/reward_errors"], out["eval/reward_timeouts"] = status["error"], status["timeout"]
    return out


def evaluate_episodes(new_generator, task, encode, recipe) -> dict:
    """Held-out evaluation of an agentic task (megatron_rz.rl.evaluation's keys): greedy episodes
    (eval/<set>/greedy, eval_reward), with task.eval_samples = k also sampled ones (avg@k, pass@1,
    pass@k), and the greedy episodes' tool use (eval/<set>/tool_call_rate, turns_mean,
    malformed_calls). ``new_generator()``: a fresh megatron_rz.rl.agentic.EpisodeGenerator on the
    engine (the rollout side makes it)."""
    t, r = recipe.task, recipe.rollout
    out: dict = {}
    errors = 0

    def run(problems, n, seed, **kw):
        nonlocal errors
        gen = new_generator()
        ids = encode(problems)
        for i, (p, x) in enumerate(zip(problems, ids)):
            gen.submit([x], n, seed=seed + i * n, tag=i, problem=p, max_new_tokens=r.max_new_tokens, **kw)
        groups = sorted(gen.drain(), key=lambda g: g.tag)
        errors += sum(s.info.get("reward_status") == "error" for g in groups for s in g.samples)
        return groups

    first = None
    for name, problems in eval_sets(task).items():
        key = f"eval/{name}"
        if t.eval_greedy:
            groups = run(problems, 1, 0, temperature=0.0, top_p=1.0)
            eps = [g.samples[0] for g in groups]
            out[f"{key}/greedy"] = sum(s.info["episode_reward"] for s in eps) / len(problems)
            out[f"{key}/tool_call_rate"] = sum(s.info["tool_calls"] > 0 for s in eps) / len(eps)
            out[f"{key}/turns_mean"] = sum(s.info["turns"] for s in eps) / len(eps)
            out[f"{key}/malformed_calls"] = sum(s.info["malformed_calls"] for s in eps)
        k = t.eval_samples
        if k:
            groups = run(problems, k, recipe.schedule.seed * 7 + EVAL_SEED, **r.sampling_kwargs())
            per = [[s.info["episode_reward"] for s in g.samples] for g in groups]
            n = len(problems)
            out[f"{key}/avg@{k}"] = sum(sum(v) / len(v) for v in per) / n
            out[f"{key}/pass@1"] = sum(sum(x >= CORRECT for x in v) / len(v) for v in per) / n
            if k > 1:
                out[f"{key}/pass@{k}"] = sum(any(x >= CORRECT for x in v) for v in per) / n
        if first is None:
            first = out[f"{key}/greedy"] if t.eval_greedy else out[f"{key}/avg@{k}"]
    out["eval_reward"] = first
    out["eval/reward_errors"], out["eval/reward_timeouts"] = errors, 0
    return out
