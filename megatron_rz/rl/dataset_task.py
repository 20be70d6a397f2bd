"""A task read from local files through Hugging Face `datasets` (``task.name: dataset``).

Recipe keys (megatron_rz.recipe.TaskConfig): ``path`` (the training file: .jsonl, .json, .parquet,
.csv, .arrow), ``prompt_key`` / ``answer_key`` (its columns), ``eval_sets`` (named held-out files;
none: ``eval_prompts`` rows of ``path`` held out after a shuffle seeded by ``task.seed``),
``prompt_template`` (the user message, a format string over the row's columns), ``system_prompt``,
``chat_template`` ("auto": the tokenizer's, through ``apply_chat_template``), ``epochs`` and
``reward`` (megatron_rz.rl.rewards: math_verify by default, exact, or ``package.module:fn``).

Training prompts walk the rows in epoch order: epoch e is a permutation seeded by (task.seed, e),
step s takes the next rollout.prompts_per_step of them (``sample_step``), so a resumed or
restarted step sees the same prompts. ``sample`` (the warm start, rz check, refills of dynamic
sampling) draws rows at random.

Every problem with the files is a RecipeError naming the key, before anything starts: a missing
file, an unknown type, a malformed jsonl line (its number), a missing column (the columns found), an
empty file, an empty answer.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from megatron_rz.recipe import RecipeError, TaskConfig
from megatron_rz.rl import rewards
from megatron_rz.rl.problem import Problem

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _check_jsonl(path: Path, key: str) -> int:
    """The number of records of a jsonl file; a RecipeError naming the first malformed line."""
    n = 0
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                why = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                raise RecipeError(f"{key}={str(path)!r}: line {i} is not valid JSON ({why}); fix or delete that "
                                  "line (a .jsonl file holds one JSON object per line)") from None
            if not isinstance(obj, dict):
                raise RecipeError(f"{key}={str(path)!r}: line {i} is a JSON {type(obj).__name__}, not an object "
                                  "({\"column\": value, ...}); one object per line")
            n += 1
    return n


def load_rows(path: str, key: str) -> list[dict]:
    """The rows of one local file, read by `datasets` (its json / parquet / csv / arrow builders)."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else f"no such file ({p.resolve()})"
        raise RecipeError(f"{key}={path!r}: {what}; point it at a .jsonl / .json / .parquet / .csv / .arrow file")
    builder = LOADERS.get(p.suffix.lower())
    if builder is None:
        raise RecipeError(f"{key}={path!r}: unknown file type {p.suffix!r}; use one of {', '.join(LOADERS)}")
    if p.suffix.lower() == ".jsonl" and _check_jsonl(p, key) == 0:
        raise RecipeError(f"{key}={path!r} is empty (no rows); give a file with one JSON object per line")
    if p.stat().st_size == 0:
        raise RecipeError(f"{key}={path!r} is empty (0 bytes)")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="rz-datasets-") as cache:  # nothing kept outside memory
        try:
            ds = datasets.load_dataset(builder, data_files=str(p), split="train", cache_dir=cache,
                                       keep_in_memory=True)
        except Exception as e:  # noqa: BLE001 (datasets / pyarrow raise many types for a bad file)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise RecipeError(f"{key}={path!r} cannot be read as {builder} by datasets ({type(e).__name__}: "
                              f"{first}); check the file") from None
        rows = ds.to_list()
    if not rows:
        raise RecipeError(f"{key}={path!r} is empty (0 rows)")
    return rows


def chat_template_text(value: str) -> str | None:
    """task.chat_template: None for "auto" / "none", else the Jinja text (inline, or read from a file)."""
    if value in ("auto", "none"):
        return None
    if "{{" in value or "{%" in value:
        return value
    p = Path(value).expanduser()
    if not p.is_file():
        raise RecipeError(f"task.chat_template={value!r}: neither a Jinja template nor a template file; give one "
                          "(inline or a .jinja file), \"auto\" (the tokenizer's own) or \"none\" (plain text)")
    return p.read_text()


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}] + messages
    return messages


def render(problem: Problem, tok, mode: str, template: str | None) -> str:
    """The prompt text of ``problem`` for tokenizer ``tok``: the chat template's rendering with the
    generation prompt (``template``, else the tokenizer's own) unless task.chat_template is "none"
    or there is no template at all (then the plain prompt)."""
    if mode == "none" or (template is None and not getattr(tok, "chat_template", None)):
        return problem.prompt
    return tok.apply_chat_template(list(problem.messages), tokenize=False, add_generation_prompt=True,
                                   chat_template=template)


def corpus_text(problems: list[Problem], template: str | None) -> list[str]:
    """Warm-start / tokenizer text of ``problems``: prompt + answer, the prompt as the recipe's chat
    template renders it where there is one (so a tokenizer trained on it has every character the
    rollout's prompts hold: BPE without byte fallback drops unseen characters)."""
    if template is None:
        return [p.prompt + p.answer for p in problems]
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([list(p.messages) for p in problems], chat_template=template,
                                        add_generation_prompt=True)
    return [text + p.answer for text, p in zip(rendered, problems)]


class DatasetTask(rewards.GuardedReward):
    """Prompts and reference answers from local files; see the module docstring."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.template = chat_template_text(cfg.chat_template)
        rows = load_rows(cfg.path, "task.path")
        self._columns(rows, "task.path", cfg.path)
        order = list(range(len(rows)))
        random.Random(cfg.seed).shuffle(order)
        if cfg.eval_sets:
            train_idx = order
            self._eval, self._rows = {}, {}
            for name, path in cfg.eval_sets.items():
                key = f"task.eval_sets.{name}"
                erows = load_rows(path, key)
                self._columns(erows, key, path)
                self._eval[name] = [self._problem(r, i, key, path) for i, r in enumerate(erows)]
                self._rows[name] = (key, path, list(range(len(erows))))
        else:
            n_eval = cfg.eval_prompts
            if n_eval >= len(rows):
                raise RecipeError(
                    f"task.eval_prompts={n_eval} would hold out every row of task.path={cfg.path!r} ({len(rows)} "
                    f"rows), leaving none to train on: lower task.eval_prompts (e.g. {max(1, len(rows) // 10)}) or "
                    "name held-out files in task.eval_sets")
            train_idx = order[n_eval:]
            self._eval = {"heldout": [self._problem(rows[i], i, "task.path", cfg.path) for i in order[:n_eval]]}
            self._rows = {"heldout": ("task.path", cfg.path, order[:n_eval])}
        self._train = [self._problem(rows[i], i, "task.path", cfg.path) for i in train_idx]
        self._rows["train"] = ("task.path", cfg.path, train_idx)
        seen = {p.prompt for p in self._train}
        for name, probs in self._eval.items():  # held-out files that overlap the training file
            same = sum(p.prompt in seen for p in probs)
            if same and cfg.eval_sets:
                print(f"[rz] task.eval_sets.{name}: {same} of its {len(probs)} prompts are also in task.path "
                      "(trained on)", flush=True)
        self.reward_path = rewards.function_path(cfg.reward or "math_verify")
        if self.reward_path not in rewards.FUNCTIONS.values():
            rewards.resolve(self.reward_path)  # a user function that cannot be imported: refused now

    # ---------------------------------------------------------------- reading the files

    def _columns(self, rows: list[dict], key: str, path: str) -> None:
        have = list(rows[0])
        for field in ("prompt_key", "answer_key"):
            col = getattr(self.cfg, field)
            if col not in have:
                raise RecipeError(f"task.{field}={col!r}: {key}={path!r} has no column {col!r}; its columns: "
                                  f"{', '.join(have)}")

    def _problem(self, row: dict, i: int, key: str, path: str) -> Problem:
        cfg = self.cfg
        where = f"{key}={path!r} row {i + 1}"
        prompt, answer = row.get(cfg.prompt_key), row.get(cfg.answer_key)
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise RecipeError(f"{where}: column {cfg.answer_key!r} is empty; give every row a reference answer "
                              "or drop the row")
        if isinstance(prompt, list):  # already chat messages: [{"role": ..., "content": ...}, ...]
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
                raise RecipeError(f"{where}: column {cfg.prompt_key!r} is a list but not of chat messages "
                                  "({\"role\": ..., \"content\": ...})")
            messages = list(prompt)
        elif isinstance(prompt, str) and prompt.strip():
            try:
                user = cfg.prompt_template.format(**{**row, "prompt": prompt})
            except (KeyError, IndexError, ValueError) as e:
                raise RecipeError(f"task.prompt_template={cfg.prompt_template!r} does not format {where} "
                                  f"({type(e).__name__}: {e}); name columns as {{column}} (columns: "
                                  f"{', '.join(row)}) and double literal braces ({{{{ }}}})") from None
            messages = [{"role": "user", "content": user}]
        else:
            raise RecipeError(f"{where}: column {cfg.prompt_key!r} is {prompt!r}, not a prompt (a non-empty string "
                              "or a list of chat messages)")
        messages = with_system(messages, cfg.system_prompt)
        plain = "\n\n".join(str(m["content"]) for m in messages)
        return Problem(plain, str(answer).strip(), tuple(messages), row)

    # ---------------------------------------------------------------- the Task interface

    @property
    def num_train(self) -> int:
        return len(self._train)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [rng.choice(self._train) for _ in range(n)]

    def sample_step(self, step: int, n: int) -> list[Problem]:
        """Prompts step*n .. step*n + n - 1 of the epoch-ordered stream (epoch e: the training rows in
        an order seeded by (task.seed, e))."""
        N, out = len(self._train), []
        for j in range(step * n, step * n + n):
            epoch, pos = divmod(j, N)
            out.append(self._train[self._order(epoch)[pos]])
        return out

    def _order(self, epoch: int) -> list[int]:
        cache = self.__dict__.setdefault("_orders", {})
        if epoch not in cache:
            order = list(range(len(self._train)))
            random.Random(self.cfg.seed * 1000003 + epoch).shuffle(order)
            cache.clear()  # one epoch at a time is all a run asks for
            cache[epoch] = order
        return cache[epoch]

    def eval_set(self) -> list[Problem]:
        return list(next(iter(self._eval.values())))

    def eval_sets(self) -> dict[str, list[Problem]]:
        return {k: list(v) for k, v in self._eval.items()}

    def all_problems(self):
        """(where, problem) of every training and held-out problem, where = "KEY='FILE' row N" (the
        prompt-length check)."""
        for name, probs in [("train", self._train), *self._eval.items()]:
            key, path, idx = self._rows[name]
            yield from ((f"{key}={path!r} row {i + 1}", p) for i, p in zip(idx, probs))

    def render(self, problem: Problem, tok) -> str:
        """The prompt text: the chat template's rendering (generation prompt added) where one applies."""
        return render(problem, tok, self.cfg.chat_template, self.template)

    def corpus(self, rng: random.Random, n: int) -> list[str]:
        """Warm-start / tokenizer text: prompt + answer of random training rows (corpus_text)."""
        return corpus_text(self.sample(rng, n), self.template)
