"""The resharding plan (vllm_bridge/weights/reshard.py) and the learner's local pieces
(megatron_rz/learner/hf_convert.local_hf_pieces), without processes: intersections of learner
pieces with engine boxes (also across different split dimensions), the data-parallel duty split,
coverage (every element of every engine shard sent exactly once, by a rank that holds it), the
assembled shards and their checksums against the full tensors, and the one-line refusals.

Run: .venv/bin/python -m pytest tests/unit/test_reshard_plan.py -q
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from vllm_bridge.weights import reshard as R
from vllm_bridge.worker_ext import tensor_bits

ROOT = Path(__file__).resolve().parents[2]


def _split(shape, dim, parts, r):
    n = shape[dim] // parts
    return R.slice_box(shape, dim, r * n, n)


def _world(full: dict, learner, engine):
    """learner: {name: (dim | None, tp)} over 4 ranks = 2 TP x 2 DP replicas (rank = dp * 2 + tp_rank);
    name 'x*' experts: whole, held by the ranks of one EP index (rank % 2). engine: {name: (dim | None,
    tp)} at engine TP ``tp``. Returns (pieces per learner rank, layout, tensors by (rank, name, box))."""
    pieces, tensors = [[] for _ in range(4)], {}
    for rank in range(4):
        tp_rank = rank % 2
        for name, t in full.items():
            dim, tp = learner[name]
            if name.startswith("x") and int(name[1:]) % 2 != rank % 2:
                continue  # another expert-parallel rank's expert
            box = R.full_box(t.shape) if dim is None else _split(t.shape, dim, tp, tp_rank)
            pieces[rank].append(R.Piece(name, tuple(t.shape), box, "float32"))
            tensors[(rank, name, box)] = R.narrow(t, box)
    etp = next(iter(engine.values()))[1]
    layout = []
    for e in range(etp):
        lay = {}
        for name, t in full.items():
            dim, _ = engine[name]
            if name.startswith("x") and int(name[1:]) * etp // len([n for n in full if n.startswith("x")]) != e:
                continue  # routed experts split whole over the engine ranks
            box = R.full_box(t.shape) if dim is None else _split(t.shape, dim, etp, e)
            lay[name] = R.EngineParam(tuple(t.shape), box, "float32")
        layout.append(lay)
    return pieces, layout, tensors


def _model():
    g = torch.Generator().manual_seed(0)
    full = {"embed": torch.randn(16, 8, generator=g), "norm": torch.randn(8, generator=g),
            "q": torch.randn(16, 8, generator=g), "o": torch.randn(8, 16, generator=g)}
    full.update({f"x{i}": torch.randn(4, 8, generator=g) for i in range(4)})
    learner = {"embed": (0, 2), "norm": (None, 1), "q": (0, 2), "o": (0, 2)}  # o split by rows on the learner ...
    learner.update({f"x{i}": (None, 1) for i in range(4)})
    return full, learner


@pytest.mark.parametrize("etp", [1, 2, 4])
def test_plan_covers_every_engine_element_once(etp):
    full, learner = _model()
    engine = {"embed": (None, etp), "norm": (None, etp), "q": (0, etp), "o": (1, etp)}  # ... by columns on the engine
    engine.update({f"x{i}": (None, etp) for i in range(4)})
    pieces, layout, tensors = _world(full, learner, engine)
    transfers = R.plan(pieces, layout)
    held = {(r, p.name, p.box) for r, mine in enumerate(pieces) for p in mine}
    count = {(e, n): torch.zeros(R.box_shape(p.box), dtype=torch.int32) for e, lay in enumerate(layout)
             for n, p in lay.items()}
    load = [0] * 4
    for t in transfers:
        assert (t.sender, t.name, t.piece_box) in held  # sent by a rank that holds the piece ...
        assert R.contains(t.piece_box, t.box)  # ... cut from it
        R.narrow(count[(t.engine_rank, t.name)], R.relative(t.box, layout[t.engine_rank][t.name].box)).add_(1)
        load[t.sender] += t.nbytes
    assert all(bool((c == 1).all()) for c in count.values())  # every element exactly once
    assert sum(load) == sum(R.engine_shard_bytes(layout))
    assert min(load) > 0 and max(load) <= 1.5 * sum(load) / 4, load  # the duty is spread over the DP replicas
    # o: learner row blocks x engine column blocks -> 2-D boxes
    o = [t for t in transfers if t.name == "o" and t.engine_rank == 0]
    assert len(o) == 2 and all(R.box_shape(t.box) == (4, 16 // etp) for t in o)
    # the parts assemble to each engine worker's shard; their checksums add up to the shard's
    per_rank: dict = {}
    sent = [R.narrow(tensors[(t.sender, t.name, t.piece_box)], R.relative(t.box, t.piece_box)) for t in transfers]
    for t, x in zip(transfers, sent):
        per_rank.setdefault(t.engine_rank, {})[R.box_key(t.name, t.box)] = x.clone()
    expected = R.expected_checksums(transfers, sent, layout)
    for e, lay in enumerate(layout):
        shard = R.assemble(per_rank[e], lay)
        assert set(shard) == set(lay)
        for n, p in lay.items():
            assert torch.equal(shard[n], R.narrow(full[n], p.box))
            assert (tensor_bits(shard[n]) - expected[(e, n)]) % (1 << 64) == 0
    reported = [{n: {"shape": list(R.box_shape(p.box)), "bits": tensor_bits(R.narrow(full[n], p.box))}
                 for n, p in lay.items()} for lay in layout]
    assert R.check_resharded(expected, reported, layout, 1)["checked"] == sum(len(lay) for lay in layout)
    flipped = [dict(r) for r in reported]
    flipped[-1]["norm"] = dict(flipped[-1]["norm"], bits=flipped[-1]["norm"]["bits"] + 1)
    from vllm_bridge.weights.buckets import WeightSyncError

    with pytest.raises(WeightSyncError, match="norm"):
        R.check_resharded(expected, flipped, layout, 1)


def test_plan_refusals():
    full, learner = _model()
    engine = {n: (None, 2) for n in full}
    pieces, layout, _ = _world(full, learner, engine)
    lay = [dict(x) for x in layout]
    lay[1]["extra"] = R.EngineParam((3,), R.full_box((3,)), "float32")
    with pytest.raises(ValueError, match="engine rank 1 holds extra, which no learner rank holds"):
        R.plan(pieces, lay)
    lay = [dict(x) for x in layout]
    lay[0]["q"] = R.EngineParam((16, 9), R.full_box((16, 9)), "float32")
    with pytest.raises(ValueError, match="q is"):
        R.plan(pieces, lay)
    gap = [[p for p in mine if not (p.name == "q" and p.box[0][0] == 8)] for mine in pieces]
    with pytest.raises(ValueError, match="q .*cover 64 of its 128"):
        R.plan(gap, layout)
    odd = [list(mine) for mine in pieces]
    odd[0].append(R.Piece("q", (16, 8), R.slice_box((16, 8), 0, 4, 8), "float32"))
    with pytest.raises(ValueError, match="pieces of q overlap"):
        R.plan(odd, layout)


def test_assemble_refuses_bad_parts():
    lay = {"w": R.EngineParam((8, 4), R.slice_box((8, 4), 0, 4, 4), "float32")}
    with pytest.raises(ValueError, match="outside"):
        R.assemble({"w@0:4,0:4": torch.zeros(4, 4)}, lay)
    with pytest.raises(ValueError, match="do not cover"):
        R.assemble({"w@4:6,0:4": torch.zeros(2, 4)}, lay)
    with pytest.raises(ValueError, match="not a parameter"):
        R.assemble({"v@0:1": torch.zeros(1)}, lay)
    out = R.assemble({"w@4:6,0:4": torch.ones(2, 4), "w@6:8,0:4": torch.full((2, 4), 2.0)}, lay)
    assert torch.equal(out["w"], torch.tensor([[1.0] * 4] * 2 + [[2.0] * 4] * 2))
    assert R.parse_key(R.box_key("a.b@c", ((0, 3), (1, 2)))) == ("a.b@c", ((0, 3), (1, 2)))


def test_local_pieces_at_tp2_ep2_rebuild_the_checkpoint(monkeypatch):
    """hf_convert.local_hf_pieces on every rank of a TP=2 x EP=2 layout (the rank's Megatron shards
    made with the loader's own conversion, hf_convert._shard) tile every HF tensor exactly: fused
    QKV by query groups, gated [gate; up], row / column blocks, vocab-parallel embedding, experts."""
    from megatron_rz.learner import hf_convert as H
    from megatron_rz.learner.tiny_models import make_random_checkpoint
    from megatron_rz.recipe import load_recipe

    recipe = load_recipe(str(ROOT / "recipes" / "tiny_moe.yaml"), ["model.num_kv_heads=2"])
    m = recipe.model
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        make_random_checkpoint(recipe, Path(d))
        sd = load_file(str(next(Path(d).glob("*.safetensors"))))
    tp = ep = 2
    per = m.num_experts // ep
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    for i in range(m.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + s for s in ("input_layernorm.weight", "pre_mlp_layernorm.weight",
                                  "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
                                  "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
                                  "mlp.router.weight")]
        names += [p + f"mlp.experts.local_experts.{j}.linear_fc{k}.weight" for j in range(per) for k in (1, 2)]
    names = [n for n in names if not (n == "output_layer.weight" and "lm_head.weight" not in sd)]

    class Fake:
        def __init__(self, params):
            self.params = params

        def named_parameters(self):
            return iter(self.params)

        def named_buffers(self):
            return iter(())

    rebuilt = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    seen = {k: 0 for k in sd}
    for tp_rank, ep_rank in itertools.product(range(tp), range(ep)):
        params = []
        for n in names:
            rule = H._rule(n, m, ep_rank, per)
            full = H._full_from_hf(rule, [sd[k] for k in rule.hf_names], m)
            params.append((n, H._shard(rule, full, 1 if rule.expert else tp, tp_rank)))
        monkeypatch.setattr(H, "_ctx", lambda tr=tp_rank, er=ep_rank: (tp, tr, None, 1, 0, None, ep, er, None))
        for hf, piece, shape, box in H.local_hf_pieces(Fake(params), m):
            assert tuple(sd[hf].shape) == shape and tuple(piece.shape) == R.box_shape(box), hf
            R.narrow(rebuilt[hf], box).copy_(piece)
            seen[hf] += R.box_numel(box)
    for k, v in sd.items():
        assert torch.equal(rebuilt[k], v), k
        # replicated tensors and experts are held by several ranks; TP blocks once per EP replica
        assert seen[k] % v.numel() == 0 and seen[k] > 0, k
    with pytest.raises(ValueError, match="model.arch=deepseek_v4"):
        next(H.local_hf_pieces(Fake([]), m.model_copy(update={"arch": "deepseek_v4"})))
