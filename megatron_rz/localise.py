"""Where do vLLM and the learner first leave the reference forward? (`rz check`, aligned mode)

Three traces of the same token sequence, tap by tap in forward order
(layer{i}.attn_norm, .attention, .attn_out, .mlp_norm, .mlp, .output, ..., final_norm):
- the reference: vllm_bridge.aligned.reference run on the full sequence (its `tap` calls);
- vLLM: the same sequence generated ALONE by the aligned engine with its taps recording (prefill
  rows, then one row per decode step; see RolloutEngine.traced_generate), so the prefill and
  decode paths are both covered;
- the learner: Megatron module forward hooks on the matching modules (tp = 1; with tp > 1 the
  activations are sharded and the learner side is skipped with a note).
The first tap where a side is not torch.equal to the reference names the op that diverges; its
max |diff| and first position say how and where. A side equal at every tap while the batched
check still differs points at batch variance (the divergence needs other sequences in the batch).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

TAPS_PER_LAYER = ("attn_norm", "attention", "attn_out", "mlp_norm", "mlp", "output")


def tap_order(num_layers: int) -> list[str]:
    return [f"layer{i}.{t}" for i in range(num_layers) for t in TAPS_PER_LAYER] + ["final_norm"]


def rows_by_tap(records) -> dict[str, torch.Tensor]:
    """[(name, tensor with rows first)] in call order -> {name: [rows, features]} (rows concatenated)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, x in records:
        out.setdefault(name, []).append(x.reshape(x.shape[0], -1).float())
    return {k: torch.cat(v, dim=0) for k, v in out.items()}


def reference_trace(base: str, ids: list[int]) -> dict[str, torch.Tensor]:
    """The reference's taps for one sequence."""
    from transformers import AutoConfig

    from vllm_bridge.aligned import reference as ref

    c = ref.arch_config(AutoConfig.from_pretrained(base))
    sd = ref.load_state_dict(base)
    ref.TRACE = []
    try:
        ref.reference_hidden(c, sd, torch.tensor([ids]))
        records = ref.TRACE
    finally:
        ref.TRACE = None
    return rows_by_tap(records)


@contextmanager
def _learner_hooks(model, records: list):
    """Forward hooks on the Megatron modules that correspond to the reference's taps."""
    def hook(name):
        def fn(_mod, _inp, out):
            x = out[0] if isinstance(out, tuple) else out
            s, b = x.shape[0], x.shape[1]
            records.append((name, x.detach().reshape(s, b, -1)[:, 0].clone()))
        return fn

    handles = []
    for i, layer in enumerate(model.decoder.layers):
        mods = {
            "attn_norm": layer.input_layernorm,
            "attention": layer.self_attention.core_attention,
            "attn_out": layer.self_attention,
            "mlp_norm": layer.pre_mlp_layernorm,
            "mlp": layer.mlp,
            "output": layer,
        }
        for t, m in mods.items():
            handles.append(m.register_forward_hook(hook(f"layer{i}.{t}")))
    handles.append(model.decoder.final_layernorm.register_forward_hook(hook("final_norm")))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def learner_trace(learner, ids: list[int]) -> dict[str, torch.Tensor] | None:
    """Collective (every learner rank calls it). None when tp > 1 (sharded activations)."""
    if learner.tp > 1:
        return None
    records: list = []
    with _learner_hooks(learner.model, records):
        learner.logprobs(torch.tensor([ids]), micro_batch_size=1)
    S = len(ids)
    return {k: v[:S] for k, v in rows_by_tap(records).items()}


def first_divergence(ref: dict[str, torch.Tensor], side: dict[str, torch.Tensor], order: list[str]) -> dict:
    """The first tap (in forward order) where `side` is not bitwise equal to `ref`."""
    compared = 0
    for name in order:
        if name not in ref or name not in side:
            continue
        n = min(ref[name].shape[0], side[name].shape[0])
        a, b = ref[name][:n], side[name][:n]
        if a.shape != b.shape:
            return {"first_diverging_tap": name, "reason": f"shape {tuple(b.shape)} vs reference {tuple(a.shape)}"}
        compared += 1
        if not torch.equal(a, b):
            bad = (a != b).any(dim=1).nonzero()
            return {
                "first_diverging_tap": name,
                "first_position": int(bad[0]),
                "positions_differing": int(bad.numel()),
                "max_abs_diff": float((a - b).abs().max()),
                "taps_equal_before": compared - 1,
            }
    return {"first_diverging_tap": None, "taps_compared": compared}


def localise(learner, side, base, recipe, prompt_ids: list[int] | None) -> dict:
    """Collective. Rank 0 (which owns `side`, the rollout) passes the prompt of a mismatching
    sample; returns the report on rank 0 ({} elsewhere)."""
    from megatron_rz.trainer import _broadcast

    order = tap_order(recipe.model.num_layers)
    seq, vllm_taps = None, None
    if side is not None:
        r = recipe.rollout
        sample, trace = side.engine.traced_generate(
            prompt_ids, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=12345)
        seq = list(prompt_ids) + list(sample.response_ids)
        vllm_taps = rows_by_tap(trace)
    seq = _broadcast(seq)
    learner_taps = learner_trace(learner, seq)
    if side is None:
        return {}
    ref = reference_trace(str(base), seq)
    report = {"sequence_tokens": len(seq), "vllm": first_divergence(ref, vllm_taps, order)}
    report["learner"] = (first_divergence(ref, learner_taps, order) if learner_taps is not None
                         else {"skipped": "learner taps are sharded at tp > 1; rerun rz check with parallel.tp=1"})

    def verdict(d: dict) -> str:
        if "skipped" in d:
            return "not traced"
        if d["first_diverging_tap"] is None:
            return "equals the reference at every tap"
        return f"diverges first at {d['first_diverging_tap']}"
    report["summary"] = f"vLLM {verdict(report['vllm'])}; learner {verdict(report['learner'])}"
    if all(report[w].get("first_diverging_tap", 0) is None for w in ("vllm", "learner")):
        report["summary"] += (" (replayed alone, both sides match: the mismatch needs other sequences in the "
                              "batch, i.e. a batch-variant op)")
    return report
