"""Process-wide kernel settings: the op backend and the GPU GEMM tile table.

Set them with :func:`set_backend` / :func:`set_gemm_small_tiles` (``megatron_rz.launch.runtime`` does, from
the recipe's ``runtime`` section). Processes started for a run (vLLM's workers, torchrun ranks) read
their start values from the environment the launcher sets: ``RZ_KERNELS`` (``auto`` | ``reference``),
``RZ_GEMM_SMALL_TILES``, ``RZ_GEMM_TABLE`` (``auto`` | ``off`` | a path: set_gemm_table), ``RZ_DECODE_SPLIT`` and ``RZ_FUSED_WORK_LIST`` (``1`` | ``0``). The last three
choose between launch plans of the same numbers (speed only, never a bit): benchmarks switch them off
to time the plain plans beside the fast ones. ``RZ_BATCHED_DRAW`` (``1`` | ``0``) picks the aligned
CUDA sampler's random draw: one keyed Gumbel race for the batch (``kernels.triton.draw``) or vLLM's
per-request exponential noise; it changes which token a seed gives (both exact samples), never a
reported log-probability. ``RZ_FUSED_SAMPLER`` (``0`` | ``1``, default 0) is a launch-plan switch of that
sampler (speed only, never a bit): fused (``log_softmax`` in two launches, the draw kernel writing
the sampled token's logprob and the finiteness flag) or the unfused plans. ``RZ_DECODE_ROWS``
(``64`` | ``16``, default 64): rows per split-KV decode program (see set_decode_rows).
``RZ_DECODE_FUSED_MERGE`` (``0`` | ``1``, default 0): the split-KV decode's chunk states folded by the
last program of each (sequence, KV head) instead of a second kernel (see set_decode_fused_merge).
``RZ_MOE_DIRECT_ROWS`` (``0`` | ``1``, default 0): the routed experts of a few rows
without a work list (see set_moe_direct_rows). ``RZ_QK_ONE_LAUNCH`` (``0`` | ``1``, default 0): the aligned engine's Qwen3 q/k norms in one launch and
their RoPE in one (see set_qk_one_launch). ``RZ_MOE_NARROW_TILES`` (``0`` | ``1``, default 0): narrower output tiles for the grouped MoE GEMMs of
small batches, so that more programs stream the few active experts' weights (see set_moe_narrow_tiles).
"""

from __future__ import annotations

import os

BACKENDS = ("auto", "reference")

_backend = os.environ.get("RZ_KERNELS", "auto")
_small_tiles = os.environ.get("RZ_GEMM_SMALL_TILES", "1") != "0"
_decode_split = os.environ.get("RZ_DECODE_SPLIT", "1") != "0"
_fused_work_list = os.environ.get("RZ_FUSED_WORK_LIST", "1") != "0"
_batched_draw = os.environ.get("RZ_BATCHED_DRAW", "1") != "0"
_fused_sampler = os.environ.get("RZ_FUSED_SAMPLER", "0") == "1"  # opt-in: see set_fused_sampler
_decode_rows = int(os.environ.get("RZ_DECODE_ROWS", "64") or 64)  # opt-in: see set_decode_rows
_gemm_table = os.environ.get("RZ_GEMM_TABLE", "auto") or "auto"
_decode_fused_merge = os.environ.get("RZ_DECODE_FUSED_MERGE", "0") == "1"  # opt-in: see set_decode_fused_merge
_moe_narrow_tiles = os.environ.get("RZ_MOE_NARROW_TILES", "0") == "1"  # opt-in: see set_moe_narrow_tiles
_qk_one_launch = os.environ.get("RZ_QK_ONE_LAUNCH", "0") == "1"  # opt-in: see set_qk_one_launch
_moe_direct_rows = os.environ.get("RZ_MOE_DIRECT_ROWS", "0") == "1"  # opt-in: see set_moe_direct_rows


def set_backend(name: str) -> None:
    """``"auto"`` (Triton for CUDA tensors) or ``"reference"`` (the exact reference everywhere)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernels backend {name!r}: must be 'auto' or 'reference'")
    _backend = name


def backend() -> str:
    """The op backend in force (``auto`` | ``reference``)."""
    return _backend


def set_gemm_small_tiles(on: bool) -> None:
    """GPU GEMM: use the short-K tile table (same bits either way; only speed differs)."""
    global _small_tiles
    _small_tiles = bool(on)


def gemm_small_tiles() -> bool:
    """Whether the GPU GEMM picks its short-K tile table."""
    return _small_tiles


def set_gemm_table(setting: str) -> None:
    """GPU GEMM: the measured per-GPU table of tile picks (kernels/triton/gemm_table.py): ``auto``
    (the committed table of this GPU model, where there is one), ``off`` (heuristic picks only) or
    the path of a table file. Same bits whatever the table; only speed differs."""
    global _gemm_table
    _gemm_table = str(setting or "auto")


def gemm_table() -> str:
    """The GEMM table setting in force (``auto`` | ``off`` | a path)."""
    return _gemm_table


def set_decode_split(on: bool) -> None:
    """Paged decode attention: split each sequence's keys over several programs (flash-decoding
    with chunk-aligned split points, ``kernels.triton.attn.paged_attention``); same bits either way."""
    global _decode_split
    _decode_split = bool(on)


def decode_split() -> bool:
    return _decode_split


def set_decode_rows(rows: int) -> None:
    """Split-KV paged decode: query rows per program, 64 or 16. A decode program holds only the
    GQA group's heads of one query, so 64 rows (the prefill tile, part of the numerics) waste most
    of its MMA and softmax work; 16 rows run one warp laid out as each warp of the 64-row tile
    (mma.sync instead of wgmma, which the GEMM measurements found bit-identical). A launch plan only
    where the GPU gives the 64-row tile's bits row for row, which ``tests/gpu`` checks on the
    machine; hence opt-in (``RZ_DECODE_ROWS``), default 64. (32 rows on two warps gave 1-ulp
    differences for a 16-head group on an H100, so it is not offered.)"""
    global _decode_rows
    if int(rows) not in (16, 64):
        raise ValueError(f"decode rows {rows!r}: must be 16 or 64")
    _decode_rows = int(rows)


def decode_rows() -> int:
    return _decode_rows


def set_decode_fused_merge(on: bool) -> None:
    """Split-KV paged decode: fold the chunk states in the split kernel itself, one launch per
    layer instead of two. Every program of a (sequence, KV head) checks in on a counter after
    writing its chunk states; the last one folds them in chunk order with the merge kernel's
    operations (``_merge`` / ``_finish``, elementwise, FMA contraction off) and resets the counter
    for the next launch (CUDA-graph replays included). Same bits as the second kernel by
    construction; a launch plan only once ``tests/gpu`` has checked it on the machine (the
    cross-program ordering is the GPU's), hence opt-in (``RZ_DECODE_FUSED_MERGE=1``)."""
    global _decode_fused_merge
    _decode_fused_merge = bool(on)


def decode_fused_merge() -> bool:
    return _decode_fused_merge


def set_moe_narrow_tiles(on: bool) -> None:
    """Grouped MoE GEMMs with 16-row tiles (decode and other small batches): halve the output tile
    (64 -> 32 -> 16 columns, one warp per 16 columns) until the experts that can be active
    (``min(rows, experts)``) fill about two programs per SM. At batch 1 (top-4 of 32 experts, N 768)
    the default plan runs 48 working programs on 132 SMs, and the profile of 1 x 64 x 128 on an H100
    put the grouped GEMM at 14.8 us a launch against 6.8 us for vLLM's fused_moe. A tile's columns
    are independent dot chains over the same K steps, so the width is a launch plan only
    (``tests/gpu`` compares every plan combination with the default plans, ``torch.equal``: passed
    on an H100, 2026-12-07). Opt-in (``RZ_MOE_NARROW_TILES=1``) until it wins end to end: with
    direct rows it made one Qwen3-30B-A3B MoE layer 1.74x faster at 1 token, but on the 1B MoE
    engine its effect stayed below the process-to-process noise."""
    global _moe_narrow_tiles
    _moe_narrow_tiles = bool(on)


def moe_narrow_tiles() -> bool:
    return _moe_narrow_tiles


def set_moe_direct_rows(on: bool) -> None:
    """Routed experts of a few (token, slot) rows (``2 * rows <= experts``: batch <= 4 at top-4 of 32
    experts): each row its own program row in flat order, expert read from the router's ids, no work
    list, in place of the one-program work-list kernel (5.7 us a layer at batch 1 on an H100, on the
    critical path before both grouped GEMMs). Every row is the same dot chain in a 16-row tile, as in
    the sorted plan; a launch plan only (bitwise the sorted plan in ``tests/gpu`` on an H100),
    opt-in (``RZ_MOE_DIRECT_ROWS=1``) until it wins end to end (see set_moe_narrow_tiles)."""
    global _moe_direct_rows
    _moe_direct_rows = bool(on)


def moe_direct_rows() -> bool:
    return _moe_direct_rows


def set_qk_one_launch(on: bool) -> None:
    """The aligned CUDA engine's Qwen3 attention input: q_norm and k_norm over the packed q/k/v GEMM
    output's q and k heads in one launch (``kernels.qk_rms_norm``), then RoPE of q and k in one launch
    over the result (as Qwen2's path already does), instead of four launches per layer. Each row is
    the same row function with the same block and warps, each RoPE element its own formula, so a
    launch plan only (bitwise the two launches in ``tests/gpu`` on an H100); opt-in
    (``RZ_QK_ONE_LAUNCH=1``) until it wins end to end (-3% to +2% on the 1B MoE engine, within noise).
    The H100 profile of 1 x 64 x 128 (moe1b) had the q/k norms and RoPE at ~1.2-1.7 us a launch, four
    launches a layer."""
    global _qk_one_launch
    _qk_one_launch = bool(on)


def qk_one_launch() -> bool:
    return _qk_one_launch


def set_fused_work_list(on: bool) -> None:
    """Grouped MoE: build small work lists in one kernel (``kernels.triton.moe.work_list``) instead of
    torch's sort and scans; same values either way."""
    global _fused_work_list
    _fused_work_list = bool(on)


def fused_work_list() -> bool:
    return _fused_work_list


def set_batched_draw(on: bool) -> None:
    """Aligned CUDA sampler: draw every row in one keyed Gumbel-race launch (``kernels.triton.draw``)
    instead of vLLM's per-request noise launches. The token stream of a seed differs between the
    two; the logprobs reported for whichever token is drawn do not."""
    global _batched_draw
    _batched_draw = bool(on)


def batched_draw() -> bool:
    return _batched_draw


def set_fused_sampler(on: bool) -> None:
    """Aligned CUDA sampler, untruncated rows: ``log_softmax`` in two launches (each output program
    merges its row's piece stats) and the keyed draw writing the sampled token's logprob and the
    finiteness flag (``kernels.triton.draw.gumbel_draw_with_logprob``), or the unfused plans (three
    ``log_softmax`` launches; torch gather / isfinite / all). Same bits either way. Off by default:
    on the H200 (moe1b, each engine in its own process, 3 rounds, two leases) the fused plan cut the
    sampler's own host time per call (289 -> 174 us at 32 rows) but whole rollouts of 32 x 64 x 128
    were slower with it (0.60 / 0.58 s vs 0.41 / 0.39 s seeded / unseeded), so it is not the default
    until it wins end to end (benchmarks/results/rollout_gpu/fused_sampler_2026-12-03/)."""
    global _fused_sampler
    _fused_sampler = bool(on)


def fused_sampler() -> bool:
    return _fused_sampler
