"""Bad task inputs through the CLI (in-process `main`, as tests/unit/test_bad_inputs.py): each one is
ONE line on stderr naming the key and the fix, exit code 2, before anything starts, and nothing
written in the working directory (the run directory is never created)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refusal import assert_refused

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_moe.yaml")
DATA = ["task.name=dataset", "task.prompt_key=question", "task.answer_key=solution", "task.eval_prompts=2"]

GOOD = "".join(json.dumps({"question": f"{i}+1", "solution": str(i + 1)}) + "\n" for i in range(10))
FILES = {
    "good.jsonl": GOOD,
    "broken.jsonl": "".join(GOOD.splitlines(keepends=True)[:4]) + '{"question": "1+1", "solution": \n'
    + "".join(GOOD.splitlines(keepends=True)[4:]),
    "empty.jsonl": "\n",
    "list.jsonl": GOOD + "[1, 2]\n",
    "long.jsonl": GOOD + json.dumps({"question": "+".join(["1"] * 60), "solution": "60"}) + "\n",
    "noanswer.jsonl": GOOD + json.dumps({"question": "2+2", "solution": None}) + "\n",
    "table.txt": "question,solution\n",
    "pretrained.yaml": "model: {pretrained: /models/x}\n",
}

CASES = [
    (["train", TINY, *DATA, "task.path=missing.jsonl"], ["task.path='missing.jsonl'", "no such file"]),
    (["train", TINY, *DATA[:1], "task.path=good.jsonl"],
     ["task.prompt_key='prompt'", "no column 'prompt'", "its columns: question, solution"]),
    (["train", TINY, *DATA, "task.answer_key=answer", "task.path=good.jsonl"],
     ["task.answer_key='answer'", "its columns: question, solution"]),
    (["train", TINY, *DATA, "task.path=broken.jsonl"], ["task.path='broken.jsonl'", "line 5", "not valid JSON"]),
    (["train", TINY, *DATA, "task.path=list.jsonl"], ["line 11", "not an object"]),
    (["train", TINY, *DATA, "task.path=empty.jsonl"], ["task.path='empty.jsonl'", "empty"]),
    (["train", TINY, *DATA, "task.path=noanswer.jsonl"], ["row 11", "'solution' is empty"]),
    (["train", TINY, *DATA, "task.path=table.txt"], ["unknown file type '.txt'", ".jsonl"]),
    (["train", TINY, *DATA, "task.path=good.jsonl", "task.eval_prompts=10"],
     ["task.eval_prompts=10", "every row", "task.eval_sets"]),
    (["train", TINY, *DATA, "task.path=good.jsonl", "task.eval_sets.aime=nope.jsonl"],
     ["task.eval_sets.aime='nope.jsonl'", "no such file"]),
    (["train", TINY, *DATA, "task.path=long.jsonl"],
     ["task.path='long.jsonl' row 11", "model.max_position_embeddings=64", "rollout.max_new_tokens=6"]),
    (["train", TINY, *DATA, "task.path=good.jsonl", "task.prompt_template={prompt} {level}"],
     ["task.prompt_template", "KeyError", "columns: question, solution"]),
    (["train", TINY, *DATA, "task.path=good.jsonl", "task.reward=no_such_mod:fn"],
     ["task.reward='no_such_mod:fn' could not be imported"]),
    (["train", TINY, *DATA, "task.path=good.jsonl", "task.chat_template=missing.jinja"],
     ["task.chat_template='missing.jinja'"]),
    (["train", TINY, "task.name=reasoning_gym", "task.kwargs.dataset=no_such_gym"],
     ["task.kwargs.dataset='no_such_gym'", "available:", "basic_arithmetic", "chain_sum"]),
    (["train", TINY, "task.name=reasoning_gym", "task.kwargs.dataset=chain_sum", "task.kwargs.digits=3"],
     ["task.kwargs for reasoning-gym dataset 'chain_sum'", "its options: min_terms"]),
    (["train", TINY, "task.name=reasoning_gym"], ["task.kwargs.dataset"]),
    (["check", TINY, *DATA, "task.path=broken.jsonl"], ["task.path='broken.jsonl'", "line 5"]),
    (["bench", "rollout", TINY, *DATA, "task.path=good.jsonl", "task.answer_key=x"], ["task.answer_key='x'"]),
    (["train", TINY, *DATA, "task.path=good.jsonl", "model.pretrained=nodir"], ["model.pretrained='nodir'",
                                                                                 "no such directory"]),
    (["validate", "pretrained.yaml"], ["model.pretrained='/models/x'", "no task: section", "task: {name: dataset"]),
    (["train", TINY, "task.name=dataset"], ["task.name=dataset needs task.path"]),
    (["validate", TINY, "task.path=good.jsonl"], ["task.path is for task.name=dataset"]),
]


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RZ_DEBUG", raising=False)
    return tmp_path


@pytest.mark.parametrize("argv, fragments", CASES, ids=[" ".join(a[2:] or a[1:]) for a, _ in CASES])
def test_bad_task_input_is_one_line_exit_2_nothing_written(workdir, capsys, argv, fragments):
    assert_refused(workdir, capsys, argv, fragments)
