"""`rz train` on a math jsonl file end to end: a dataset task (\\boxed{} answers, math-verify reward), a
checkpoint whose tokenizer carries a chat template (both made here: the tiny warm start on the same
rows, then the template set on its tokenizer; the run uses it through model.pretrained and
task.chat_template=auto), two named eval sets with greedy / avg@k / pass@1 / pass@k logged at every
evaluation, aligned logprobs bitwise, the eval plots drawn."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _rows(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append({"problem": f"{a}+{b}", "answer": f"\\boxed{{{a + b}}}"})
    return out


def test_train_on_a_math_jsonl_with_chat_template_and_math_verify(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rz.learner.tiny_models import warm_start
    from megatron_rz.recipe import load_recipe

    for name, n, seed in (("train", 300, 0), ("gsm", 16, 1), ("aime", 12, 2)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(n, seed)))
    task = ["task.name=dataset", f"task.path={tmp_path / 'train.jsonl'}", "task.prompt_key=problem",
            "task.answer_key=answer", "task.prompt_template=What is {prompt}? Put the answer in \\boxed{{}}."]
    model = tmp_path / "model"
    # the base model: the tiny warm start on the rows, prompts rendered through the template
    warm_start(load_recipe(str(ROOT / "recipes/tiny_moe.yaml"), [*task, f"task.chat_template={TEMPLATE}",
                                                                 "warm_start.steps=120"]), model, progress=False)
    tok = AutoTokenizer.from_pretrained(model)
    assert tok.chat_template is None
    tok.chat_template = TEMPLATE  # the tokenizer's own chat template from here on
    tok.save_pretrained(model)

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rz.cli", "train", str(ROOT / "recipes/tiny_moe.yaml"),
           f"model.pretrained={model}", f"logging.run_dir={run}", *task, "task.reward=math_verify",
           f"task.eval_sets.gsm={tmp_path / 'gsm.jsonl'}", f"task.eval_sets.aime={tmp_path / 'aime.jsonl'}",
           "task.eval_samples=4", "schedule.steps=2", "schedule.eval_every=1", "rollout.prompts_per_step=8",
           "rollout.samples_per_prompt=4", "rollout.max_new_tokens=10", "checkpoint.every=0",
           "logging.progress=false", "logging.wandb=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "max_abs_dlogp" in r]
    assert [r["step"] for r in train] == [1, 2] and all(r["frac_bitwise"] == 1.0 for r in train)
    assert all(r["reward_errors"] == 0 and r["reward_timeouts"] == 0 for r in train)
    assert sum(r["reward_mean"] for r in train) > 0  # math-verify found right \boxed{} answers
    evals = [r for r in rows if "eval/gsm/greedy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]  # before, every update (not the last), after
    for r in evals:
        for s in ("gsm", "aime"):
            for m in ("greedy", "avg@4", "pass@1", "pass@4"):
                assert 0.0 <= r[f"eval/{s}/{m}"] <= 1.0, (s, m, r)
            assert r[f"eval/{s}/pass@1"] <= r[f"eval/{s}/pass@4"]
        assert r["eval_reward"] == r["eval/gsm/greedy"] and r["eval/reward_errors"] == 0
    assert max(r["eval/gsm/greedy"] + r["eval/aime/greedy"] for r in evals) > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_before"]["gsm/pass@1"] == evals[0]["eval/gsm/pass@1"]
    assert summary["reward_errors"] == 0 and summary["mismatch_frac_bitwise"] == 1.0
    for png in ("eval_gsm.png", "eval_aime.png", "reward.png"):
        assert (run / "plots" / png).stat().st_size > 1000
    # the run read the template from the checkpoint's tokenizer, the recipe names none
    assert "chat_template: auto" in (run / "recipe.yaml").read_text()
