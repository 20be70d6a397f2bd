"""Streaming generation with in-flight weight swaps, on top of a RolloutEngine.

``StreamingGenerator(engine)`` drives vLLM's own engine API -- ``llm.llm_engine.add_request`` and
``llm.llm_engine.step()`` -- instead of the blocking ``LLM.generate``: requests are submitted at any
time, each ``step()`` returns the prompt groups that finished in that engine step, and between two
steps the weights can be replaced in place (``swap_weights``) while requests are in flight.

Per-token versions come from vLLM itself. vLLM 0.32's engine core labels every engine step's output
with its current weight version (``EngineCore.set_weight_version``; ``EngineCoreOutputs.weight_version``)
and the output processor turns the labels into ``CompletionOutput.weight_versions`` spans
(``WeightVersionSpan(version, start, end)``: output tokens [start, end) were sampled by the weights
labelled ``version``). A swap is

    with engine.paused():          # pause_scheduler(mode="keep") at the next step boundary:
                                   # in-flight requests stay resident with their KV cache
        engine.apply_weights(...)  # the engine's one staging protocol: abort, stage the
                                   # buckets (bytes or bucket files), commit (one in-place
                                   # reload), set_weight_version(v) (every later step is
                                   # labelled v), prefix-cache reset (best effort)
                                   # resume_scheduler() on leaving the block

All of these are engine-core utility calls, processed in order between two engine steps, and the
scheduler schedules nothing while paused, so no step can run with the new weights under the old
label (or the reverse): a token's version is exactly the version of the weights that sampled it.

Note on the engine core process: vLLM's multiprocess engine core runs its busy loop on its own; not
calling ``step()`` does not stop generation, it only leaves outputs queued (with their labels). The
pause above is what makes the swap happen "between engine steps".

KV cache reuse (documented staleness, as in other asynchronous RL systems: AReaL, PipelineRL,
slime's partial rollouts): requests in flight across a swap keep the KV cache computed under the
old weights; tokens sampled after the swap use the new weights for the new token's forward but
attend to old-version keys/values of the earlier tokens. Their recorded logprob is therefore
neither exactly the old nor exactly the new policy's full-sequence logprob. The per-token version
says which weights produced the token; the importance weight w = exp(logp_learner - logp_rollout)
uses the rollout logprob actually sampled with, which is what the sampling distribution was.
New requests submitted after a swap prefill with the new weights (the prefix cache is reset when
possible; arithmetic prompts are shorter than one KV block, so no prompt block is ever cached).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from vllm_bridge import vllm_compat
from vllm_bridge.engine import RolloutEngine, RolloutEngineError
from vllm_bridge.samples import Sample
from vllm_bridge.weights.buckets import WeightUpdate, iter_buckets, to_safetensors


@dataclass
class FinishedGroup:
    """All n samples of one submitted prompt, finished."""

    tag: Any  # what the caller passed to submit() (e.g. the batch index)
    group: int  # index of the prompt within its submit() call
    samples: list[Sample]
    submit_version: int  # weights loaded when the prompt was submitted
    submit_time: float


@dataclass
class _Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] | None = None
    finish_reason: str | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    n: int
    tag: Any
    group: int
    temperature: float
    top_p: float
    submit_version: int
    submit_time: float
    comps: dict[int, _Completion] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.comps) == self.n and all(c.finish_reason is not None for c in self.comps.values())


def spans_to_versions(spans, num_tokens: int) -> list[int]:
    """vLLM WeightVersionSpan list -> one int version per output token."""
    out = [None] * num_tokens
    for sp in spans or []:
        for i in range(sp.start, min(sp.end, num_tokens)):
            out[i] = int(sp.version)
    if any(v is None for v in out):
        raise RolloutEngineError(f"weight-version spans {spans} do not cover all {num_tokens} output tokens")
    return out  # type: ignore[return-value]


class StreamingGenerator:
    """Submit / step / swap on a RolloutEngine's vLLM engine. Not thread-safe; one per engine.

    While a StreamingGenerator has requests in flight, do not call the engine's blocking
    ``generate``/``score`` (they step the same engine and would consume these requests' outputs);
    ``drain()`` or ``abort_all()`` first.
    """

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._reqs: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.swaps: list[dict] = []
        # vLLM 0.32 labels each engine step with a weight version; 0.26 (CUDA) cannot
        # (vllm_compat item 4): there, weights change only when nothing is in flight, so every
        # token of a request has the version it was submitted under.
        self.in_flight_swaps = vllm_compat.can_label_weight_versions(self._llm_engine)
        self._label(engine.weight_version)

    # ---- helpers -------------------------------------------------------------------------------
    @property
    def _llm_engine(self):
        return self.engine.llm_engine

    def _label(self, version: int) -> None:
        with self.engine.guard("set_weight_version"):
            vllm_compat.set_weight_version(self._llm_engine, version)

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def num_in_flight(self) -> int:
        return len(self._reqs)

    def in_flight_tags(self) -> list:
        return [r.tag for r in self._reqs.values()]

    def progress(self) -> dict[str, list[int]]:
        """request id -> tokens generated so far by each of its completions (as seen by step())."""
        return {rid: [len(c.token_ids) for c in r.comps.values()] for rid, r in self._reqs.items()}

    # ---- submit / step -------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        seed: int | None = None,
        top_k: int = -1,
        tag: Any = None,
        **sampling_kwargs: Any,
    ) -> list[str]:
        """Queue n samples for each prompt (seeds as in RolloutEngine.generate). Returns request ids."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        ids = []
        now = time.perf_counter()
        for i, p in enumerate(prompt_ids):
            sp = SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=None if seed is None else int(seed) + i * n,
                skip_special_tokens=False,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
                **sampling_kwargs,
            )
            rid = f"rz-{next(self._ids)}"
            with self.engine.guard("add_request"):
                self._llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(map(int, p))), sp)
            self._reqs[rid] = _Request(list(map(int, p)), n, tag, i, temperature, top_p, self.version, now)
            ids.append(rid)
        return ids

    def step(self) -> list[FinishedGroup]:
        """Process one engine step's outputs; return the prompt groups that finished in it.

        Blocks until the engine core produces output; returns [] at once when nothing is in flight.
        """
        if not self._reqs:
            return []
        with self.engine.guard("step"):  # watched: a core that dies or sticks mid-step is named, not waited on
            outs = self.engine.watched(self._llm_engine.step, "step", stall_s=self.engine.stall_timeout_s)
        done: list[FinishedGroup] = []
        for out in outs:
            req = self._reqs.get(out.request_id)
            if req is None:
                continue
            for c in out.outputs:
                comp = req.comps.setdefault(c.index, _Completion())
                new_ids = list(c.token_ids)
                comp.token_ids.extend(new_ids)
                lps = c.logprobs or []
                if len(lps) != len(new_ids):
                    raise RolloutEngineError(f"{out.request_id}: {len(new_ids)} new tokens but {len(lps)} logprobs")
                comp.logprobs.extend(float(d[t].logprob) for t, d in zip(new_ids, lps))
                if c.finish_reason is not None:
                    comp.finish_reason = str(c.finish_reason)
                    n_tok = len(comp.token_ids)
                    comp.versions = (spans_to_versions(c.weight_versions, n_tok) if self.in_flight_swaps
                                     else [req.submit_version] * n_tok)
            if req.finished:
                del self._reqs[out.request_id]
                done.append(self._finish(req))
        return done

    def _finish(self, req: _Request) -> FinishedGroup:
        samples = []
        for idx in sorted(req.comps):
            c = req.comps[idx]
            samples.append(
                Sample(
                    prompt_ids=list(req.prompt_ids),
                    response_ids=c.token_ids,
                    logprobs=c.logprobs,
                    versions=c.versions or [],
                    finish_reason=c.finish_reason or "length",
                    group=req.group,
                    index_in_group=idx,
                    temperature=req.temperature,
                    top_p=req.top_p,
                )
            )
        return FinishedGroup(req.tag, req.group, samples, req.submit_version, req.submit_time)

    def drain(self) -> list[FinishedGroup]:
        """Step until nothing is in flight."""
        done: list[FinishedGroup] = []
        while self._reqs:
            done += self.step()
        return done

    def abort_all(self) -> None:
        if self._reqs and self.engine.llm is not None:
            with self.engine.guard("abort"):
                self._llm_engine.abort_request(list(self._reqs))
        self._reqs.clear()

    # ---- weight swap ---------------------------------------------------------------------------
    def swap_weights(
        self,
        version: int,
        *,
        update: WeightUpdate | None = None,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
        path: str | Path | None = None,
    ) -> dict:
        """Replace the weights in place between two engine steps; in-flight requests continue.

        Give either ``update`` (a transport.WeightUpdate whose bucket files the worker stages from
        disk: the filesystem transport) or ``named_tensors`` (sent as safetensors bytes in buckets,
        as RolloutEngine.update_weights does); ``path``: one safetensors file holding them all.
        Returns timings (also appended to ``swaps``).
        """
        if path is not None and update is None:
            update = WeightUpdate(int(version), [str(path)])
        if (update is None) == (named_tensors is None):
            raise ValueError("swap_weights: give exactly one of update=, path= or named_tensors=")
        eng = self.engine
        if self._reqs and not self.in_flight_swaps:
            raise RolloutEngineError(
                f"swap_weights with {len(self._reqs)} requests in flight needs vLLM's per-step weight-version "
                f"labels (vLLM {vllm_compat.vllm_version()} has none): drain() first")
        t0 = time.perf_counter()
        if update is not None:
            payloads = list(update.paths)
        else:
            payloads = (to_safetensors(b) for b in iter_buckets(named_tensors, eng.bucket_bytes))
        # nothing in flight: no engine step can run, so there is nothing to pause
        with eng.paused() if self._reqs else contextlib.nullcontext():
            t1 = time.perf_counter()
            info = eng.apply_weights(payloads, version)
        rec = {
            "version": int(version),
            "pause_s": t1 - t0,
            "reload_s": info["reload_s"],
            "total_s": time.perf_counter() - t0,
            "in_flight": len(self._reqs),
        }
        eng.last_sync = dict(rec)
        self.swaps.append(rec)
        return rec
