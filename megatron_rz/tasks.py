"""Verifiable tasks: prompts plus a reward function.

A task is any object with `sample(rng, n)`, `eval_set()` and `reward(problem, response_text)`.
The built-in one is multi-digit arithmetic with exact-match reward. A user task plugs in through
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


def make_task(cfg: TaskConfig) -> Task:
    if cfg.name == "arithmetic":
        return Arithmetic(cfg.digits, cfg.ops, cfg.eval_prompts, cfg.seed, **cfg.kwargs)
    if ":" not in cfg.name:
        raise RecipeError(
            f"task.name={cfg.name!r} is neither a built-in task ('arithmetic') nor an import path "
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
        raise RecipeError(f"task {cfg.name!r} lacks method(s) {missing}; see megatron_rz.tasks.Task")
    return task
