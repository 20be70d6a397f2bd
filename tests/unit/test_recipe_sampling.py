"""The rollout sampling fields: the contract (temperature, top_k, top_p) and the fields vLLM honours
that the learner does not compute (refused in aligned mode, one line naming the key and the fix)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rz.recipe import RecipeError, load_recipe

OUTSIDE = {
    "min_p": "0.1",
    "repetition_penalty": "1.1",
    "presence_penalty": "0.5",
    "frequency_penalty": "0.5",
    "logit_bias": "{3: 2.0}",
    "min_tokens": "2",
}


def test_contract_fields():
    r = load_recipe(None, ["rollout.top_k=5", "rollout.top_p=0.9", "rollout.temperature=0.7"]).rollout
    assert r.sampling_contract() == {"temperature": 0.7, "top_k": 5, "top_p": 0.9}
    assert r.sampling_kwargs() == r.sampling_contract()
    assert load_recipe(None).rollout.sampling_contract() == {"temperature": 1.0, "top_k": -1, "top_p": 1.0}


@pytest.mark.parametrize("key", sorted(OUTSIDE))
def test_outside_the_contract_is_refused_in_aligned_mode(key):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["mode=aligned", f"rollout.{key}={OUTSIDE[key]}"])
    msg = str(e.value)
    assert f"rollout.{key}=" in msg and "outside the aligned sampling contract" in msg and "mode=fast" in msg
    line = [ln for ln in msg.splitlines() if f"rollout.{key}" in ln]
    assert len(line) == 1  # one line names the key and the fix


@pytest.mark.parametrize("key", sorted(OUTSIDE))
def test_outside_the_contract_goes_to_vllm_in_fast_mode(key):
    r = load_recipe(None, ["mode=fast", f"rollout.{key}={OUTSIDE[key]}"]).rollout
    kw = r.sampling_kwargs()
    assert key in kw and r.sampling_contract() == {"temperature": 1.0, "top_k": -1, "top_p": 1.0}


@pytest.mark.parametrize("override", ["rollout.top_k=-2", "rollout.top_p=0", "rollout.top_p=1.5", "rollout.min_p=2"])
def test_bad_values(override):
    with pytest.raises(RecipeError):
        load_recipe(None, ["mode=fast", override])


def _md(**kw):
    base = dict(no_penalties=True, allowed_token_ids_mask=None, bad_words_token_ids={},
                logitsprocs=SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[]))
    base.update(kw)
    return SimpleNamespace(**base)


def test_aligned_sampler_refuses_what_the_learner_does_not_compute():
    from vllm_bridge.sampler_patch import AlignedSamplingError, _refuse_unsupported

    _refuse_unsupported(_md())  # nothing active: fine
    MinP = type("MinPLogitsProcessor", (), {})
    idle, active = MinP(), MinP()
    idle.min_p_count, active.min_p_count = 0, 2
    _refuse_unsupported(_md(logitsprocs=SimpleNamespace(argmax_invariant=[idle], non_argmax_invariant=[])))
    for md, word in ((_md(no_penalties=False), "penalty"), (_md(bad_words_token_ids={0: [[1]]}), "bad_words"),
                     (_md(logitsprocs=SimpleNamespace(argmax_invariant=[active], non_argmax_invariant=[])), "min_p")):
        with pytest.raises(AlignedSamplingError, match=word):
            _refuse_unsupported(md)
