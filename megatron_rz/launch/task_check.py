"""The recipe's task, checked before anything starts (rz train): its files read, its prompts measured.

``check_task(recipe)`` builds the data tasks (``dataset``, ``reasoning_gym``; the toy tasks need
nothing), so a missing file or column, a malformed jsonl line, an empty dataset, an unknown
reasoning-gym dataset or a user reward that cannot be imported is one RecipeError (rz: one line,
exit 2) before the run directory is claimed. Then every prompt is tokenized as the rollout will
(the chat template included) with the run's tokenizer (model.pretrained's; for a tiny model the one
its warm start will train, made in a temporary directory), and a prompt that leaves no room for
rollout.max_new_tokens within model.max_position_embeddings is refused naming its row.
``task.epochs`` becomes schedule.steps here; the overrides returned carry it to other processes.
"""

from __future__ import annotations

import math
import tempfile

from megatron_rz.recipe import Recipe, RecipeError
from megatron_rz.rl.tasks import make_task, prompt_text

DATA_TASKS = ("dataset", "reasoning_gym", "agentic_calc")  # (agentic_calc: its task.tools imported)


def _tokenizer(recipe: Recipe, task, tmp: str):
    if recipe.model.pretrained:
        from transformers import AutoTokenizer

        from megatron_rz.learner.pretrained import check_pretrained

        return AutoTokenizer.from_pretrained(check_pretrained(recipe))  # a wrong directory: its own message
    from megatron_rz.learner.tiny_models import train_tokenizer

    try:
        return train_tokenizer(task, recipe.warm_start.tokenizer_vocab, tmp, recipe.schedule.seed)
    except ValueError as e:  # more distinct tokens in the task's text than the vocabulary holds
        raise RecipeError(f"warm_start.tokenizer_vocab={recipe.warm_start.tokenizer_vocab} is too small for the "
                          f"task's text ({e}); raise warm_start.tokenizer_vocab and model.vocab_size") from None


def check_prompt_lengths(recipe: Recipe, task, tok) -> int:
    """The longest prompt in tokens; RecipeError for one with no room for rollout.max_new_tokens."""
    L, new = recipe.model.max_position_embeddings, recipe.rollout.max_new_tokens
    longest = 0
    for where, p in task.all_problems():
        n = len(tok.encode(prompt_text(task, tok, p), add_special_tokens=False))
        longest = max(longest, n)
        if n + new > L:
            raise RecipeError(
                f"{where}: the prompt is {n} tokens as the rollout writes it (chat template included): with "
                f"rollout.max_new_tokens={new} that exceeds model.max_position_embeddings={L}; shorten or drop "
                f"that prompt ({p.prompt[:60]!r}...), lower rollout.max_new_tokens or raise "
                "model.max_position_embeddings")
    return longest


def check_task(recipe: Recipe, measure: bool = True) -> list[str]:
    """Build and check the data task; set schedule.steps from task.epochs. Returns the overrides
    that carry the derived settings to the learner ranks (empty when nothing was derived).
    ``measure``: also tokenize every prompt (the process that reports errors; other ranks skip it)."""
    if recipe.task.name not in DATA_TASKS:
        return []
    task = make_task(recipe.task)
    try:
        if measure:
            with tempfile.TemporaryDirectory(prefix="rz-task-check-") as tmp:
                check_prompt_lengths(recipe, task, _tokenizer(recipe, task, tmp))
        epochs = recipe.task.epochs
        if epochs is None:
            return []
        n = getattr(task, "num_train", None)
        if n is None:
            raise RecipeError(f"task.epochs={epochs:g}: task.name={recipe.task.name} has no fixed number of training "
                              "prompts; set schedule.steps instead")
        steps = max(1, math.ceil(epochs * n / recipe.rollout.prompts_per_step))
        print(f"[rz] task.epochs={epochs:g} over {n} training prompts at rollout.prompts_per_step="
              f"{recipe.rollout.prompts_per_step}: schedule.steps={steps}", flush=True)
        recipe.task.epochs = None
        recipe.schedule.steps = steps
        return ["task.epochs=null", f"schedule.steps={steps}"]
    finally:
        close = getattr(task, "close", None)
        if close is not None:
            close()
