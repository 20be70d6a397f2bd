"""The learner's attention backward on the GPU (kernels.dispatch.causal_attention with Triton).

Forward: the invariant Triton kernel (its bits are what the loss sees). Backward: autograd of the
same attention through torch's fused SDPA in the inputs' dtype (bf16: FlashAttention; fp32: the
memory-efficient kernel) under torch's deterministic mode, instead of the plain softmax(QK^T)V
reference that keeps the S x S probabilities. Checked: gradients agree with the plain fp32
reference's to fp32 / bf16 rounding (GQA, several lengths) and are the same bits run to run;
measured (printed, not asserted): peak memory of one forward + backward at 8k tokens, plain
reference vs SDPA.

    PYTHONPATH=. python -m pytest tests/gpu/test_attention_backward_gpu.py -q -s
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kernels import dispatch as D
from kernels._common import with_reference_grad

pytestmark = pytest.mark.gpu


def _inputs(B, S, Hq, Hk, Dh, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(B, S, Hq, Dh), mk(B, S, Hk, Dh), mk(B, S, Hk, Dh)


def _plain(q, k, v, scale):
    """The same Triton forward with the first backward (autograd of the materialised fp32 reference)."""
    from kernels.triton.attn import attention_batched

    B, S, Hq, Dh = q.shape
    odt = q.dtype

    def fwd(q_, k_, v_):
        cu = torch.arange(0, B * S + 1, S, device=q.device, dtype=torch.int32)
        pos = torch.arange(S, device=q.device, dtype=torch.int32).repeat(B)
        return attention_batched(q_.contiguous().reshape(B * S, Hq, Dh), k_.contiguous(), v_.contiguous(), cu, pos,
                                 scale, max_q_len=S, out_dtype=odt).reshape(B, S, Hq, v.shape[-1])

    return with_reference_grad(fwd, lambda q_, k_, v_: D._causal_ref(q_, k_, v_, scale, odt), q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 37, 300])
def test_sdpa_backward_matches_plain_reference(dtype, S):
    q, k, v = _inputs(2, S, 8, 2, 64, dtype, seed=S)
    g = torch.randn(2, S, 8, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(dtype)
    out_new = D.causal_attention(q, k, v, 0.125)
    new = torch.autograd.grad(out_new, (q, k, v), g)
    out_old = _plain(q, k, v, 0.125)
    old = torch.autograd.grad(out_old, (q, k, v), g)
    assert torch.equal(out_new, out_old)  # the forward is the Triton kernel either way
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(new, old):
        # relative to the gradient's size, floored: with one key dq is exactly 0 in theory, so both
        # sides hold rounding noise there
        err = (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-2)
        assert err < tol, err


def test_backward_peak_memory_8k_tokens():
    B, S, Hq, Hk, Dh = 1, 8192, 16, 4, 128
    res = {"shape": [B, S, Hq, Hk, Dh], "dtype": "bfloat16"}
    for name, fn in (("plain_reference", _plain), ("sdpa", lambda q, k, v, s: D.causal_attention(q, k, v, s))):
        q, k, v = _inputs(B, S, Hq, Hk, Dh, torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(q, k, v, Dh ** -0.5)
        out.float().sum().backward()
        torch.cuda.synchronize()
        res[f"{name}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        del q, k, v, out
        torch.cuda.empty_cache()
    res["ratio_plain_over_sdpa"] = res["plain_reference_peak_gib"] / res["sdpa_peak_gib"]
    print("\n[attention backward memory] " + json.dumps(res))
    if os.environ.get("RZ_GPU_RESULTS"):
        Path(os.environ["RZ_GPU_RESULTS"], "attention_backward_memory.json").write_text(json.dumps(res, indent=1) + "\n")
    assert res["sdpa_peak_gib"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_deterministic(dtype):
    """Two backward passes of the same inputs give the same gradient bits (long enough that a
    non-deterministic kernel would split the keys over several blocks)."""
    q, k, v = _inputs(2, 1024, 16, 4, 128, dtype, seed=3)
    g = torch.randn(2, 1024, 16, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)).to(dtype)
    runs = [torch.autograd.grad(D.causal_attention(q, k, v, 128 ** -0.5), (q, k, v), g) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    assert not torch.are_deterministic_algorithms_enabled()  # the global setting is restored
