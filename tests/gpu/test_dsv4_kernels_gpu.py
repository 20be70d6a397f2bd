"""DeepSeek-V4's aligned ops on CUDA, without vLLM: the invariances the aligned engine and the learner
rely on, checked where they run on the GPU. Needs only torch and Triton (the GPU machine's image), so a
session's first call runs it before vLLM is staged.

On the H100 (2026-12-07) the CUDA V4 engine was not bitwise with the learner (decode 277 of 1,536
sampled logprobs equal) and not decode == prefill, while every CPU test (interpreted Triton included)
is bitwise; `rz check`'s localiser put the first difference at layer 0's attention output, position
0, one bf16 ulp. Each test here is one property the engine's answer depends on, on the GPU, in bf16
(what the engine and the learner run), and its failure message names the first tap that breaks it:

* the attention core (``kernels.sink_attention``): a row alone, with only its prefix of keys and only
  the compressed entries up to its last chosen one, equals that row in the full call;
* per-token attention inputs (``token_state``: q, the key/value payload, the indexer's query and
  weights) and the hyper-connection mix: a row alone equals the row in a batch (GEMM row invariance
  at V4's shapes, fp32 GEMMs included), at CFG's sizes and at recipes/tiny_dsv4.yaml's, for single
  rows and for chunks of 2-17 rows, tap by tap (on the H200, 2026-12-07, the localiser put the
  engine's first difference at the query, ``layer0.attn_q``, with its input equal, while these tests,
  then at the small sizes only and single rows, passed);
* compressed entries: the bytes the engine stores (``stored_entries``, stock's fp8 format and the
  model dtype), read back (``unpack_entries``), equal what the learner pools (``layer_entries``),
  also when pooled step by step from the rows after earlier entries (``first > 0``), as the engine does;
* the whole reference forward: the logits of every prefix of a sequence equal the first rows of the
  full sequence's (decode == prefill for the layer functions both sides call).
"""

import dataclasses

import pytest
import torch

from gpu_util import need_cuda

pytestmark = pytest.mark.gpu

# A tiny DeepSeek-V4 in DeepSeek's config.json spelling: layer kinds compressed sparse (x4, indexer
# top-3), heavily compressed (x128), sliding window only, compressed sparse; window 16; hash routing
# in the first two layers. The sizes are megatron_rz.learner.tiny_models.TINY_DSV41's without the
# engram, spelled out here because that module imports the recipe (pydantic), which the GPU
# machine's bare image lacks (it arrives with vLLM's staged wheels), and this file runs before them.
CFG = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=4, compress_ratios=[4, 128, 0, 4], num_hash_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
    o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    sliding_window=16, index_n_heads=16, index_head_dim=16, index_topk=3, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, routed_scaling_factor=1.5,
    swiglu_limit=10.0, tie_word_embeddings=False, num_nextn_predict_layers=0,
)
SEQ = 300  # past the window, several x4 entries and two x128 entries


def _config():
    from kernels.models import dsv4 as R

    return R.v4_config(CFG)


def _state_dict(c, dtype=torch.bfloat16, seed=0) -> dict:
    """Random original-named weights on CUDA: model-dtype tensors in ``dtype``, DeepSeek's fp32 ones in
    fp32 (both drawn through bf16, as a bf16 checkpoint stores them); hash tables with distinct experts."""
    from kernels.models import dsv4 as R

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (shape, kind) in R.parameter_shapes(c).items():
        if kind == "int64":
            sd[name] = torch.rand(shape[0], c.num_experts, generator=g).argsort(dim=1)[:, : shape[1]].contiguous()
        else:
            v = (torch.randn(shape, generator=g) * (0.3 if len(shape) < 2 else 0.15)).to(torch.bfloat16)
            sd[name] = v.to(torch.float32 if kind == "fp32" else dtype)
    return {k: v.cuda() for k, v in sd.items()}


def _getter(sd, layer):
    return lambda n, p=f"layers.{layer}.": sd[p + n]


def _first_diff(a: dict, b: dict, rows: slice) -> str:
    """The first tap (recorded order of ``a``) whose rows ``rows`` differ between two traces."""
    for name, x in a.items():
        if name not in b:
            continue
        x, y = x[rows], b[name][: x[rows].shape[0]]
        if x.shape != y.shape or not torch.equal(x, y):
            d = float((x.float() - y.float()).abs().max()) if x.shape == y.shape else float("nan")
            bad = (x != y).reshape(x.shape[0], -1).any(dim=1).nonzero().flatten().tolist() if x.shape == y.shape else []
            return f"first differing tap {name}: rows {bad[:8]}, max |d| {d:.3g}"
    return "every tap equal (the difference is after the last tap)"


def _traced(fn):
    from kernels.models import trace

    trace.start_trace()
    try:
        out = fn()
    finally:
        records = trace.stop_trace()
    taps: dict = {}
    for name, x in records:
        taps.setdefault(name, []).append(x.reshape(x.shape[0], -1))
    return out, {k: torch.cat(v) for k, v in taps.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sink_attention_rows_alone_equal_rows_in_batch_on_cuda(dtype):
    need_cuda()
    import kernels

    g = torch.Generator().manual_seed(0)
    T, H, D, N, W = 200, 4, 32, 40, 16
    q = torch.randn(T, H, D, generator=g).to(dtype).cuda()
    kv = torch.randn(T, D, generator=g).to(dtype).cuda()
    comp = torch.randn(N, D, generator=g).to(dtype).cuda()
    pos = torch.arange(T).cuda()
    keep = (torch.rand(T, N, generator=g) < 0.3).cuda()
    keep[:8] = False  # the first rows see no entry (as before the first window completes)
    sinks = (torch.randn(H, generator=g) * 2).cuda()
    full = kernels.sink_attention(q, pos, kv, sinks, D ** -0.5, window=W, comp=comp, comp_keep=keep)
    for t in (0, 1, 2, 7, 15, 16, 17, 63, 128, 199):
        one = kernels.sink_attention(q[t : t + 1], pos[t : t + 1], kv[: t + 1], sinks, D ** -0.5, window=W,
                                     comp=comp, comp_keep=keep[t : t + 1])
        assert torch.equal(one[0], full[t]), (t, float((one[0].float() - full[t].float()).abs().max()))
        # the engine's keys: zeros outside the window, and only the entries up to the last chosen one
        keys = torch.zeros_like(kv[: t + 1])
        keys[max(0, t - W + 1) :] = kv[max(0, t - W + 1) : t + 1]
        chosen = keep[t].nonzero()
        n = int(chosen.max()) + 1 if chosen.numel() else 0
        eng = kernels.sink_attention(q[t : t + 1], pos[t : t + 1], keys, sinks, D ** -0.5, window=W,
                                     comp=comp[:n] if n else None, comp_keep=keep[t : t + 1, :n] if n else None)
        assert torch.equal(eng[0], full[t]), (t, float((eng[0].float() - full[t].float()).abs().max()))


# recipes/tiny_dsv4.yaml's sizes (the model `rz check tiny_dsv4` runs): its GEMMs have other shapes than
# CFG's (wq_a 256 -> 128, wq_b 128 -> 16 x 512, wkv 256 -> 512, the indexer's 64 x 128 heads), so the
# GEMM picks another tile per row count (kernels.triton.gemm.pick_config) than at CFG's sizes
TINY_DSV4 = dict(CFG, vocab_size=384, hidden_size=256, num_attention_heads=16, head_dim=512, qk_rope_head_dim=64,
                 q_lora_rank=128, o_lora_rank=64, n_routed_experts=64, num_experts_per_tok=6,
                 moe_intermediate_size=128, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512)


# (whole call's rows, the slices computed alone): the engine's decode rows and prefill chunks inside
# a learner's call of 57 rows (one sequence) and of 300 rows (a micro-batch of 16 short sequences,
# where the GEMM picks a larger tile than at 57 rows; `rz check tiny_dsv4` runs such micro-batches)
ROW_PLANS = {57: ((0, 1), (1, 2), (2, 3), (5, 6), (31, 32), (56, 57), (5, 13), (1, 17), (40, 57)),
             300: ((0, 1), (0, 3), (0, 40), (3, 11), (40, 140), (17, 241), (299, 300))}


@pytest.mark.parametrize("T", sorted(ROW_PLANS))
@pytest.mark.parametrize("sizes", ["small", "tiny_dsv4"])
def test_token_state_rows_alone_and_in_chunks_equal_rows_of_the_whole_call_on_cuda(sizes, T):
    """The engine's row counts: single decode rows, a few concurrent decode rows, a prefill chunk; each
    row of token_state (query and its steps, key row, indexer) equals the row of the whole call
    (the learner's), tap by tap, at CFG's sizes and at the recipe's."""
    need_cuda()
    from kernels.models import dsv4 as R

    c = _config() if sizes == "small" else R.v4_config(TINY_DSV4)
    sd = _state_dict(c)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(T, c.hidden_size, generator=g) * 0.5).to(torch.bfloat16).cuda()
    pos = torch.arange(T).cuda()
    for layer in range(c.num_layers):
        w = _getter(sd, layer)
        full, ftaps = _traced(lambda: R.token_state(c, w, layer, x, pos))
        for a, b in ROW_PLANS[T]:
            part, ptaps = _traced(lambda: R.token_state(c, w, layer, x[a:b], pos[a:b]))
            rows = {k: v[a:b] for k, v in ftaps.items()}
            bad = [k for k in ptaps if not torch.equal(ptaps[k], rows[k])]
            bad += [k for k in full if not torch.equal(part[k], full[k][a:b])]
            assert not bad, (layer, (a, b), bad, _first_diff(ptaps, rows, slice(0, b - a)))


def test_hc_mix_rows_alone_equal_rows_in_batch_on_cuda():
    need_cuda()
    import kernels
    from kernels.models import dsv4 as R

    c = _config()
    sd = _state_dict(c)
    g = torch.Generator().manual_seed(1)
    streams = (torch.randn(57, c.hc_mult, c.hidden_size, generator=g) * 0.5).to(torch.bfloat16).cuda()
    args = R.hc_args(c, _getter(sd, 0), "attn")
    kw = dict(sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps, norm_eps=c.rms_norm_eps)
    full = kernels.hc_mix(streams, *args, **kw)
    for t in (0, 1, 30, 56):
        one = kernels.hc_mix(streams[t : t + 1], *args, **kw)
        for a, b in zip(one, full):
            assert torch.equal(a[0], b[t]), t


@pytest.mark.parametrize("fmt", ["fp8", "model"])
def test_stored_entries_read_back_as_the_learner_pools_them_on_cuda(fmt):
    need_cuda()
    from kernels.models import dsv4 as R

    c = dataclasses.replace(_config(), kv_entries=fmt)
    sd = _state_dict(c)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(SEQ, c.hidden_size, generator=g) * 0.5).to(torch.bfloat16).cuda()
    pos = torch.arange(SEQ).cuda()
    for layer in range(c.num_layers):
        r = c.compress_ratios[layer]
        if not r:
            continue
        w = _getter(sd, layer)
        rows = R.token_state(c, w, layer, x, pos)["payload"]
        want = R.layer_entries(c, w, layer, rows, torch.bfloat16)
        got = R.unpack_entries(c, layer, R.stored_entries(c, w, layer, rows, torch.bfloat16), torch.bfloat16)
        for a, b in zip(got, want):
            if b is not None:
                assert torch.equal(a, b), (layer, float((a.float() - b.float()).abs().max()))
        # step by step, as the engine pools them: entries `old ..` from the rows after the earlier ones
        csa = c.layer_kinds[layer] == R.CSA
        n = SEQ // r
        for old in range(1, n):
            start = r * (old - 1) if csa else r * old
            part = R.unpack_entries(c, layer, R.stored_entries(c, w, layer, rows[start : n * r], torch.bfloat16,
                                                               first=old), torch.bfloat16)
            for a, b in zip(part, want):
                if b is not None:
                    assert torch.equal(a, b[old:n]), (layer, old)


def test_reference_forward_prefix_logits_equal_the_full_sequence_rows_on_cuda():
    """Decode == prefill for the layer functions both sides call: each prefix's logits are bitwise
    the first rows of the full sequence's (the failure names the first differing tap)."""
    need_cuda()
    from kernels.models import dsv4 as R

    c = _config()
    sd = _state_dict(c)
    ids = torch.randint(2, c.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(3))
    full, full_taps = _traced(lambda: R.reference_logits(sd, c, ids[None]))
    assert full.is_cuda
    for L in (1, 2, 3, 5, 16, 17, 129, 257):
        part, part_taps = _traced(lambda L=L: R.reference_logits(sd, c, ids[None, :L]))
        if not torch.equal(part[0], full[0, :L]):
            pytest.fail(f"prefix {L}: logits differ from the full sequence's rows; "
                        + _first_diff(part_taps, full_taps, slice(0, L)))
