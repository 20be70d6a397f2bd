"""Agentic tasks without an engine: the guarded tool worker under faults (raise, hang, huge output,
a dead worker), the tool environment's parsing (malformed calls are the model's mistake), the
episode bookkeeping across turns (masks, logprobs, versions, seeds), the learner batch that masks
environment tokens, the calc task's text against the turn-by-turn tokens, and bad recipe input."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from megatron_rz.recipe import RecipeError, TaskConfig
from megatron_rz.rl.agentic import TURN_SEED_STRIDE, CalcTask, EpisodeGenerator, ToolEnv, calc, episode_counts
from megatron_rz.rl.problem import Problem
from megatron_rz.rl.tools import ToolWorker, tool_path

ROOT = Path(__file__).resolve().parents[2]


from agentic_test_tools import boom, die, echo, huge, pid, sleepy  # the worker imports them from there


@pytest.fixture(scope="module")
def worker():
    w = ToolWorker({f.__name__: f for f in (echo, boom, sleepy, huge, die, pid)}, timeout_s=0.5, max_chars=40)
    yield w
    w.close()


def test_tool_faults_are_bounded_counted_and_the_worker_goes_on(worker):
    assert worker.call("echo", "37*58") == ("37*58", None)
    first_pid = worker.call("pid", "")[0]
    reply, status = worker.call("boom", "way")
    assert status == "error" and reply == "error: ZeroDivisionError: no way"
    assert worker.call("pid", "")[0] == first_pid  # an exception does not cost the worker

    t0 = time.perf_counter()
    reply, status = worker.call("sleepy", "30")
    assert status == "timeout" and "timed out after 0.5 s" in reply
    assert time.perf_counter() - t0 < 5  # killed at the limit, not after 30 s
    assert worker.call("sleepy", "0") == ("woke", None)  # a fresh worker took the next call
    assert worker.call("pid", "")[0] != first_pid

    reply, status = worker.call("huge", "")
    assert status == "truncated" and reply == "x" * 40

    reply, status = worker.call("die", "")
    assert status == "error" and "crashed" in reply
    assert worker.call("echo", "still here") == ("still here", None)
    assert worker.counts == {"error": 2, "timeout": 1, "truncated": 1}
    assert worker.calls == 10


def test_tool_paths_must_be_importable():
    assert tool_path(calc) == "megatron_rz.rl.agentic:calc"
    with pytest.raises(ValueError, match="not importable"):
        tool_path(lambda s: s)
    with pytest.raises(RecipeError, match="task.tools: 'nosuchmodule_rz:f' could not be imported"):
        ToolEnv(["nosuchmodule_rz:f"], max_turns=2, timeout_s=1, max_chars=10)


def test_calc_tool():
    assert calc("37*58") == "2146" and calc(" (2+3)*4 ") == "20" and calc("-7//2") == "-4"
    for bad in ("37*", "__import__('os')", "2**99", "1.5*2", "x" * 65):
        with pytest.raises((ValueError, SyntaxError)):
            calc(bad)


def test_tool_env_parses_calls_and_malformed_calls_end_the_episode_with_reward_0():
    env = ToolEnv([calc, echo], max_turns=3, timeout_s=5, max_chars=40, answer=lambda p: p.row)
    p = Problem("37*58=", "", row="2146")
    st = env.reset(p)
    assert env.env_response(p, ["calc(37*58)"], st) == "[2146]"
    reply = env.env_response(p, ["calc(37*)"], st)  # the error is the reply, cut to max_chars
    assert reply.startswith("[error: SyntaxError: invalid syntax") and len(reply) == 40 + 2  # + the brackets
    assert env.env_response(p, ["2146"], st) is None  # the final answer
    assert env.reward(p, ["calc(37*58)", "2146"], st) == 1.0 and env.reward(p, ["2147"], st) == 0.0
    assert st["tool_calls"] == 2 and st["statuses"] == [None, "error"]
    for malformed in ("calc(37*58", "cal(37*58)", "calc(1)calc(2", ")"):
        st = env.reset(p)
        assert env.env_response(p, [malformed], st) is None and st["malformed"]
        assert env.reward(p, ["2146"], st) == 0.0  # even a right number after a malformed call scores 0
    env.close()


class _Scripted:
    """An engine stand-in that answers each request with the next scripted model turn (tokens =
    character codes), recording what it was asked: enough to check the episode bookkeeping; the
    real engine runs these episodes in tests/integration/test_agentic_e2e.py."""

    def __init__(self, turns: dict[int, list[str]]):
        self.turns, self.version, self.requests, self._pending = turns, 0, [], []
        self.swaps: list = []

    def submit(self, prompt_ids, n, *, seed=None, tag=None, max_new_tokens=64, **kw):
        assert n == 1 and len(prompt_ids) == 1
        self.requests.append((list(prompt_ids[0]), seed, max_new_tokens))
        self._pending.append((tag, seed, max_new_tokens))

    def num_in_flight(self):
        return len(self._pending)

    def step(self):
        from vllm_bridge.samples import Sample
        from vllm_bridge.streaming import FinishedGroup

        out = []
        for tag, seed, max_new in self._pending:
            ep = (seed % TURN_SEED_STRIDE) - 100
            text = self.turns[ep].pop(0)
            ids = [ord(c) for c in text][:max_new]
            s = Sample([], ids, [-0.5] * len(ids), [self.version] * len(ids), "stop", 0)
            out.append(FinishedGroup(tag, 0, [s], self.version, 0.0))
        self._pending = []
        self.version += 1  # the next turn runs under new weights
        return out

    def abort_all(self):
        self._pending = []


def test_episodes_keep_model_tokens_logprobs_and_versions_and_mask_the_environment():
    env = ToolEnv([calc], max_turns=3, timeout_s=5, max_chars=40, answer=lambda p: p.row)
    inner = _Scripted({0: ["calc(2*3)", "6"], 1: ["6"], 2: ["calc(2*)", "6"], 3: ["calc(1+1)", "calc(2+2)", "calc(3*3)"]})
    gen = EpisodeGenerator(inner, env, lambda t: [ord(c) for c in t], lambda ids: "".join(map(chr, ids)), 64)
    p = Problem("2*3=", "", row="6")
    gen.submit([[ord(c) for c in "2*3="]], 4, seed=100, tag="g", problem=p, max_new_tokens=12)
    (fg,) = gen.drain()
    assert fg.tag == "g" and [s.index_in_group for s in fg.samples] == [0, 1, 2, 3]
    a, b, c, d = fg.samples
    # episode 0: model turn, [6] from the tool, model turn
    assert "".join(map(chr, a.response_ids)) == "calc(2*3)[6]6"
    assert a.info["model_mask"] == [1] * 9 + [0] * 3 + [1]
    assert a.logprobs == [-0.5] * 9 + [0.0] * 3 + [-0.5]
    assert [v for v, m in zip(a.versions, a.info["model_mask"]) if m] == [0] * 9 + [1]  # spans an update
    assert a.info["episode_reward"] == 1.0 and a.info["turns"] == 2 and a.info["episode_version"] == 0
    assert b.info["episode_reward"] == 1.0 and b.info["tool_calls"] == 0 and b.info["model_mask"] == [1]
    # a call calc raises on: the error is the reply, counted; the episode goes on
    assert c.info["tool_errors"] == 1 and c.info["episode_reward"] == 1.0
    # max_turns tool calls: over without a final answer, reward 0
    assert d.info["turns"] == 3 and d.info["tool_calls"] == 2 and d.info["episode_reward"] == 0.0
    # each turn's prompt is the conversation so far; turn t's seed is the episode's + t * stride
    (p0, s0, _), = [r for r in inner.requests if r[1] == 100]
    (p1, s1, _), = [r for r in inner.requests if r[1] == 100 + TURN_SEED_STRIDE]
    assert p1 == p0 + a.response_ids[:12]
    counts = episode_counts(fg.samples)
    assert counts["agentic/tool_calls"] == 4 and counts["agentic/tool_errors"] == 1 and counts["agentic/episodes"] == 4
    assert counts["agentic/env_tokens"] == sum(len(s.response_ids) - sum(s.info["model_mask"]) for s in fg.samples)
    env.close()


def test_episodes_stay_within_the_context():
    env = ToolEnv([echo], max_turns=4, timeout_s=5, max_chars=40)
    enc, dec = (lambda t: [ord(c) for c in t]), (lambda ids: "".join(map(chr, ids)))
    # 3 prompt tokens + 14 (turn 1) + 10 (the reply [aaaaaaaa]) = 27: the second turn gets 30 - 27 = 3 tokens
    inner = _Scripted({0: ["echo(aaaaaaaa)", "echo(b)"]})
    gen = EpisodeGenerator(inner, env, enc, dec, 30)
    gen.submit([[1, 2, 3]], 1, seed=100, problem=Problem("", ""), max_new_tokens=20)
    (s,) = gen.drain()[0].samples
    assert [r[2] for r in inner.requests] == [20, 3] and dec(s.response_ids) == "echo(aaaaaaaa)[aaaaaaaa]ech"
    assert s.info["turns"] == 2 and not s.info["context_full"]
    # with 26 the reply leaves no room for a next turn: the episode ends before it, counted
    inner = _Scripted({0: ["echo(aaaaaaaa)", "echo(b)"]})
    gen = EpisodeGenerator(inner, env, enc, dec, 26)
    gen.submit([[1, 2, 3]], 1, seed=100, problem=Problem("", ""), max_new_tokens=20)
    (s,) = gen.drain()[0].samples
    assert len(inner.requests) == 1 and dec(s.response_ids) == "echo(aaaaaaaa)" and s.info["context_full"] == 1
    env.close()


class _Broken(ToolEnv):
    def env_response(self, problem, turns, state):
        raise KeyError("env bug")


def test_an_environment_that_raises_ends_its_episode_counted():
    env = _Broken([echo], max_turns=3, timeout_s=5, max_chars=40)
    gen = EpisodeGenerator(_Scripted({0: ["x"], 1: ["y"]}), env, lambda t: [ord(c) for c in t],
                           lambda ids: "".join(map(chr, ids)), 64)
    gen.submit([[1]], 2, seed=100, problem=Problem("", "x"), max_new_tokens=4)
    (fg,) = gen.drain()
    assert [s.info["env_errors"] for s in fg.samples] == [1, 1] and [s.info["turns"] for s in fg.samples] == [1, 1]
    assert episode_counts(fg.samples)["agentic/env_errors"] == 2
    env.close()


def test_learner_batch_masks_environment_tokens():
    from megatron_rz.loop.trainer import build_batch
    from vllm_bridge.samples import Sample

    a = Sample([5, 6], [7, 8, 9, 10], [-1.0, 0.0, 0.0, -2.0], [3, 3, 3, 4], "stop", 0,
               info={"model_mask": [1, 0, 0, 1], "episode_version": 2})
    b = Sample([5, 6], [11], [-0.5], [4], "stop", 0)
    batch = build_batch([a, b], pad_id=0)
    assert torch.equal(batch.loss_mask, torch.tensor([[0, 0, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0]], dtype=torch.float32))
    assert torch.equal(batch.versions, torch.tensor([[-1, -1, 3, -1, -1, 4], [-1, -1, 4, -1, -1, -1]]))
    assert torch.equal(batch.episode_versions, torch.tensor([2, 4]))
    assert torch.equal(batch.token_weight, torch.full((2,), 2 / 3))  # token mean over the 3 model tokens


def test_calc_task_text_is_the_turn_by_turn_tokens(tmp_path):
    from megatron_rz.learner.tiny_models import EOS, train_tokenizer
    from megatron_rz.rl.agentic import EOS_TEXT

    assert EOS_TEXT == EOS
    task = CalcTask(TaskConfig(name="agentic_calc", digits=3, eval_prompts=5))
    tok = train_tokenizer(task, 64, tmp_path, 0)
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    p = task.sample(random.Random(3), 1)[0]
    a, b = p.prompt.rstrip("=").split("*")
    c = str(int(a) * int(b))
    assert p.answer == f"calc({a}*{b}){EOS}[{c}]{c}" and p.row["product"] == c
    # the warm start's text = prompt, model turn + EOS, the environment's reply, model turn
    assert enc(p.prompt + p.answer) == enc(p.prompt) + enc(f"calc({a}*{b})") + [tok.eos_token_id] + enc(f"[{c}]") + enc(c)
    assert task.distractor(p) in (c, f"calc({a}+{b}){EOS}[{int(a) + int(b)}]{int(a) + int(b)}")
    assert not {q.prompt for q in task.sample(random.Random(0), 300)} & {q.prompt for q in task.eval_set()}
    task.close()


@pytest.mark.parametrize("override, fragment", [
    ("task.tools=[nocolon]", "task.tools entry 'nocolon'"),
    ("task.max_turns=0", "task.max_turns=0"),
    ("task.tool_output_chars=-1", "task.tool_output_chars=-1"),
    ("task.lag_bound=turn", "task.lag_bound='turn'"),
    ("task.tools=[nosuchmodule_rz:fn]", "task.tools: 'nosuchmodule_rz:fn' could not be imported"),
])
def test_bad_agentic_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, override, fragment):
    from refusal import assert_refused

    monkeypatch.chdir(tmp_path)
    assert_refused(tmp_path, capsys, ["train", str(ROOT / "recipes" / "tiny_moe_agentic.yaml"), override,
                                      f"logging.run_dir={tmp_path / 'run'}"], [fragment])
