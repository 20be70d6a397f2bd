"""DeepSeek-V4 kernels (kernels/dsv4.py): per-row invariance, prefix invariance, reference values."""

import torch

import kernels
from kernels import dsv4


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_sink_attention_rows_alone_equal_rows_in_batch_and_match_softmax():
    g = _g()
    T, H, D, N = 40, 4, 32, 9
    q = torch.randn(T, H, D, generator=g)
    kv = torch.randn(T, D, generator=g)
    comp = torch.randn(N, D, generator=g)
    pos = torch.arange(T)
    keep = torch.rand(T, N, generator=g) < 0.5
    sinks = torch.randn(H, generator=g)
    full = kernels.sink_attention(q, pos, kv, sinks, D ** -0.5, window=8, comp=comp, comp_keep=keep)
    for t in (0, 7, 8, 25, 39):  # one row alone, with only its prefix of keys: the same bits
        one = kernels.sink_attention(q[t : t + 1], pos[t : t + 1], kv[: t + 1], sinks, D ** -0.5, window=8,
                                     comp=comp, comp_keep=keep[t : t + 1])
        assert torch.equal(one[0], full[t]), t
    # entries after the last chosen one can be absent (a rollout's shorter history)
    last = int(keep[20].nonzero().max())
    short = kernels.sink_attention(q[20:21], pos[20:21], kv[:21], sinks, D ** -0.5, window=8,
                                   comp=comp[: last + 1], comp_keep=keep[20:21, : last + 1])
    assert torch.equal(short[0], full[20])
    ref = dsv4._sink_attention_ref(q, pos, kv, 8, comp, keep, sinks, D ** -0.5, torch.float32)
    assert (full - ref).abs().max() < 1e-5
    # differentiable (backward through the plain-torch reference)
    qg = q.clone().requires_grad_(True)
    kernels.sink_attention(qg, pos, kv, sinks, D ** -0.5, window=8, comp=comp, comp_keep=keep).sum().backward()
    assert torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0


def test_compressed_entries_of_a_prefix_are_the_first_entries_bitwise():
    g = _g(1)
    S, C = 37, 16
    kv, gate = torch.randn(S, C, generator=g), torch.randn(S, C, generator=g)
    ape = torch.randn(4, C, generator=g)
    for overlap in (False, True):
        full = kernels.compress_windows(kv, gate, ape, 4, overlap=overlap)
        assert full.shape == (S // 4, C // 2 if overlap else C)
        for L in (4, 5, 12, 33):
            part = kernels.compress_windows(kv[:L], gate[:L], ape, 4, overlap=overlap)
            assert torch.equal(part, full[: L // 4])


def test_hc_mix_comb_is_doubly_stochastic_and_rows_are_independent():
    g = _g(2)
    T, n, D = 6, 4, 16
    streams = torch.randn(T, n, D, generator=g)
    fn = torch.randn((2 + n) * n, n * D, generator=g) * 0.1
    base, scale = torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
    post, comb, collapsed = kernels.hc_mix(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(T, n), atol=1e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(T, n), atol=1e-3)
    assert ((post > 0) & (post < 2)).all()
    p1, c1, x1 = kernels.hc_mix(streams[3:4], fn, base, scale, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    assert torch.equal(p1[0], post[3]) and torch.equal(c1[0], comb[3]) and torch.equal(x1[0], collapsed[3])


def test_sqrtsoftplus_matches_torch_and_route_uses_it():
    x = torch.linspace(-30, 30, 1001)
    assert (kernels.sqrtsoftplus(x) - torch.nn.functional.softplus(x).sqrt()).abs().max() < 1e-6
    logits = torch.randn(5, 8, generator=_g(3))
    bias = torch.randn(8, generator=_g(4)) * 0.1
    ids, w = kernels.route(logits, 2, score="sqrtsoftplus", expert_bias=bias, norm_topk_prob=True, scaling_factor=1.5)
    s = torch.nn.functional.softplus(logits).sqrt()
    assert torch.equal(ids, torch.sort(s + bias, dim=-1, descending=True, stable=True).indices[:, :2])
    exp = s.gather(1, ids)
    assert torch.allclose(w, exp / exp.sum(-1, keepdim=True) * 1.5, atol=1e-6)
