"""Task, tokenizer and the `kernels` package name."""

import random
import subprocess
import sys

from megatron_rz.recipe import TaskConfig
from megatron_rz.rl.tasks import Arithmetic, Problem, make_task
from megatron_rz.learner.tiny_models import train_tokenizer


def test_arithmetic_reward_and_held_out_split():
    t = Arithmetic(digits=2, ops=["+"], eval_prompts=50, seed=1)
    p = t.sample(random.Random(0), 1)[0]
    a, b = p.prompt.rstrip("=").split("+")
    assert p.answer == str(int(a) + int(b))
    assert t.reward(p, p.answer) == 1.0 and t.reward(p, p.answer + "1") == 0.0 and t.reward(p, " " + p.answer) == 1.0
    held = {q.prompt for q in t.eval_set()}
    assert not held & {q.prompt for q in t.sample(random.Random(3), 2000)}


def test_arithmetic_few_shot_preamble():
    plain = Arithmetic(digits=2, eval_prompts=20, seed=1)
    shots = Arithmetic(digits=2, eval_prompts=20, seed=1, few_shot=3)
    p = shots.sample(random.Random(0), 1)[0]
    examples, question = p.prompt.split(";")[:-1], shots.question(p)
    assert len(examples) == 3 and all(int(e.split("=")[0].split("+")[0]) + int(e.split("=")[0].split("+")[1])
                                      == int(e.split("=")[1]) for e in examples)
    a, b = question.rstrip("=").split("+")
    assert p.answer == str(int(a) + int(b)) and shots.reward(p, p.answer) == 1.0
    # the held-out split is on the question, whatever examples precede it
    held = {shots.question(q) for q in shots.eval_set()}
    assert not held & {shots.question(q) for q in shots.sample(random.Random(3), 500)}
    # few_shot=0 draws exactly the prompts it drew before the option existed (a, b, op per prompt)
    rng, old = random.Random(1), []
    for _ in range(20):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        old.append(f"{a}{rng.choice(['+'])}{b}=")
    assert [q.prompt for q in plain.eval_set()] == old
    assert shots.distractor(Problem("1+2=3;58+67=", "125")) == "15"


def test_user_task_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_task.py").write_text(
        "from megatron_rz.rl.tasks import Arithmetic\n"
        "def make(cfg):\n"
        "    return Arithmetic(digits=1, ops=['*'], eval_prompts=5, seed=cfg.seed)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task(TaskConfig(name="my_task:make"))
    p = task.eval_set()[0]
    assert "*" in p.prompt and len(task.eval_set()) == 5
    a, b = p.prompt.rstrip("=").split("*")
    assert task.reward(p, str(int(a) * int(b))) == 1.0


def test_bad_task_names_fail_clearly():
    import pytest

    from megatron_rz.recipe import RecipeError

    with pytest.raises(RecipeError, match="neither a built-in"):
        make_task(TaskConfig(name="gsm8k"))
    with pytest.raises(RecipeError, match="could not be imported"):
        make_task(TaskConfig(name="no_such_module_xyz:make"))


def test_tokenizer_splits_digits_and_round_trips(tmp_path):
    t = Arithmetic(digits=3, ops=["+", "*"])
    tok = train_tokenizer(t, 64, tmp_path)
    ids = tok.encode("123+45=168", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("123+45=168")
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "123+45=168"
    assert max(ids) < 64


def test_our_kernels_package_does_not_shadow_huggingface_kernels():
    # transformers probes for Hugging Face's `kernels` hub package by name; our top-level package
    # must never be taken for it (it would try to call kernels.get_kernel and fail).
    code = (
        "import kernels, transformers.integrations.hub_kernels as hk;"
        "assert getattr(kernels, '__reinforce_zero__', False);"
        "from transformers.utils import import_utils as iu;"
        "print(iu.is_kernels_available())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_chain_sum_worked_answers_reward_and_distractor(tmp_path):
    import pytest

    from megatron_rz.recipe import RecipeError, load_recipe

    task = make_task(TaskConfig(name="chain_sum", digits=2, eval_prompts=50, kwargs={"terms": 14}))
    p = task.sample(random.Random(0), 1)[0]
    nums = [int(v) for v in p.prompt.rstrip("=").split("+")]
    assert len(nums) == 14 and all(1 <= v <= 99 for v in nums)
    steps = p.answer.split(";")
    assert len(steps) == 13 and steps[-1].endswith(f"={sum(nums)}")
    for s in steps:  # every step is a true addition
        lhs, rhs = s.split("=")
        assert sum(map(int, lhs.split("+"))) == int(rhs)
    assert task.reward(p, p.answer) == 1.0
    assert task.reward(p, f"bogus=1;={sum(nums)}") == 1.0  # the verifier reads the final total only
    assert task.reward(p, p.answer + "1") == 0.0 and task.reward(p, p.answer[:-1] + "+") == 0.0
    assert task.reward(p, "") == 0.0
    wrong = task.distractor(p)
    assert wrong is not None and task.reward(p, wrong) == 0.0
    assert wrong.split(";")[0] == f"{nums[0]}+{nums[1]}=" + "".join(
        str((int(a) + int(b)) % 10) for a, b in zip(str(nums[0]).zfill(2), str(nums[1]).zfill(2))).lstrip("0")
    # held-out prompts never appear in training draws
    held = {q.prompt for q in task.eval_set()}
    assert len(held) == 50 and not held & {q.prompt for q in task.sample(random.Random(1), 2000)}
    # the GPU recipe's answers are >= 127 characters, one token each (digits and punctuation split)
    gpu = load_recipe("recipes/gpu_moe.yaml")
    gtask = make_task(gpu.task)
    tok = train_tokenizer(gtask, gpu.warm_start.tokenizer_vocab, tmp_path)
    lens = [len(tok.encode(q.answer, add_special_tokens=False)) for q in gtask.sample(random.Random(2), 200)]
    assert min(lens) >= 120 and sum(lens) / len(lens) >= 128
    assert max(len(tok.encode(q.prompt + q.answer)) for q in gtask.sample(random.Random(3), 200)) < 200
    with pytest.raises(RecipeError, match="terms"):
        make_task(TaskConfig(name="chain_sum", kwargs={"terms": 1}))
    with pytest.raises(RecipeError, match="task.ops"):
        make_task(TaskConfig(name="chain_sum", ops=["*"]))
