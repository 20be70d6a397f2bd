"""Verifiable tasks: prompts plus a reward function.

A task is any object with `sample(rng, n)`, `eval_set()` and `reward(problem, response_text)`.
Built in: `arithmetic` (multi-digit arithmetic, exact-match reward; answers of a few tokens) and
`chain_sum` (the sum of many numbers written out step by step: answers of 100+ tokens, reward on
the final total), the toy tasks of the tiny models; `dataset` (local files through `datasets`,
chat templates, math-verify / exact / user rewards: megatron_rz.rl.dataset_task) and
`reasoning_gym` (its generators and scorers: megatron_rz.rl.gym_task), `agentic_calc` (multi-turn:
multiply with a calc tool; megatron_rz.rl.agentic, where an agentic task's ``env`` is described). A user task plugs in through
the recipe as `task.name: "my_pkg.my_module:make_task"`; the factory receives the TaskConfig.

Optional task methods the loop uses where present: ``score(problem, response) -> (reward, status)``
(status None, "error" or "timeout": a guarded reward), ``render(problem, tokenizer) -> str`` (the
prompt text, e.g. through the chat template), ``sample_step(step, n)`` (the prompts of one training
step in epoch order), ``eval_sets() -> {name: problems}`` (several named held-out sets).
"""

from __future__ import annotations

import importlib
import random
import math
from typing import Protocol

from megatron_rz.recipe import RecipeError, TaskConfig
from megatron_rz.rl.problem import Problem  # noqa: F401 (the tasks' type, imported from here by users)




class Task(Protocol):
    def sample(self, rng: random.Random, n: int) -> list[Problem]: ...

    def eval_set(self) -> list[Problem]: ...

    def reward(self, problem: Problem, response: str) -> float: ...

    def corpus(self, rng: random.Random, n: int) -> list[str]: ...

    # Optional: a plausible wrong answer (a common mistake) for the warm start's distractor share.
    # def distractor(self, problem: Problem) -> str | None: ...


class Arithmetic:
    """`a+b=` -> `c`, operands with up to `digits` digits; reward 1.0 on an exact answer.

    ``few_shot=k`` (task.kwargs) puts k solved examples before each question, `a+b=c;` each
    (~9 tokens for 2 digits): long prompts, e.g. to reach past a sliding attention window.
    """

    SEP = ";"

    def __init__(
        self, digits: int = 2, ops: list[str] = ("+",), eval_prompts: int = 200, seed: int = 1234, few_shot: int = 0
    ):
        self.digits, self.ops, self.few_shot = digits, list(ops), int(few_shot)
        self._eval = self._draw(random.Random(seed), eval_prompts)
        self._eval_questions = {self.question(p) for p in self._eval}

    def _qa(self, rng: random.Random) -> tuple[str, str]:
        hi = 10**self.digits - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
        c = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a}{op}{b}=", str(c)

    def _one(self, rng: random.Random) -> Problem:
        q, c = self._qa(rng)
        shots = "".join(p + a + self.SEP for p, a in (self._qa(rng) for _ in range(self.few_shot)))
        return Problem(shots + q, c)

    def question(self, problem: Problem) -> str:
        """The question itself (`a+b=`), without the few-shot examples."""
        return problem.prompt.rsplit(self.SEP, 1)[-1]

    def _draw(self, rng: random.Random, n: int) -> list[Problem]:
        return [self._one(rng) for _ in range(n)]

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        # Training prompts never include held-out evaluation prompts.
        out: list[Problem] = []
        while len(out) < n:
            p = self._one(rng)
            if self.question(p) not in self._eval_questions:
                out.append(p)
        return out

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if response.strip() == problem.answer else 0.0

    def corpus(self, rng: random.Random, n: int) -> list[str]:
        return [p.prompt + p.answer for p in self.sample(rng, n)]

    def distractor(self, problem: Problem) -> str | None:
        """The answer someone who forgets to carry would give ("58+67=" -> "15"): column-wise
        digit sums mod 10. None when that equals the true answer (no carry) or op is not '+'."""
        question = self.question(problem)
        if "+" not in question:
            return None
        a, b = question.rstrip("=").split("+")
        width = max(len(a), len(b))
        a, b = a.zfill(width), b.zfill(width)
        wrong = "".join(str((int(x) + int(y)) % 10) for x, y in zip(a, b)).lstrip("0") or "0"
        return None if wrong == problem.answer else wrong


class ChainSum:
    """`a1+a2+...+an=` -> the running sum worked out step by step, `a1+a2=s2;s2+a3=s3;...`.

    ``terms`` numbers of up to ``digits`` digits (task.kwargs ``terms``, default 12); one token per
    character (the tokenizer splits digits and punctuation), so 12 two-digit terms give answers of
    ~130 tokens: long responses whose logprobs are summed over many decode steps. Reward 1.0 when
    the last step's total is the true sum (the verifier reads only the final number, as a math
    grader does); a response that does not end in `=<digits>` gets 0. ``distractor``: every step
    added without carrying, the mistake the warm start plants for RL to overturn.
    """

    SEP = ";"

    def __init__(self, digits: int = 2, eval_prompts: int = 200, seed: int = 1234, terms: int = 12):
        if int(terms) < 2:
            raise RecipeError(f"task.kwargs.terms={terms} must be >= 2 for chain_sum")
        self.digits, self.terms = digits, int(terms)
        self._eval = [self._one(random.Random(seed * 7919 + i)) for i in range(eval_prompts)]
        self._eval_prompts = {p.prompt for p in self._eval}

    def _numbers(self, rng: random.Random) -> list[int]:
        return [rng.randint(1, 10**self.digits - 1) for _ in range(self.terms)]

    @staticmethod
    def worked(nums: list[int], add=lambda x, y: x + y) -> str:
        steps, s = [], nums[0]
        for a in nums[1:]:
            t = add(s, a)
            steps.append(f"{s}+{a}={t}")
            s = t
        return ChainSum.SEP.join(steps)

    def _one(self, rng: random.Random) -> Problem:
        nums = self._numbers(rng)
        return Problem("+".join(map(str, nums)) + "=", self.worked(nums))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        out: list[Problem] = []
        while len(out) < n:
            p = self._one(rng)
            if p.prompt not in self._eval_prompts:
                out.append(p)
        return out

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    @staticmethod
    def final_total(text: str) -> str | None:
        head, eq, tail = text.strip().rpartition("=")
        return tail if eq and tail.isdigit() else None

    def reward(self, problem: Problem, response: str) -> float:
        got = self.final_total(response)
        return 1.0 if got is not None and got == self.final_total(problem.answer) else 0.0

    def corpus(self, rng: random.Random, n: int) -> list[str]:
        return [p.prompt + p.answer for p in self.sample(rng, n)]

    def distractor(self, problem: Problem) -> str | None:
        def no_carry(x: int, y: int) -> int:
            a, b = str(x), str(y).zfill(len(str(x)))
            a = a.zfill(len(b))
            return int("".join(str((int(u) + int(v)) % 10) for u, v in zip(a, b)))

        nums = [int(v) for v in problem.prompt.rstrip("=").split("+")]
        wrong = self.worked(nums, no_carry)
        return None if self.final_total(wrong) == self.final_total(problem.answer) else wrong


BUILTIN = ("arithmetic", "chain_sum", "dataset", "reasoning_gym", "agentic_calc")


def make_task(cfg: TaskConfig) -> Task:
    if cfg.name == "dataset":
        from megatron_rz.rl.dataset_task import DatasetTask

        return DatasetTask(cfg)
    if cfg.name == "reasoning_gym":
        from megatron_rz.rl.gym_task import GymTask

        return GymTask(cfg)
    if cfg.name == "agentic_calc":
        from megatron_rz.rl.agentic import CalcTask

        return CalcTask(cfg)
    if cfg.name == "arithmetic":
        return Arithmetic(cfg.digits, cfg.ops, cfg.eval_prompts, cfg.seed, **cfg.kwargs)
    if cfg.name == "chain_sum":
        if cfg.ops != ["+"]:
            raise RecipeError(f"task.ops={cfg.ops} is not supported by chain_sum (sums only): drop task.ops")
        try:
            return ChainSum(cfg.digits, cfg.eval_prompts, cfg.seed, **cfg.kwargs)
        except TypeError as e:
            raise RecipeError(f"task.kwargs for chain_sum: {e} (it takes terms)") from None
    if ":" not in cfg.name:
        raise RecipeError(
            f"task.name={cfg.name!r} is neither a built-in task {BUILTIN} nor an import path "
            "'package.module:factory'"
        )
    mod_name, _, attr = cfg.name.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise RecipeError(f"task.name={cfg.name!r} could not be imported: {e}") from None
    task = factory(cfg)
    missing = [m for m in ("sample", "eval_set", "reward", "corpus") if not hasattr(task, m)]
    if missing:
        raise RecipeError(f"task {cfg.name!r} lacks method(s) {missing}; see megatron_rz.rl.tasks.Task")
    return task


_PRINTED = [0]


def score(task: Task, problem: Problem, response: str) -> tuple[float, str | None]:
    """(reward, status) of one response: the task's guarded ``score`` where it has one; else its
    ``reward``, where an exception or a value that is not a finite number scores 0 with status
    "error" (a user task's bug is counted, it does not stop the run)."""
    fn = getattr(task, "score", None)
    if fn is not None:
        return fn(problem, response)
    try:
        value = float(task.reward(problem, response))
    except Exception as e:  # noqa: BLE001
        _PRINTED[0] += 1
        if _PRINTED[0] <= 3:  # the first few; the rest are counted only
            print(f"[rz] reward error, scored 0: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 0.0, "error"
    return (value, None) if math.isfinite(value) else (0.0, "error")


def prompt_text(task: Task, tok, problem: Problem) -> str:
    """The text a prompt is tokenized from: ``task.render`` (e.g. the tokenizer's chat template) or
    the problem's plain prompt."""
    render = getattr(task, "render", None)
    return render(problem, tok) if render is not None else problem.prompt


def step_problems(task: Task, rng: random.Random, step: int, n: int) -> list[Problem]:
    """The prompts of training step ``step``: ``task.sample_step`` (epoch order) or ``task.sample``."""
    fn = getattr(task, "sample_step", None)
    return fn(step, n) if fn is not None else task.sample(rng, n)


def eval_sets(task: Task) -> dict[str, list[Problem]]:
    """The task's named held-out sets (one, "heldout", for tasks with a single eval_set)."""
    fn = getattr(task, "eval_sets", None)
    return fn() if fn is not None else {"heldout": task.eval_set()}


def describe_task(cfg: TaskConfig) -> str:
    """One line naming the task, its data and its reward (rz submit's job header)."""
    if cfg.name == "dataset":
        sets = f"; eval sets {', '.join(cfg.eval_sets)}" if cfg.eval_sets else f"; {cfg.eval_prompts} rows held out"
        return f"dataset {cfg.path} (reward {cfg.reward or 'math_verify'}{sets}; eval_samples {cfg.eval_samples})"
    if cfg.name == "reasoning_gym":
        return f"reasoning_gym {cfg.kwargs.get('dataset')} (reward {cfg.reward or 'its scorer'})"
    if cfg.name == "agentic_calc":
        return f"agentic_calc (multi-turn, calc tool, up to {cfg.max_turns} turns)"
    return f"{cfg.name} (built-in toy task)" if cfg.name in ("arithmetic", "chain_sum") else cfg.name
