"""Dense Qwen2: our reference functions (kernels.models.qwen3_dsv3, arch "qwen2": q/k/v
biases, no q/k norm, tied or untied embeddings) against transformers' own Qwen2ForCausalLM.

Measured (fp32, the random configs below, 2026-12-01): max |logits ours - transformers| 4.2e-7 untied,
4.2e-7 tied (logits of magnitude < 0.9); the bound asserted is 1e-5. Logprobs agree likewise."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernels.models import qwen3_dsv3 as ref  # noqa: E402


def _model(tied: bool, seed: int = 0):
    cfg = transformers.Qwen2Config(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # the init leaves the biases at zero: give them values, so they are tested
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return cfg, model


@pytest.mark.parametrize("tied", [False, True])
def test_reference_matches_transformers_qwen2(tied):
    cfg, model = _model(tied)
    c = ref.arch_config(cfg.to_dict())
    assert c.arch == "qwen2" and c.head_dim == 32 and not any(c.moe_layers) and c.tie_word_embeddings is tied
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("q_proj.bias") for k in sd)
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    ours = ref.reference_logits(sd, cfg.to_dict(), ids)
    with torch.no_grad():
        theirs = model(input_ids=ids).logits.float()
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-5, diff
    # the biases matter: without them the logits move far more than the tolerance
    no_bias = {k: (torch.zeros_like(v) if k.endswith(".bias") else v) for k, v in sd.items()}
    assert (ref.reference_logits(no_bias, cfg.to_dict(), ids) - theirs).abs().max().item() > 1e-2
    lp = ref.reference_logprobs(sd, cfg.to_dict(), ids)
    want = torch.log_softmax(theirs[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (lp[:, 1:] - want).abs().max().item() < 1e-5


def test_qwen2_reference_is_batch_invariant_bitwise():
    cfg, model = _model(False, seed=3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, cfg.vocab_size, (4, 13), generator=torch.Generator().manual_seed(2))
    full = ref.reference_logprobs(sd, cfg.to_dict(), ids)
    for b in range(4):
        assert torch.equal(ref.reference_logprobs(sd, cfg.to_dict(), ids[b:b + 1])[0], full[b])
    short = ref.reference_logprobs(sd, cfg.to_dict(), ids[:, :7])  # a prefix = decode vs prefill
    assert torch.equal(short, full[:, :7])


def test_qwen2_sliding_window_is_refused():
    cfg, _ = _model(False)
    d = cfg.to_dict()
    d["use_sliding_window"] = True
    with pytest.raises(NotImplementedError, match="sliding"):
        ref.arch_config(d)
