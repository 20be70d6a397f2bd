"""Multi-turn, tool-using episodes: the environment interface, the episode runner, a built-in task.

An episode is a conversation of token ids: the prompt, then model turn 1, the environment's reply,
model turn 2, ... until the environment says it is over or ``task.max_turns`` model turns were
taken. The learner scores the whole conversation in one forward; only the tokens the model sampled
count (``Sample.info["model_mask"]``: 1 on model tokens, 0 on prompt-side environment tokens) in the
loss, the IS weights and the mismatch metrics. Every model token keeps the logprob it was sampled
with and the weight version that sampled it; an episode may span weight updates (async rollouts).

The environment (``Environment``, shaped like a multi-turn environment of the `verifiers` library:
reset / env_response / is-over / reward):

* ``reset(problem) -> state``: a fresh dict for one episode;
* ``env_response(problem, turns, state) -> str | None``: the reply to the model's latest turn
  (``turns``: the decoded text of every model turn so far), or None: the episode is over;
* ``reward(problem, turns, state) -> float``: the episode's reward.

A task is agentic when it has an ``env`` attribute holding one. ``ToolEnv`` is the built-in one:
a model turn ``name(arg)`` calls the tool ``name`` (a plain Python function, run in a guarded
worker: megatron_rz.rl.tools), its reply is ``[text]``; a turn without brackets is the final answer;
anything else that looks like a call (unknown tool, unbalanced brackets) is a malformed call: the
episode ends there and the reward is 0 (the model's mistake, counted, not a crash).

Episodes run through ``EpisodeGenerator``, which wraps the rollout generator of either schedule
(BlockingGenerator at max_lag = 0, vllm_bridge.streaming.StreamingGenerator at max_lag > 0): every
turn is one engine request whose prompt is the conversation so far (token ids, never re-tokenized
text), so vLLM's prefix cache reuses the earlier turns' KV blocks.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from megatron_rz.recipe import RecipeError, TaskConfig
from megatron_rz.rl.problem import Problem
from megatron_rz.rl.tools import ToolWorker, resolve as resolve_tool, tool_path

TURN_SEED_STRIDE = 1_000_003  # turn t of an episode samples with seed (its seed) + t * this
COUNTERS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_truncated", "malformed_calls",
            "context_full", "env_errors", "env_tokens", "model_tokens")


class Environment(Protocol):
    max_turns: int

    def reset(self, problem: Problem) -> dict: ...

    def env_response(self, problem: Problem, turns: list[str], state: dict) -> str | None: ...

    def reward(self, problem: Problem, turns: list[str], state: dict) -> float: ...


def environment_of(task) -> Environment | None:
    """The task's environment (None: a single-turn task)."""
    return getattr(task, "env", None)


# ---------------------------------------------------------------- the tool environment

CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*$", re.S)


class ToolEnv:
    """Tool calls ``name(arg)`` -> ``[reply]``; a turn with no brackets ends the episode (the final
    answer). ``tools``: functions (or 'module:function' paths) ``fn(arg: str) -> str``, called by
    their function name. ``reply``: the format of the environment's text around a tool's output;
    ``answer``: the reference final answer of a problem (default problem.answer)."""

    def __init__(self, tools: list[Callable | str], *, max_turns: int, timeout_s: float, max_chars: int,
                 reply: str = "[{}]", answer: Callable[[Problem], str] = lambda p: p.answer):
        paths = [tool_path(t) for t in tools]
        for p in paths:  # imported here too, so that a bad one is refused before the run starts
            try:
                resolve_tool(p)
            except Exception as e:  # noqa: BLE001
                raise RecipeError(f"task.tools: {p!r} could not be imported ({type(e).__name__}: {e}); name a "
                                  "function 'package.module:function' importable here (fn(arg: str) -> str)") from None
        self.tools = {p.partition(":")[2]: p for p in paths}
        if not self.tools:
            raise RecipeError("an agentic task needs at least one tool (task.tools)")
        self.max_turns, self.reply, self.answer = int(max_turns), reply, answer
        self.worker = ToolWorker(self.tools, timeout_s, max_chars)

    def reset(self, problem: Problem) -> dict:
        return {"tool_calls": 0, "malformed": False, "statuses": []}

    @staticmethod
    def is_final(text: str) -> bool:
        return "(" not in text and ")" not in text

    def env_response(self, problem: Problem, turns: list[str], state: dict) -> str | None:
        text = turns[-1]
        if self.is_final(text):
            return None
        m = CALL.match(text)
        if m is None or m.group(1) not in self.tools:
            state["malformed"] = True
            return None
        out, status = self.worker.call(m.group(1), m.group(2))
        state["tool_calls"] += 1
        state["statuses"].append(status)
        return self.reply.format(out)

    def reward(self, problem: Problem, turns: list[str], state: dict) -> float:
        """1.0 when the last turn is a final answer equal to ``answer(problem)`` (stripped) and no call
        was malformed."""
        last = turns[-1].strip() if turns else ""
        return 1.0 if not state["malformed"] and self.is_final(last) and last == str(self.answer(problem)).strip() else 0.0

    def close(self) -> None:
        self.worker.close()


# ---------------------------------------------------------------- the calc tool and its task

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("calc takes integers and + - * //")


def calc(expression: str) -> str:
    """Integer arithmetic: ``calc("37*58")`` -> ``"2146"`` (+ - * // and brackets)."""
    if len(expression) > 64:
        raise ValueError("expression too long")
    return str(_eval(ast.parse(expression.strip(), mode="eval").body))


EOS_TEXT = "<|endoftext|>"  # the tiny models' EOS token as text (megatron_rz.learner.tiny_models.EOS)


class CalcTask:
    """``a*b=``: multiply two ``task.digits``-digit numbers, a ``calc`` tool at hand.

    The right episode is ``calc(a*b)`` (turn 1), the reply ``[c]``, then ``c`` (turn 2); reward 1.0
    when the final answer is the product (``problem.row["product"]``). A tiny model cannot multiply
    in its head, so it has to call the tool with the right expression and copy the result.
    ``problem.answer`` is that right episode as text (what the warm start demonstrates, the model
    turns ending in EOS); ``distractor`` the mistakes it plants at warm_start.distractor_rate:
    calling the tool with ``a+b`` instead of ``a*b`` (two thirds) or answering directly without the
    tool (one third). RL must learn to call it right. ``task.tools`` adds user tools beside calc."""

    def __init__(self, cfg: TaskConfig):
        self.cfg, self.digits = cfg, int(cfg.digits)
        self._lo, self._hi = 10 ** (self.digits - 1), 10**self.digits - 1
        self.env = ToolEnv([calc, *cfg.tools], max_turns=cfg.max_turns, timeout_s=cfg.tool_timeout_s,
                           max_chars=cfg.tool_output_chars, answer=lambda p: p.row["product"])
        rng = random.Random(cfg.seed)
        self._eval = [self._one(rng) for _ in range(cfg.eval_prompts)]
        self._eval_q = {p.prompt for p in self._eval}

    def _one(self, rng: random.Random) -> Problem:
        a, b = rng.randint(self._lo, self._hi), rng.randint(self._lo, self._hi)
        return Problem(f"{a}*{b}=", self.episode(a, b, None), row={"product": str(a * b)})

    def episode(self, a: int, b: int, mistake: str | None) -> str:
        """The conversation after the prompt as text: ``calc(a*b)<eos>[c]c`` (mistake None),
        ``calc(a+b)<eos>[a+b]a+b`` ("wrong_op") or ``c`` ("direct")."""
        if mistake == "direct":
            return str(a * b)
        expr = f"{a}+{b}" if mistake == "wrong_op" else f"{a}*{b}"
        result = calc(expr)
        return f"calc({expr}){EOS_TEXT}{self.env.reply.format(result)}{result}"

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        out: list[Problem] = []
        while len(out) < n:
            p = self._one(rng)
            if p.prompt not in self._eval_q:
                out.append(p)
        return out

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def all_problems(self):
        """(where, problem): the held-out prompts and 200 training draws (the prompt-length check)."""
        yield from ((f"agentic_calc held-out prompt {i + 1}", p) for i, p in enumerate(self._eval))
        yield from (("agentic_calc training prompt", p) for p in self.sample(random.Random(0), 200))

    def close(self) -> None:
        self.env.close()

    def reward(self, problem: Problem, response: str) -> float:
        """A single response's text (no episode): exact match with the product."""
        return 1.0 if response.strip() == problem.row["product"] else 0.0

    def distractor(self, problem: Problem) -> str:
        a, b = map(int, problem.prompt.rstrip("=").split("*"))
        return self.episode(a, b, "direct" if zlib.crc32(problem.prompt.encode()) % 3 == 0 else "wrong_op")

    def corpus(self, rng: random.Random, n: int) -> list[str]:
        """Tokenizer training text: prompts with right and wrong episodes, tool error replies."""
        out = [p.prompt + (p.answer if i % 2 else self.distractor(p)) for i, p in enumerate(self.sample(rng, n))]
        return out + ["[error: ValueError: calc timed out crashed]"] * 5


# ---------------------------------------------------------------- episodes


@dataclass
class _Episode:
    key: int
    group_key: int
    index: int  # in its group
    prompt: list[int]
    seed: int | None
    state: dict
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    submit_version: int = 0
    done: bool = False


@dataclass
class _Group:
    tag: Any
    group: int
    problem: Problem
    episodes: list[_Episode]
    kw: dict
    submit_version: int
    submit_time: float


class EpisodeGenerator:
    """The generator surface the producer drives (submit / step / version / num_in_flight /
    abort_all / swap_weights), running every submitted prompt's samples as episodes of ``env``.

    ``submit(prompt_ids, n, seed=, tag=, problem=, max_new_tokens=, **sampling)``: n episodes for
    each prompt (one prompt per call when ``problem`` is given, as the producer does); episode j of
    prompt i samples turn t with seed ``seed + i*n + j + t * TURN_SEED_STRIDE``. ``step()`` returns
    the groups whose episodes all ended (vllm_bridge.streaming.FinishedGroup, one Sample per
    episode: response_ids = everything after the prompt, logprobs 0.0 on environment tokens,
    info["model_mask"], the episode's reward in info["episode_reward"], its counters)."""

    def __init__(self, inner, env: Environment, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], max_model_len: int):
        self.inner, self.env, self.encode, self.decode = inner, env, encode, decode
        self.max_model_len = int(max_model_len)
        self._episodes: dict[int, _Episode] = {}
        self._groups: dict[int, _Group] = {}
        self._next = 0

    # the rest of the generator surface is the inner generator's
    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def swaps(self):
        return self.inner.swaps

    @property
    def in_flight_swaps(self) -> bool:
        return getattr(self.inner, "in_flight_swaps", False)

    def swap_weights(self, *args, **kwargs):
        return self.inner.swap_weights(*args, **kwargs)

    def num_in_flight(self) -> int:
        return len(self._groups)

    def submit(self, prompt_ids: list[list[int]], n: int, *, seed: int | None = None, tag=None,
               problem: Problem | None = None, problems: list[Problem] | None = None, **kw) -> None:
        problems = problems or [problem] * len(prompt_ids)
        if any(p is None for p in problems):
            raise ValueError("EpisodeGenerator.submit needs the problem of every prompt (problem= or problems=)")
        now, version = time.perf_counter(), self.inner.version
        for i, (ids, prob) in enumerate(zip(prompt_ids, problems)):
            gk = self._next
            self._next += 1
            eps = []
            for j in range(n):
                ek = self._next
                self._next += 1
                ep = _Episode(ek, gk, j, list(map(int, ids)), None if seed is None else int(seed) + i * n + j,
                              self.env.reset(prob), submit_version=version)
                self._episodes[ek] = ep
                eps.append(ep)
            self._groups[gk] = _Group(tag, i, prob, eps, dict(kw), version, now)
            for ep in eps:
                self._submit_turn(ep)

    def _submit_turn(self, ep: _Episode) -> None:
        kw = dict(self._groups[ep.group_key].kw)
        used = len(ep.prompt) + len(ep.ids)
        budget = min(int(kw.pop("max_new_tokens", 64)), self.max_model_len - used)
        if budget <= 0:
            ep.state["context_full"] = True
            self._end(ep)
            return
        t = len(ep.turns)
        seed = None if ep.seed is None else ep.seed + t * TURN_SEED_STRIDE
        self.inner.submit([ep.prompt + ep.ids], 1, seed=seed, tag=("episode", ep.key), max_new_tokens=budget, **kw)

    def step(self) -> list:
        done = []
        for fg in self.inner.step():
            ep = self._episodes[fg.tag[1]]
            s = fg.samples[0]
            ep.ids += s.response_ids
            ep.logprobs += s.logprobs
            ep.versions += s.versions
            ep.mask += [1] * len(s.response_ids)
            ep.finish_reason = s.finish_reason
            ep.turns.append(self.decode(s.response_ids))
            # the last allowed turn gets no reply (a tool it calls is not run)
            last = len(ep.turns) >= self.env.max_turns
            try:
                reply = None if last else self.env.env_response(self._groups[ep.group_key].problem, ep.turns, ep.state)
            except Exception as e:  # noqa: BLE001 (an environment's bug ends its episode, counted; the run goes on)
                ep.state["env_error"] = f"{type(e).__name__}: {e}"[:300]
                reply = None
            if reply is None:
                self._end(ep)
            elif len(ep.prompt) + len(ep.ids) + len(self.encode(reply)) >= self.max_model_len:
                ep.state["context_full"] = True  # no room for the reply and a next turn
                self._end(ep)
            else:
                reply_ids = self.encode(reply)
                last_version = ep.versions[-1] if ep.versions else self.inner.version
                ep.ids += reply_ids
                ep.logprobs += [0.0] * len(reply_ids)
                ep.versions += [last_version] * len(reply_ids)
                ep.mask += [0] * len(reply_ids)
                ep.state.setdefault("replies", []).append(reply)
                self._submit_turn(ep)
        for gk in [gk for gk, g in self._groups.items() if all(e.done for e in g.episodes)]:
            done.append(self._finish(self._groups.pop(gk)))
        return done

    def _end(self, ep: _Episode) -> None:
        ep.done = True
        del self._episodes[ep.key]

    def _finish(self, g: _Group):
        from vllm_bridge.samples import Sample
        from vllm_bridge.streaming import FinishedGroup

        kw = g.kw
        samples = []
        for ep in g.episodes:
            try:
                value = float(self.env.reward(g.problem, ep.turns, ep.state))
                status = None if math.isfinite(value) else "error"
            except Exception:  # noqa: BLE001 (an environment's reward bug scores 0, counted)
                value, status = 0.0, "error"
            st = ep.state.get("statuses", [])
            info = {
                "model_mask": list(ep.mask), "episode_reward": value if status is None else 0.0,
                "episode_version": ep.submit_version, "turns": len(ep.turns),
                "tool_calls": ep.state.get("tool_calls", 0), "tool_errors": st.count("error"),
                "tool_timeouts": st.count("timeout"), "tool_truncated": st.count("truncated"),
                "malformed_calls": int(bool(ep.state.get("malformed"))),
                "context_full": int(bool(ep.state.get("context_full"))),
                "env_errors": int("env_error" in ep.state),
                "env_tokens": len(ep.mask) - sum(ep.mask), "model_tokens": sum(ep.mask),
                "transcript": list(ep.turns),
            }
            if status:
                info["reward_status"] = status
            samples.append(Sample(
                prompt_ids=list(ep.prompt), response_ids=list(ep.ids), logprobs=list(ep.logprobs),
                versions=list(ep.versions), finish_reason=ep.finish_reason, group=g.group, index_in_group=ep.index,
                temperature=float(kw.get("temperature", 1.0)), top_p=float(kw.get("top_p", 1.0)),
                top_k=int(kw.get("top_k", -1)), info=info))
        return FinishedGroup(g.tag, g.group, samples, g.submit_version, g.submit_time)

    def drain(self) -> list:
        out = []
        while self._groups:
            out += self.step()
        return out

    def abort_all(self) -> None:
        self.inner.abort_all()
        self._episodes.clear()
        self._groups.clear()


def episode_counts(samples) -> dict:
    """Sums of the episodes' counters over a batch (metrics), plus means per episode."""
    eps = [s for s in samples if "model_mask" in s.info]
    if not eps:
        return {}
    out = {f"agentic/{k}": sum(int(s.info.get(k, 0)) for s in eps) for k in COUNTERS}
    out["agentic/episodes"] = len(eps)
    out["agentic/turns_mean"] = out["agentic/turns"] / len(eps)
    out["agentic/tool_call_rate"] = sum(s.info.get("tool_calls", 0) > 0 for s in eps) / len(eps)
    return out


def make_generator(inner, side, recipe):
    """The producer's generator for the task of ``side``: ``inner`` itself (single turn), or
    episodes of the task's environment over it."""
    env = environment_of(side.task)
    if env is None:
        return inner
    return EpisodeGenerator(inner, env, lambda text: side.tok.encode(text, add_special_tokens=False), side.decode,
                            recipe.model.max_position_embeddings)
