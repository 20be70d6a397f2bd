"""The CUDA attention backend's zero fill of its output (vllm_bridge/aligned/cuda_attention.py):
kept by default (MoE routers, the grouped MoE work list and MLA's padded V read every row), skipped
for a model that says it reads only the rows the kernel writes (dense Qwen2 on CUDA). Run on the CPU
with a stand-in for the paged-attention kernel that writes only the real requests' rows."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")  # the backend module the stand-in replaces a kernel of
C = pytest.importorskip("vllm_bridge.aligned.cuda_attention")


def _impl(**kw):
    return C.RZAlignedCudaAttentionImpl(num_heads=2, head_size=8, scale=0.25, num_kv_heads=1, alibi_slopes=None,
                                        sliding_window=None, kv_cache_dtype="auto", **kw)


def _run(impl, monkeypatch, T=5, written=3):
    def fake_paged_attention(q, kc, vc, block_table, qsl, seq_lens, scale, *, max_q_len, out, num_seqs):
        out[:written] = 1.0  # the real requests' rows; the rest belong to padded requests

    monkeypatch.setattr("kernels.triton.attn.paged_attention", fake_paged_attention)
    md = C.RZAlignedCudaMetadata(num_actual_tokens=written, num_reqs=T, max_query_len=1,
                                 query_start_loc=torch.arange(T + 1, dtype=torch.int32),
                                 seq_lens=torch.ones(T, dtype=torch.int32),
                                 block_table=torch.zeros(T, 1, dtype=torch.int32),
                                 slot_mapping=torch.arange(T))
    out = torch.full((T, 2 * 8), float("nan"))
    q = torch.randn(T, 2 * 8)
    kv_cache = torch.zeros(4, 1, 16, 2 * 8)
    return impl.forward(None, q, None, None, kv_cache, md, out)


def test_output_is_zeroed_by_default(monkeypatch):
    impl = _impl()
    assert impl.rz_zero_output is True
    out = _run(impl, monkeypatch)
    assert torch.equal(out[:3], torch.ones(3, 16)) and torch.equal(out[3:], torch.zeros(2, 16))


def test_a_model_may_skip_the_fill(monkeypatch):
    impl = _impl(rz_zero_output=False)
    out = _run(impl, monkeypatch)
    assert torch.equal(out[:3], torch.ones(3, 16))
    assert torch.isnan(out[3:]).all()  # not touched: no fill launch
    # the profiling run (no metadata) still gets zeros
    prof = impl.forward(None, torch.randn(2, 16), None, None, None, None, torch.full((2, 16), float("nan")))
    assert torch.equal(prof, torch.zeros(2, 16))


@pytest.mark.parametrize("cuda", [True, False])
def test_qwen2_opts_out_on_the_cuda_backend_only(cuda, monkeypatch):
    from kernels.models import qwen3_dsv3 as ref
    from vllm_bridge.aligned import qwen2 as Q

    c = ref.arch_config({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32,
                         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "vocab_size": 64, "intermediate_size": 48})
    monkeypatch.setattr(Q, "is_cuda", lambda: cuda)
    seen = []
    model = types.SimpleNamespace(c=c, rz_fast=False, _make_attn=lambda prefix, *a, **kw: seen.append(kw))
    Q.RZAlignedQwen2ForCausalLM._build_attention(model, 0, torch.float32, "model.layers.0.self_attn")
    assert seen == [{"rz_zero_output": False} if cuda else {}]
