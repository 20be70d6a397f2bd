"""reasoning-gym generators as a task family (``task.name: reasoning_gym``).

``task.kwargs: {dataset: NAME, ...}``: NAME is any dataset reasoning-gym registers (basic_arithmetic,
chain_sum, leg_counting, gsm_symbolic, ...); the other kwargs are that dataset's config fields
(e.g. min_terms, max_digits). Training prompts come from ``reasoning_gym.create_dataset(NAME,
seed=task.seed, ...)`` (entries generated on demand), the held-out set from the same generator under
another seed (``task.eval_prompts`` entries; training never draws a held-out question). The reward
is the dataset's own ``score_answer`` on the response's ``<answer>...</answer>`` content (the whole
stripped response when there is no such tag: a tiny model answers directly), run in the guarded
reward worker (megatron_rz.rl.rewards); ``task.reward`` may name another. The warm start of a tiny
model trains on the generator's question / answer pairs (``corpus``, ``sample``).
Prompts: ``task.prompt_template`` over {prompt} (the entry's question), ``task.system_prompt`` and
the chat template, as the dataset task.
"""

from __future__ import annotations

import dataclasses
import random
from functools import lru_cache

from megatron_rz.recipe import RecipeError, TaskConfig
from megatron_rz.rl import rewards
from megatron_rz.rl.dataset_task import chat_template_text, corpus_text, render, with_system
from megatron_rz.rl.problem import Problem

TRAIN_SIZE = 10**9  # entries are generated from (seed, index) on demand: the stream is this long
EVAL_SEED_OFFSET = 1_000_003
SCORE_PATH = "megatron_rz.rl.gym_task:score_entry"


def available() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def create(name: str, seed: int, size: int, kwargs: dict):
    """reasoning_gym.create_dataset with one-line RecipeErrors naming task.kwargs."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise RecipeError(f"task.kwargs.dataset={name!r} is not a reasoning-gym dataset; available: "
                          f"{', '.join(sorted(DATASETS))}")
    fields = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("seed", "size")]
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        raise RecipeError(f"task.kwargs for reasoning-gym dataset {name!r}: {type(e).__name__}: {e}; its options: "
                          f"{', '.join(fields)}") from None


@lru_cache(maxsize=64)
def _scorer(name: str, kwargs_items: tuple):
    return create(name, 0, 1, dict(kwargs_items)).score_answer


def score_entry(response: str, answer: str, row: dict) -> float:
    """The reasoning-gym dataset's own score of a response (in the reward worker)."""
    from reasoning_gym.utils import extract_answer

    entry = row["entry"]
    given = extract_answer(response)
    return _scorer(row["dataset"], tuple(sorted(row["kwargs"].items())))(
        given if given is not None else response.strip(), entry)


class GymTask(rewards.GuardedReward):
    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        kwargs = dict(cfg.kwargs)
        self.name = kwargs.pop("dataset")
        self.kwargs = kwargs
        self.template = chat_template_text(cfg.chat_template)
        self._train = create(self.name, cfg.seed, TRAIN_SIZE, kwargs)
        held = create(self.name, cfg.seed + EVAL_SEED_OFFSET, cfg.eval_prompts, kwargs)
        self._eval = [self._problem(held[i]) for i in range(cfg.eval_prompts)]
        self._eval_q = {p.row["entry"]["question"] for p in self._eval}
        self.reward_path = rewards.function_path(cfg.reward) if cfg.reward else SCORE_PATH
        if cfg.reward and self.reward_path not in rewards.FUNCTIONS.values():
            rewards.resolve(self.reward_path)
        try:
            self._problem(self._train[0])
        except (KeyError, IndexError, ValueError) as e:
            raise RecipeError(f"task.prompt_template={cfg.prompt_template!r}: {type(e).__name__}: {e}; reasoning_gym "
                              "prompts know {prompt} (the question) only") from None

    def _problem(self, entry: dict) -> Problem:
        user = self.cfg.prompt_template.format(prompt=entry["question"])
        messages = with_system([{"role": "user", "content": user}], self.cfg.system_prompt)
        plain = "\n\n".join(m["content"] for m in messages)
        row = {"entry": entry, "dataset": self.name, "kwargs": self.kwargs}
        return Problem(plain, str(entry["answer"]), tuple(messages), row)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        out: list[Problem] = []
        while len(out) < n:
            entry = self._train[rng.randrange(TRAIN_SIZE)]
            if entry["question"] not in self._eval_q:
                out.append(self._problem(entry))
        return out

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def render(self, problem: Problem, tok) -> str:
        return render(problem, tok, self.cfg.chat_template, self.template)

    def all_problems(self):
        """(where, problem): the held-out entries and 500 training draws (the prompt-length check)."""
        yield from ((f"task.kwargs.dataset={self.name!r} held-out entry {i + 1}", p) for i, p in enumerate(self._eval))
        yield from ((f"task.kwargs.dataset={self.name!r} training entry", p) for p in self.sample(random.Random(0), 500))

    def corpus(self, rng: random.Random, n: int) -> list[str]:
        return corpus_text(self.sample(rng, n), self.template)

    def distractor(self, problem: Problem) -> str | None:
        """A common mistake's answer for the warm start's ``warm_start.distractor_rate`` share, where
        the dataset has one (``DISTRACTORS``); None where it has none or it equals the right answer."""
        fn = DISTRACTORS.get(self.name)
        wrong = fn(problem.row["entry"]) if fn else None
        return None if wrong is None or wrong == problem.answer else wrong


def _columns(a: int, b: int, op) -> int:
    w = max(len(str(a)), len(str(b)))
    return int("".join(str(op(int(x), int(y))) for x, y in zip(str(a).zfill(w), str(b).zfill(w))))


def chain_sum_distractor(entry: dict) -> str | None:
    """Two-term chain_sum done column by column with neither carry nor borrow: 47 + 38 -> 75 (each
    column's sum mod 10), 52 - 17 -> 45 (each column's smaller digit from its larger), 17 - 52 ->
    -45. None for other expressions (more terms)."""
    parts = entry.get("metadata", {}).get("expression", "").split()
    if len(parts) != 3 or parts[1] not in "+-" or not (parts[0].isdigit() and parts[2].isdigit()):
        return None
    a, op, b = int(parts[0]), parts[1], int(parts[2])
    if op == "+":
        return str(_columns(a, b, lambda x, y: (x + y) % 10))
    big, small = max(a, b), min(a, b)
    wrong = _columns(big, small, lambda x, y: abs(x - y))
    return str(wrong if a >= b else -wrong)


DISTRACTORS = {"chain_sum": chain_sum_distractor}
