"""Data tasks without an engine: the dataset task (files through `datasets`, columns, held-out split,
seeded epochs, prompt templates, chat templates of a tokenizer made here), the rewards (math-verify,
exact, a user function; raising / hanging / non-numeric ones scored 0 and counted by the worker),
the reasoning-gym family, the evaluation's greedy / avg@k / pass@1 / pass@k arithmetic, and the
producer's per-batch reward_errors / reward_timeouts."""

from __future__ import annotations

import json
import random
import time

import pytest

from megatron_rz.recipe import RecipeError, TaskConfig, load_recipe
from megatron_rz.rl.evaluation import evaluate
from megatron_rz.rl.tasks import eval_sets, make_task, prompt_text, score, step_problems
from vllm_bridge.samples import Sample

CHAT = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _math_rows(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 50), rng.randint(1, 9)
        out.append({"question": f"{a}+{b}", "solution": f"\\boxed{{{a + b}}}", "level": i % 3})
    return out


def _task(tmp_path, n=40, **kw):
    cfg = dict(name="dataset", path=_write_jsonl(tmp_path / "train.jsonl", _math_rows(n)), prompt_key="question",
               answer_key="solution", eval_prompts=8)
    return make_task(TaskConfig(**{**cfg, **kw}))


def test_dataset_split_shuffle_and_epochs(tmp_path):
    t = _task(tmp_path, n=40)
    held, train = t.eval_set(), t._train
    assert len(held) == 8 and len(train) == 32 and eval_sets(t).keys() == {"heldout"}
    assert not {p.prompt for p in held} & {p.prompt for p in train}  # held-out rows never trained on
    again = _task(tmp_path, n=40)
    assert [p.prompt for p in again.eval_set()] == [p.prompt for p in held]  # seeded: the same split
    other = _task(tmp_path, n=40, seed=7)
    assert [p.prompt for p in other.eval_set()] != [p.prompt for p in held]
    # epoch order: 4 steps of 8 = one pass over the 32 training rows, each exactly once
    epoch0 = [p.prompt for s in range(4) for p in step_problems(t, random.Random(0), s, 8)]
    epoch1 = [p.prompt for s in range(4, 8) for p in step_problems(t, random.Random(0), s, 8)]
    assert sorted(epoch0) == sorted(p.prompt for p in train) == sorted(epoch1) and epoch0 != epoch1
    assert [p.prompt for p in t.sample_step(5, 8)] == epoch1[8:16]  # a resumed step: the same prompts


def test_parquet_eval_sets_and_prompt_template(tmp_path):
    import datasets

    datasets.Dataset.from_list(_math_rows(12, seed=1)).to_parquet(str(tmp_path / "train.parquet"))
    cfg = TaskConfig(name="dataset", path=str(tmp_path / "train.parquet"), prompt_key="question",
                     answer_key="solution", prompt_template="Level {level}: what is {prompt}?",
                     system_prompt="Be brief.",
                     eval_sets={"a": _write_jsonl(tmp_path / "a.jsonl", _math_rows(3, 2)),
                                "b": _write_jsonl(tmp_path / "b.jsonl", _math_rows(5, 3))})
    t = make_task(cfg)
    assert {k: len(v) for k, v in eval_sets(t).items()} == {"a": 3, "b": 5} and t.num_train == 12
    p = eval_sets(t)["a"][0]
    row = _math_rows(3, 2)[0]
    assert p.messages == ({"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"Level {row['level']}: what is {row['question']}?"})
    assert p.answer == row["solution"] and p.row == row


def test_chat_template_of_the_tokenizer_or_the_recipe(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = _task(tmp_path, system_prompt="sys")
    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.train_from_iterator(t.corpus(random.Random(0), 50) + ["<system> <user> <assistant>"],
                            trainers.BpeTrainer(vocab_size=200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|e|>")
    p = t.eval_set()[0]
    assert prompt_text(t, tok, p) == p.prompt == f"sys\n\n{p.messages[1]['content']}"  # no template: plain text
    tok.chat_template = CHAT
    want = f"<system>sys\n<user>{p.messages[1]['content']}\n<assistant>"
    assert prompt_text(t, tok, p) == want  # the tokenizer's own template, generation prompt added
    assert tok.decode(tok.encode(prompt_text(t, tok, p))) == want
    # a recipe template for a tokenizer trained on the task's corpus (tiny models): the corpus is
    # rendered through it, so every character of the rollout's prompts is in the tokenizer's alphabet
    recipe_tpl = _task(tmp_path, system_prompt="sys", chat_template=CHAT)
    text = "".join(recipe_tpl.corpus(random.Random(0), 20))
    assert "<system>sys\n<user>" in text and text.count("<assistant>") == 20
    plain = _task(tmp_path, system_prompt="sys", chat_template="none")
    assert prompt_text(plain, tok, plain.eval_set()[0]) == p.prompt
    (tmp_path / "t.jinja").write_text("{{ messages[-1].content }} =>")
    own = _task(tmp_path, chat_template=str(tmp_path / "t.jinja"))
    assert prompt_text(own, tok, own.eval_set()[0]) == own.eval_set()[0].messages[-1]["content"] + " =>"


def test_math_verify_and_exact_rewards(tmp_path):
    t = _task(tmp_path)
    p = t.eval_set()[0]
    a = p.answer.removeprefix("\\boxed{").removesuffix("}")
    try:
        assert score(t, p, f"We add them. So the answer is \\boxed{{{a}}}.") == (1.0, None)
        assert score(t, p, f"the sum is {a}") == (1.0, None)  # a final answer without a box
        assert score(t, p, f"\\boxed{{{int(a) + 1}}}") == (0.0, None)
        assert score(t, p, "no idea") == (0.0, None)
        half = _task(tmp_path, path=_write_jsonl(tmp_path / "h.jsonl", [{"question": "half?", "solution": "\\frac{1}{2}"}] * 3),
                     eval_prompts=1)
        q = half.eval_set()[0]
        assert [score(half, q, r)[0] for r in ("\\boxed{0.5}", "$1/2$", "\\boxed{\\frac{2}{4}}", "\\boxed{2}")] == [1, 1, 1, 0]
        half.close()
    finally:
        t.close()
    ex = _task(tmp_path, reward="exact")
    q = ex.eval_set()[0]
    assert score(ex, q, f"  {q.answer}\n") == (1.0, None) and score(ex, q, q.answer + "0") == (0.0, None)


USER_REWARDS = '''
import time
def judge(response, answer, row):
    if response == "hang":
        time.sleep(60)
    if response == "raise":
        raise ValueError("cannot judge")
    if response == "nan":
        return float("nan")
    if response == "text":
        return "yes"
    return float(response == answer) + 0.5 * (row["level"] == 1)
'''


def test_user_reward_that_hangs_or_raises_scores_zero_and_is_counted(tmp_path, monkeypatch, capfd):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    t = _task(tmp_path, reward="my_rewards:judge", reward_timeout_s=1.5)
    try:
        p = t.eval_set()[0]
        bonus = 0.5 * (p.row["level"] == 1)
        assert score(t, p, p.answer) == (1.0 + bonus, None)  # fn(response, answer, row)
        t0 = time.perf_counter()
        assert score(t, p, "hang") == (0.0, "timeout")
        assert time.perf_counter() - t0 < 10  # killed at the limit, not after the 60 s sleep
        assert score(t, p, "raise") == (0.0, "error")
        assert score(t, p, "nan") == (0.0, "error") and score(t, p, "text") == (0.0, "error")
        assert score(t, p, p.answer) == (1.0 + bonus, None)  # a fresh worker after the timeout
        assert t.reward_counts == {"reward_errors": 3, "reward_timeouts": 1}
        err = capfd.readouterr().err
        assert "reward timeout, scored 0" in err and "ValueError: cannot judge" in err
    finally:
        t.close()
    with pytest.raises(RecipeError, match="task.reward='my_rewards:nope' could not be imported"):
        _task(tmp_path, reward="my_rewards:nope")


def test_reasoning_gym_task(tmp_path):
    cfg = TaskConfig(name="reasoning_gym", eval_prompts=20,
                     kwargs={"dataset": "chain_sum", "min_terms": 2, "max_terms": 2, "max_digits": 1})
    t = make_task(cfg)
    try:
        held = t.eval_set()
        assert len(held) == 20 and all("arithmetic problem" in p.prompt for p in held)
        assert not {p.prompt for p in held} & {p.prompt for p in t.sample(random.Random(0), 300)}
        p = held[0]
        assert score(t, p, p.answer) == (1.0, None)  # reasoning-gym's own scorer
        assert score(t, p, f"<answer>{p.answer}</answer>") == (1.0, None)  # its answer tag
        assert score(t, p, str(int(p.answer) + 1))[0] == 0.0
        assert all(text.strip() for text in t.corpus(random.Random(1), 5))  # the warm-start corpus
    finally:
        t.close()
    with pytest.raises(RecipeError, match=r"'no_such_gym' is not a reasoning-gym dataset; available: .*chain_sum"):
        make_task(TaskConfig(name="reasoning_gym", kwargs={"dataset": "no_such_gym"}))
    with pytest.raises(RecipeError, match=r"task.kwargs for reasoning-gym dataset 'chain_sum'.*its options: min_terms"):
        make_task(TaskConfig(name="reasoning_gym", kwargs={"dataset": "chain_sum", "bogus": 1}))


class _Engine:
    """generate() answers prompt i with responses[i][j] for sample j (greedy: responses[i][0])."""

    def __init__(self, responses):
        self.responses, self.calls = responses, []

    def generate(self, prompt_ids, n, **kw):
        self.calls.append((n, kw))
        return [Sample(list(p), [i, j], [0.0, 0.0], [0, 0], "stop", group=i, index_in_group=j)
                for i, p in enumerate(prompt_ids) for j in range(n)]


class _ScoreTask:
    def __init__(self, table):
        self.table = table

    def eval_set(self):
        return list(range(len(self.table)))

    def reward(self, problem, text):
        i, j = map(int, text.split())
        if self.table[i][j] is None:
            raise RuntimeError("bad reward")
        return self.table[i][j]


def test_evaluation_greedy_avg_pass_at_k():
    recipe = load_recipe(None, ["task.eval_samples=4", "rollout.temperature=0.7"])
    # prompt 0: greedy right, 2 of 4 samples right; prompt 1: partial credit only; prompt 2: one right,
    # one reward raising (scored 0, counted)
    table = [[1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5], [0.0, None, 1.0, 0.0]]
    eng = _Engine(table)
    out = evaluate(eng, _ScoreTask(table), lambda ps: [[p + 1] for p in ps], lambda ids: f"{ids[0]} {ids[1]}", recipe)
    assert out["eval/heldout/greedy"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert out["eval/heldout/avg@4"] == pytest.approx((0.5 + 0.5 + 0.25) / 3)
    assert out["eval/heldout/pass@1"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)  # reward >= 1 counts as correct
    assert out["eval/heldout/pass@4"] == pytest.approx(2 / 3)
    assert out["eval_reward"] == out["eval/heldout/greedy"] and out["eval/reward_errors"] == 1  # the sampled one
    (n1, greedy_kw), (n4, sampled_kw) = eng.calls
    assert (n1, greedy_kw["temperature"], n4, sampled_kw["temperature"]) == (1, 0.0, 4, 0.7)
    assert evaluate(_Engine(table), _ScoreTask(table), lambda ps: [[p] for p in ps],
                    lambda ids: f"{ids[0]} {ids[1]}", recipe)["eval/heldout/avg@4"] == out["eval/heldout/avg@4"]


def test_producer_counts_reward_errors_and_timeouts_per_batch(tmp_path, monkeypatch):
    from megatron_rz.loop.rollout import BlockingGenerator, Producer

    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    t = _task(tmp_path, reward="my_rewards:judge", reward_timeout_s=1.0)
    texts = ["hang", "raise", "x", "y"]

    class Side:
        task = t

        def encode(self, problems):
            return [[1] for _ in problems]

        def decode(self, ids):
            return texts[ids[0]]

    class Eng:
        weight_version = 0

        def generate(self, prompt_ids, n, *, seed=None, **kw):
            return [Sample(list(p), [j], [0.0], [0], "stop", group=i, index_in_group=j)
                    for i, p in enumerate(prompt_ids) for j in range(n)]

    recipe = load_recipe(None, ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=4"])
    try:
        p = Producer(recipe, Side(), BlockingGenerator(Eng()), v0=0, start_step=0)
        p.submit_batch(0)
        for fg in p.gen.step():
            p.collect(fg)
        ((_, samples, meta),) = p.pop_ready()
        assert (meta["reward_errors"], meta["reward_timeouts"]) == (2, 2) and len(samples) == 8
        assert [s.info.get("reward_status") for s in samples[:4]] == ["timeout", "error", None, None]
        assert all(s.reward == 0.0 for s in samples[:2])
    finally:
        t.close()


def test_recipe_rules_for_tasks(tmp_path):
    with pytest.raises(RecipeError, match=r"model.pretrained='/m' with no task: section"):
        load_recipe(None, ["model.pretrained=/m"])
    assert load_recipe(None, ["model.pretrained=/m", "task.name=arithmetic"]).task.name == "arithmetic"
    with pytest.raises(RecipeError, match="task.name=dataset needs task.path"):
        load_recipe(None, ["task.name=dataset"])
    with pytest.raises(RecipeError, match="task.name=reasoning_gym needs task.kwargs.dataset"):
        load_recipe(None, ["task.name=reasoning_gym"])
    with pytest.raises(RecipeError, match="task.reward='f1'"):
        load_recipe(None, ["task.reward=f1"])
    for name in ("r1_distill_qwen_1p5b", "qwen3_30b_a3b", "deepseek_v3_671b", "deepseek_v4_flash"):
        t = load_recipe(f"recipes/{name}.yaml").task
        assert t.name == "dataset" and t.reward == "math_verify" and len(t.eval_sets) == 5 and t.eval_samples
    # task.epochs becomes schedule.steps, carried to the learner ranks as overrides
    from megatron_rz.launch.task_check import check_task

    path = _write_jsonl(tmp_path / "train.jsonl", _math_rows(50))
    r = load_recipe("recipes/tiny_moe.yaml", ["task.name=dataset", f"task.path={path}", "task.prompt_key=question",
                                             "task.answer_key=solution", "task.eval_prompts=10", "task.epochs=2",
                                             "rollout.prompts_per_step=16", "rollout.max_new_tokens=8"])
    assert check_task(r) == ["task.epochs=null", "schedule.steps=5"] and r.schedule.steps == 5  # ceil(2*40/16)
    assert r.task.epochs is None and load_recipe("recipes/tiny_moe.yaml", ["task.epochs=null", "schedule.steps=5"])


def test_full_size_recipes_submit_dry_run_names_the_task():
    from megatron_rz.launch.submit import submit

    for name in ("r1_distill_qwen_1p5b", "qwen3_30b_a3b", "deepseek_v3_671b", "deepseek_v4_flash"):
        printed: list[str] = []
        assert submit(load_recipe(f"recipes/{name}.yaml"), dry_run=True, out=printed.append) is None
        assert ("#   task: dataset /shared/data/math/train.jsonl (reward math_verify; eval sets aime24, aime25, amc23, "
                "math500, olympiadbench; eval_samples 16)") in printed[0], name
