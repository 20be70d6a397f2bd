"""The one rollout producer (megatron_rz.loop.rollout) without an engine: per-step prompts and seeds,
rewards + overlong shaping, DAPO dynamic sampling refills, the lag bound, and BlockingGenerator
(one generate call per batch, generate's own seed pattern)."""

import pytest

from megatron_rz.rl.batch_filters import DynamicSamplingError
from megatron_rz.recipe import load_recipe
from megatron_rz.loop.resume import step_rng
from megatron_rz.loop.rollout import BlockingGenerator, Producer, rollout_seed
from vllm_bridge.samples import Sample


class _Task:
    def sample(self, rng, n):
        return [rng.randrange(10**6) for _ in range(n)]

    def reward(self, problem, text):
        return float(text)


class _Side:
    def __init__(self):
        self.task = _Task()

    def encode(self, problems):
        return [[p % 97 + 1] for p in problems]

    def decode(self, ids):  # the response's first id is the reward (tests choose it)
        return str(ids[0])


class _Engine:
    """generate(): seeded fake samples; a prompt whose seed is in `flat` gets equal rewards."""

    def __init__(self, flat=(), length=3):
        self.calls, self.flat, self.length, self.weight_version = [], set(flat), length, 0

    def generate(self, prompt_ids, n, *, seed=None, max_new_tokens=8, **kw):
        self.calls.append((len(prompt_ids), seed))
        out = []
        for i, p in enumerate(prompt_ids):
            s = seed + i * n
            for j in range(n):
                reward = 1 if s in self.flat else (j % 2)
                out.append(Sample(list(p), [reward] + [5] * (self.length - 1), [-0.1] * self.length,
                                  [self.weight_version] * self.length, "stop", group=i, index_in_group=j))
        return out


def _recipe(*over):
    return load_recipe(None, ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", *over])


def test_batch_is_one_generate_call_with_the_step_seeds_and_prompts():
    recipe = _recipe()
    eng = _Engine()
    eng.weight_version = 3  # a resumed run: the engine holds the learner's version 3
    p = Producer(recipe, _Side(), BlockingGenerator(eng), v0=3, start_step=3)
    assert p.allowed(0) and not p.allowed(1)  # lag bound at max_lag 0: version 3 + k
    p.submit_batch(0)
    for fg in p.gen.step():
        p.collect(fg)
    ((k, samples, meta),) = p.pop_ready()
    assert k == 0 and eng.calls == [(4, rollout_seed(recipe.schedule.seed, 3))]  # one call, generate's seeds
    assert [s.group for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    want = [_Side().encode([q])[0] for q in _Task().sample(step_rng(recipe.schedule.seed, 3), 4)]
    assert [s.prompt_ids for s in samples[::2]] == want  # the step's prompts whatever the schedule
    assert [s.reward for s in samples] == [0.0, 1.0] * 4 and meta["dynamic_sampling_dropped"] == 0


def test_dynamic_sampling_refills_with_fresh_prompts_and_overlong_shaping():
    recipe = _recipe("algo.dynamic_sampling=true", "algo.overlong_buffer=2", "rollout.max_new_tokens=4")
    seed0 = rollout_seed(recipe.schedule.seed, 0)
    eng = _Engine(flat={seed0 + 2}, length=4)  # prompt 1's group has all-equal rewards
    p = Producer(recipe, _Side(), BlockingGenerator(eng), v0=0, start_step=0)
    p.submit_batch(0)
    while not (ready := p.pop_ready()):
        for fg in p.gen.step():
            p.collect(fg)
    (_, samples, meta) = ready[0]
    assert meta["dynamic_sampling_dropped"] == 1 and len(samples) == 8
    assert eng.calls[1] == (1, rollout_seed(recipe.schedule.seed, 0, 7919))  # the refill's own seed
    # length 4 = max_new_tokens: overlong penalty -1 on every reward, task reward kept apart
    assert all(s.reward == s.info["task_reward"] - 1.0 for s in samples)
    assert all(s.info["dynamic_sampling_dropped"] == 1 for s in samples)


def test_dynamic_sampling_gives_up_with_a_clear_message():
    recipe = _recipe("algo.dynamic_sampling=true", "rollout.prompts_per_step=1")

    class Flat(_Engine):
        def generate(self, prompt_ids, n, *, seed=None, **kw):
            self.flat.add(seed)
            return super().generate(prompt_ids, n, seed=seed, **kw)

    p = Producer(recipe, _Side(), BlockingGenerator(Flat()), v0=0, start_step=0)
    p.submit_batch(0)
    with pytest.raises(DynamicSamplingError, match="algo.dynamic_sampling=false"):
        for _ in range(20):
            for fg in p.gen.step():
                p.collect(fg)


def test_lag_bound_and_forget():
    recipe = _recipe("schedule.max_lag=2", "schedule.steps=10")
    eng = _Engine()
    p = Producer(recipe, _Side(), BlockingGenerator(eng), v0=0, start_step=0)
    assert [p.allowed(k) for k in range(4)] == [True, True, True, False]
    eng.weight_version = 1
    assert p.allowed(3) and not p.allowed(4)
    p.submit_batch(0)
    p.forget(0)  # its engine died: the batch is redone from scratch, identically
    assert p.next_submit == 0 and 0 not in p.batches
