"""Where do vLLM and the learner first leave the reference forward? (`rz check`, aligned mode)

Three traces of the same token sequence, tap by tap in forward order
(layer{i}.attn_norm, .attention, .attn_out, .mlp_norm, .mlp, .output, ..., final_norm):
- the reference: kernels.models.qwen3_dsv3 run on the full sequence (its `tap` calls);
- vLLM: the same sequence generated ALONE by the aligned engine with its taps recording (prefill
  rows, then one row per decode step; see RolloutEngine.traced_generate), so the prefill and
  decode paths are both covered;
- the learner: Megatron module forward hooks on the matching modules (tp = 1; with tp > 1 the
  activations are sharded and the learner side is skipped with a note).
Families with their own learner module (DeepSeek-V4 / V4.1, Kimi: kernels/families.py ``learner``)
run the reference's layer functions in the learner and in the vLLM class alike, so both record the
same taps themselves; there the learner is the reference vLLM is compared with (its own full
forward, the bits `rz check` compares), and the report names where vLLM first leaves it.
After the forward taps come the two output stages, at the response positions only: `logits` (the
fp32 lm-head output that predicts each response token; vLLM records it in its sampler) and
`sampling` (logits -> the processed logprob of the sampled token: temperature, top-k, top-p,
kernels.sampled_logprobs; vLLM's is the logprob it reported, the learner's is Learner.logprobs
with the recipe's sampling settings, the reference's is kernels.sampled_logprobs on the reference
logits). So a mismatch in the sampling post-processing is named `sampling`, with every forward tap
and the logits equal.
The first tap where a side is not torch.equal to the reference names the op that diverges; its
max |diff| and first position say how and where. A side equal at every tap while the batched
check still differs points at batch variance (the divergence needs other sequences in the batch).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# attn_rope .. attn_idx_w: DeepSeek-V4's per-token attention inputs (kernels.models.dsv4.token_state),
# between the block's norm and its attention output, in the order they are made: the RoPE tables
# (cos | sin of the token's position), the query's steps (wq_a, q_norm, wq_b, then the per-head norm
# and RoPE: attn_q), the key = value row, the indexer's query and weights. Families that do not
# record them skip them.
TAPS_PER_LAYER = ("attn_norm", "attn_rope", "attn_q_a", "attn_q_res", "attn_q_b", "attn_q", "attn_kv", "attn_idx_q",
                  "attn_idx_w", "attention", "attn_out", "mlp_norm", "mlp", "output")


OUTPUT_TAPS = ("logits", "sampling")
TAP_MEANING = {"sampling": "sampling (logits -> processed logprobs: temperature, top-k, top-p)"}


def tap_order(num_layers: int) -> list[str]:
    return [f"layer{i}.{t}" for i in range(num_layers) for t in TAPS_PER_LAYER] + ["final_norm", *OUTPUT_TAPS]


def rows_by_tap(records) -> dict[str, torch.Tensor]:
    """[(name, tensor with rows first)] in call order -> {name: [rows, features]} (rows concatenated)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, x in records:
        out.setdefault(name, []).append(x.reshape(x.shape[0], -1).float())
    return {k: torch.cat(v, dim=0) for k, v in out.items()}


def reference_trace(base: str, ids: list[int], dtype: str = "float32", prompt_len: int | None = None,
                    sampling: dict | None = None) -> dict[str, torch.Tensor]:
    """The reference's taps for one sequence, in the model dtype both engines run (``dtype``; the
    checkpoint may be stored in another). With ``prompt_len`` also the output taps (logits and
    sampling at the response positions, ``sampling`` = the recipe's contract settings)."""
    import kernels
    from transformers import AutoConfig

    from kernels.models import qwen3_dsv3 as ref
    from kernels.models import trace

    c = ref.arch_config(AutoConfig.from_pretrained(base))
    dt = getattr(torch, dtype)
    # As the engines load it: floating weights in the model dtype, DeepSeek's score bias kept fp32.
    sd = {k: (v.to(dt) if v.is_floating_point() and not k.endswith("e_score_correction_bias") else v)
          for k, v in ref.load_state_dict(base).items()}
    trace.start_trace()
    try:
        ref.reference_hidden(c, sd, torch.tensor([ids]))
    finally:
        records = trace.stop_trace()
    out = rows_by_tap(records)
    if prompt_len is not None and prompt_len < len(ids):
        logits = ref.reference_logits(sd, c, torch.tensor([ids]))[0, prompt_len - 1 : len(ids) - 1].float()
        out["logits"] = logits
        out["sampling"] = kernels.sampled_logprobs(
            logits, torch.tensor(ids[prompt_len:]), **(sampling or {})).reshape(-1, 1)
    return out


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
    if getattr(model, "output_layer", None) is not None:
        handles.append(model.output_layer.register_forward_hook(hook("logits")))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def learner_trace(learner, ids: list[int], prompt_len: int | None = None,
                  sampling: dict | None = None) -> dict[str, torch.Tensor] | None:
    """Collective (every learner rank calls it). None when tp > 1 (sharded activations). With
    ``prompt_len`` the output taps are kept at the response positions only (as vLLM's)."""
    if learner.tp > 1:
        return None
    records: list = []
    if hasattr(learner.model, "decoder"):  # Megatron's GPTModel: hooks on its modules
        with _learner_hooks(learner.model, records):
            logp = learner.logprobs(torch.tensor([ids]), micro_batch_size=1, **(sampling or {}))
    else:  # an own learner module running kernels.models code: its taps record themselves
        from kernels.models import trace

        trace.start_trace()
        try:
            logp = learner.logprobs(torch.tensor([ids]), micro_batch_size=1, **(sampling or {}))
        finally:
            records = trace.stop_trace()
    S = len(ids)
    out = {k: v[:S] for k, v in rows_by_tap(records).items()}
    if prompt_len is not None and prompt_len < S:
        if "logits" in out:
            out["logits"] = out["logits"][prompt_len - 1 : S - 1]
        out["sampling"] = logp[0, prompt_len:S].reshape(-1, 1).float()
    else:
        out.pop("logits", None)
    return out


# what a divergence record carries of the first differing row: up to this many differing elements, and
# the input tap's whole row (the tap just before, equal on both sides) up to this many values
DIFF_ELEMENTS = 8
INPUT_ROW_MAX = 8192


def first_divergence(ref: dict[str, torch.Tensor], side: dict[str, torch.Tensor], order: list[str]) -> dict:
    """The first tap (in forward order) where `side` is not bitwise equal to `ref`. Besides where and
    by how much, the record holds what an offline recomputation of that one row needs: the differing
    elements of its first differing position (`differing_elements`: [column, reference, side], in
    the tap's dtype widened to float64, at most DIFF_ELEMENTS) and the row of the tap before it
    (`input_tap`, `input_row`: equal on both sides, so the reference's), e.g. a GEMM's input row when
    the diverging tap is its output."""
    compared = 0
    prev = None
    for name in order:
        if name not in ref or name not in side:
            continue
        n = min(ref[name].shape[0], side[name].shape[0])
        a, b = ref[name][:n].cpu(), side[name][:n].cpu()  # taps of a CUDA side vs a CPU reference
        if a.shape != b.shape:
            return {"first_diverging_tap": name, "reason": f"shape {tuple(b.shape)} vs reference {tuple(a.shape)}"}
        compared += 1
        if not torch.equal(a, b):
            bad = (a != b).reshape(n, -1).any(dim=1).nonzero()
            pos = int(bad[0])
            ra, rb = a[pos].reshape(-1), b[pos].reshape(-1)
            cols = (ra != rb).nonzero().flatten()[:DIFF_ELEMENTS].tolist()
            out = {
                "first_diverging_tap": name,
                "first_position": pos,
                "positions_differing": int(bad.numel()),
                "max_abs_diff": float((a.double() - b.double()).abs().max()),
                "taps_equal_before": compared - 1,
                "dtype": str(a.dtype).removeprefix("torch."),
                "differing_elements": [[c, float(ra[c]), float(rb[c])] for c in cols],
            }
            if prev is not None and pos < ref[prev].shape[0]:
                row = ref[prev][pos].cpu().reshape(-1)
                out["input_tap"] = prev
                out["input_row"] = row.double().tolist() if row.numel() <= INPUT_ROW_MAX else f"{row.numel()} values"
            return out
        prev = name
    return {"first_diverging_tap": None, "taps_compared": compared}


def _vllm_against_learner(seq: list[int], vllm_taps: dict, learner_taps: dict | None, order: list[str]) -> dict:
    """Localisation for a family with its own learner module: vLLM's taps against the learner's."""
    report = {"sequence_tokens": len(seq), "against": "learner"}
    if learner_taps is None:
        report["vllm"] = {"skipped": "learner taps are sharded at tp > 1; rerun rz check with parallel.tp=1"}
        report["summary"] = "vLLM not traced against the learner (tp > 1)"
        return report
    d = first_divergence(learner_taps, vllm_taps, order)
    report["vllm"] = d
    if d["first_diverging_tap"] is None:
        report["summary"] = ("vLLM equals the learner at every tap (replayed alone: the mismatch needs other "
                             "sequences in the batch, i.e. a batch-variant op)")
    else:
        tap = d["first_diverging_tap"]
        report["summary"] = f"vLLM leaves the learner first at {TAP_MEANING.get(tap, tap)}"
    return report


def localise(learner, side, base, recipe, prompt_ids: list[int] | None, vllm_sampling: dict | None = None,
             learner_sampling: dict | None = None) -> dict:
    """Collective. Rank 0 (which owns `side`, the rollout) passes the prompt of a mismatching
    sample; returns the report on rank 0 ({} elsewhere). ``vllm_sampling`` / ``learner_sampling``:
    the sampling settings each side ran with (default: the recipe's; they differ only under an
    injected sampling fault); the reference uses the recipe's contract."""
    from megatron_rz.learner.ranks import broadcast_object

    order = tap_order(recipe.model.num_layers)
    contract = recipe.rollout.sampling_contract()
    seq, vllm_taps = None, None
    if side is not None:
        kw = dict(vllm_sampling or recipe.rollout.sampling_kwargs())
        sample, trace = side.engine.traced_generate(prompt_ids, max_new_tokens=recipe.rollout.max_new_tokens,
                                                    seed=12345, **kw)
        seq = list(prompt_ids) + list(sample.response_ids)
        vllm_taps = rows_by_tap(trace)
        if sample.response_ids:  # the logprobs vLLM reported: its sampling stage
            vllm_taps["sampling"] = torch.tensor(sample.logprobs, dtype=torch.float32).reshape(-1, 1)
    seq = broadcast_object(seq)
    prompt_len = len(prompt_ids) if prompt_ids is not None else None
    prompt_len = broadcast_object(prompt_len)
    learner_taps = learner_trace(learner, seq, prompt_len, learner_sampling or contract)
    if side is None:
        return {}
    from kernels.families import family

    if family(recipe.model.arch).learner is not None:
        return _vllm_against_learner(seq, vllm_taps, learner_taps, order)
    ref = reference_trace(str(base), seq, recipe.model.dtype, prompt_len, contract)
    report = {"sequence_tokens": len(seq), "vllm": first_divergence(ref, vllm_taps, order)}
    report["learner"] = (first_divergence(ref, learner_taps, order) if learner_taps is not None
                         else {"skipped": "learner taps are sharded at tp > 1; rerun rz check with parallel.tp=1"})

    def verdict(d: dict) -> str:
        if "skipped" in d:
            return "not traced"
        if d["first_diverging_tap"] is None:
            return "equals the reference at every tap"
        tap = d["first_diverging_tap"]
        return f"diverges first at {TAP_MEANING.get(tap, tap)}"
    report["summary"] = f"vLLM {verdict(report['vllm'])}; learner {verdict(report['learner'])}"
    if all(report[w].get("first_diverging_tap", 0) is None for w in ("vllm", "learner")):
        report["summary"] += (" (replayed alone, both sides match: the mismatch needs other sequences in the "
                              "batch, i.e. a batch-variant op)")
    return report
