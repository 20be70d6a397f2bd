"""Verifiable tasks: prompts plus a reward function.

A task is any object with `sample(rng, n)`, `eval_set()` and `reward(problem, response_text)`.
Built in: `arithmetic` (multi-digit arithmetic, exact-match reward; answers of a few tokens) and
`chain_sum` (the sum of many numbers written out step by step: answers of 100+ tokens, reward on
the final total). A user task plugs in through
the recipe as `task.name: "my_pkg.my_module:make_task"`; the factory receives the TaskConfig.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from typing import Protocol

from megatron_rz.recipe import RecipeError, TaskConfig


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


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


BUILTIN = ("arithmetic", "chain_sum")


def make_task(cfg: TaskConfig) -> Task:
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
