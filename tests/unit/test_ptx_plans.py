"""Launch plans checked in the PTX that Triton emits for the GPU, compiled here on the CPU (sm_90,
Triton's NVIDIA backend; no GPU needed). The bits themselves come from tests/gpu; these are the
structural facts those plans rest on, which a later edit could silently undo:

* the segment partials of the fused residual + norm and of the GEMM's reduce are summed with the
  loop unrolled (no branch left), so every segment's load is issued before the first add, and each
  element's fp32 chain is still ``((0 + p0) + p1) + ...`` in segment order;
* the grouped MoE GEMM uses one and the same MMA instruction (bf16 in, fp32 accumulate) at every
  output-tile width the small-batch plans pick and in the direct-rows plan, so a column's dot chain
  over K is built from the same steps whatever the plan.
"""

import re

import pytest

triton = pytest.importorskip("triton")


def _ptx(fn, types: dict, constexprs: dict, num_warps: int) -> str:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"Triton without its compiler API: {e}")
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps})
    except Exception as e:  # noqa: BLE001  (no NVIDIA backend / ptxas in this install)
        if "ptxas" in str(e) or "backend" in str(e).lower():
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise
    return k.asm["ptx"]


def _add_chains(ptx: str) -> list[list[str]]:
    """For each register that starts as ``x + 0.0``, the registers added to it, in order."""
    chains, head = [], {}
    for line in ptx.splitlines():
        m = re.match(r"\s*add\.f32\s+(%r\d+),\s*(%r\d+),\s*(%r\d+|0f00000000);", line)
        if not m:
            continue
        dst, a, b = m.groups()
        if b == "0f00000000":
            chains.append([a])
            head[dst] = len(chains) - 1
        elif a in head:
            chains[head[a]].append(b)
            head[dst] = head.pop(a)
    return chains


def test_segment_partials_are_summed_unrolled_in_segment_order():
    from kernels.triton import gemm, rmsnorm

    ptx = _ptx(rmsnorm._partials_add_rmsnorm_kernel,
               {"x_ptr": "*bf16", "p_ptr": "*fp32", "b_ptr": "*fp32", "w_ptr": "*bf16", "h_ptr": "*bf16",
                "out_ptr": "*bf16", "eps": "fp32"},
               dict(NUM_SEGS=8, HAS_BIAS=False, HAS_W=True, BLOCK_D=1024), num_warps=2)
    assert not re.search(r"\bbra\b", ptx), "the segment loop is a loop again: one memory round trip per segment"
    loads = [m.group(1) for m in re.finditer(r"ld\.global\S*\s+\{\s*(%r\d+)", ptx)]
    first_add = ptx.index("add.f32")
    assert all(ptx.index(r + " }") < first_add for r in loads[:8 * 16]), "a partial's load comes after an add"
    chains = [c for c in _add_chains(ptx) if len(c) == 8]
    assert len(chains) >= 16, chains[:3]  # one 8-term chain per element a thread holds (1024 / 64 threads)
    order = {r: i for i, r in enumerate(loads)}
    for c in chains:
        segs = [order[r] // 16 for r in c]  # loads are issued segment by segment, 16 per segment
        assert segs == sorted(segs) and len(set(segs)) == 8, c  # p0, p1, ..., p7 in order
    ptx_r = _ptx(gemm._reduce_segments_kernel, {"ws_ptr": "*fp32", "out_ptr": "*bf16", "bias_ptr": "*fp32"},
                 dict(NUM_SEGS=8, HAS_BIAS=False, BLOCK=1024), num_warps=4)
    assert not re.search(r"\bbra\b", ptx_r)


@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_moe_gemm_uses_one_mma_at_every_small_batch_plan(swiglu):
    from kernels.triton import moe as M

    types = {n: "*i32" for n in ("a_rows_ptr", "out_rows_ptr", "tile_expert_ptr", "tile_start_ptr",
                                 "expert_end_ptr")}
    types.update({n: "*bf16" for n in ("a_ptr", "w_ptr", "w2_ptr", "out_ptr")})
    found = set()
    for direct in (False, True):
        # the default 16-row plan (64 columns, 4 warps) and the narrow plan's 32 and 16 columns
        assert M.grouped_tile_n(4, 32, 768, 16, swiglu, 132, narrow=False) == (64, 4)
        for bn in (64, 32, 16):
            warps = 4 if bn == 64 else bn // 16
            c = dict(NUM_SEGS=1 if swiglu else 8, GATHER_A=swiglu, SCATTER_OUT=not swiglu, SWIGLU=swiglu,
                     BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128 if swiglu else 32, EVEN_K=True, NUM_STAGES=3,
                     IEEE=False, DIRECT=direct)
            mma = frozenset(re.findall(r"(mma\.sync\.\S+|wgmma\.mma_async\.\S+)", _ptx(M._grouped_kernel, types, c, warps)))
            found.add(mma)
    assert len(found) == 1, found
    (only,) = found
    assert only == {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}, only


def test_combine_rounds_the_weights_with_integer_ops_and_no_float_conversion():
    """The combine kernel's bf16 rounding of the routing weights (``W_ROUND=1``) compiles for sm_90 to
    integer adds and masks on the fp32 bits (the interpreter test checks them against torch's
    rounding): no ``cvt`` to bf16, whose rounding the interpreter does not reproduce."""
    from kernels.triton import moe

    types = {"y_ptr": "*bf16", "w_ptr": "*fp32", "shared_ptr": "*bf16", "out_ptr": "*bf16"}
    base = dict(TOP_K=4, HAS_SHARED=False, BLOCK_H=1024)
    plain = _ptx(moe._combine_kernel, types, {**base, "W_ROUND": 0}, num_warps=4)
    rounded = _ptx(moe._combine_kernel, types, {**base, "W_ROUND": 1}, num_warps=4)
    assert "and.b32" in rounded and ("-65536" in rounded or "0xFFFF0000" in rounded.upper() or "4294901760" in rounded)
    # the only fp32 -> bf16 conversions are the output's store, as without the rounding
    assert len(re.findall(r"cvt\.rn\.bf16", rounded)) == len(re.findall(r"cvt\.rn\.bf16", plain))
    assert rounded.count("add.s32") > plain.count("add.s32")
