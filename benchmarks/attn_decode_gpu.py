"""Decode attention over a paged KV cache on the GPU: the aligned kernel at every split count beside
vLLM's FlashAttention (what stock vLLM runs), on RL decode shapes.

    python benchmarks/attn_decode_gpu.py --out attn_decode.json [--shapes 32x2560,64x640,128x768,256x1100]
        [--heads 16/4,32/4,12/2]

A shape ``BxL``: B sequences of L keys each, one query each (heads ``Hq/Hkv`` of 128, default moe1b's
16 query / 4 KV heads; bf16, 16-slot pages, a shuffled block table). For each shape: microseconds per
call (CUDA events over ``--iters`` calls replayed from CUDA graphs: kernel time without Python's
launch cost, as the engine's decode graphs run) of ``kernels.triton.attn.paged_attention``
at ``splits`` = 1 (one pass), the default (:func:`decode_splits`) and one program per chunk, with
64-row programs and with 16-row ones (``rows``), each split plan also with its fused merge (``_fm``), and of FlashAttention 3's
``flash_attn_varlen_func`` with a block table (what stock vLLM runs on Hopper); and whether every
plan gave the one-pass 64-row kernel's bits (``torch.equal``, per plan in ``equal``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def _setup(B: int, L: int, Hq=16, Hkv=4, D=128, PAGE=16, seed=0, table_len=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nbs = (L + PAGE - 1) // PAGE
    nb = B * nbs + 8
    cache = torch.randn(nb, Hkv, PAGE, 2 * D, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(nb, device="cuda", generator=g)[: B * nbs].to(torch.int32)
    bt = perm.view(B, nbs).contiguous()
    width = (table_len + PAGE - 1) // PAGE
    if width > nbs:  # the engine's table: as wide as max_model_len, unused entries 0 (never read)
        bt = torch.cat([bt, bt.new_zeros(B, width - nbs)], dim=1).contiguous()
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    sl = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, cache, bt, cu, sl


def _time(fn, iters: int) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of 20 calls (kernel time, no
    Python launch cost: the engine replays decode from graphs too)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    reps = max(1, iters // 20)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000.0 / (reps * 20)


def run(shapes: list[tuple[int, int]], iters: int, heads: list[tuple[int, int]], chunks: tuple = (256,),
        table_len: int = 0) -> dict:
    from kernels.triton import attn as A

    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - report, run the rest
        flash_attn_varlen_func, fa_err = None, repr(e)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "table_len": table_len, "shapes": []}
    contract_chunk = A.KV_CHUNK
    for Hq, Hkv in heads:
        for B, L in shapes:
            q, cache, bt, cu, sl = _setup(B, L, Hq=Hq, Hkv=Hkv, table_len=table_len)
            D = q.shape[-1]
            kc, vc = cache[..., :D], cache[..., D:]
            nc = (bt.shape[1] * kc.shape[2] + A.KV_CHUNK - 1) // A.KV_CHUNK
            row = {"heads": f"{Hq}/{Hkv}", "batch": B, "keys": L, "chunks": nc, "us": {}, "equal": {}}
            one = torch.empty_like(q)
            A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=one, splits=1, rows=64)
            for rows in (64, 16):
                tile, _ = A.decode_tile(Hq // Hkv, rows)
                if tile != rows:
                    continue
                default = A.decode_splits(B, Hkv, nc, sms, rows)
                row[f"default_splits_r{rows}"] = default
                for s in sorted({1, max(1, default // 2), default, min(nc, 2 * default), nc}):
                    o = torch.empty_like(q)
                    f = lambda s=s, o=o, r=rows: A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5,  # noqa: E731
                                                                   max_q_len=1, out=o, splits=s, rows=r)
                    key = f"r{rows}_splits{s}"
                    row["us"][key] = round(_time(f, iters), 2)
                    row["equal"][key] = bool(torch.equal(o, one))
                    if s > 1 or rows < 64:  # the same plan with the fused merge (one launch)
                        o2 = torch.empty_like(q)
                        f2 = lambda s=s, o=o2, r=rows: A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5,  # noqa: E731
                                                                         max_q_len=1, out=o, splits=s, rows=r,
                                                                         fused_merge=True)
                        row["us"][key + "_fm"] = round(_time(f2, iters), 2)
                        row["equal"][key + "_fm"] = bool(torch.equal(o2, one))
            row["every_plan_equals_one_pass"] = all(row["equal"].values())
            # what-if: another KV_CHUNK (a different numerics contract: bits differ from the
            # contract's, so only its own plans are compared), default split plan, 64 and 16 rows
            for c in chunks:
                if c == contract_chunk:
                    continue
                A.KV_CHUNK = c
                try:
                    ncc = (bt.shape[1] * kc.shape[2] + c - 1) // c
                    ref_c = torch.empty_like(q)
                    A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=ref_c, splits=1, rows=64)
                    for rows in (64, 16):
                        if A.decode_tile(Hq // Hkv, rows)[0] != rows:
                            continue
                        s_ = A.decode_splits(B, Hkv, ncc, sms, rows)
                        o = torch.empty_like(q)
                        f = lambda s=s_, o=o, r=rows: A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5,  # noqa: E731
                                                                        max_q_len=1, out=o, splits=s, rows=r)
                        key = f"chunk{c}_r{rows}_splits{s_}"
                        row["us"][key] = round(_time(f, iters), 2)
                        row["equal"][key] = bool(torch.equal(o, ref_c))
                finally:
                    A.KV_CHUNK = contract_chunk
            if flash_attn_varlen_func is not None:
                # vLLM's layout: [num_blocks, PAGE, Hkv, D] (slot-major); the same keys, copied
                kf = kc.permute(0, 2, 1, 3).contiguous()
                vf = vc.permute(0, 2, 1, 3).contiguous()
                for ver in (3, 2):
                    try:
                        fa = lambda v=ver: flash_attn_varlen_func(  # noqa: E731
                            q, kf, vf, max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=L, seqused_k=sl,
                            block_table=bt, softmax_scale=D ** -0.5, causal=True, fa_version=v)
                        row["us"][f"flash_attn{ver}"] = round(_time(fa, iters), 2)
                        row[f"flash_attn{ver}_max_abs_vs_aligned"] = float((fa().float() - one.float()).abs().max())
                        break
                    except Exception as e:  # noqa: BLE001
                        row[f"flash_attn{ver}_error"] = repr(e)[:300]
            else:
                row["flash_attn_error"] = fa_err[:300]
            kv_bytes = B * L * Hkv * D * 2 * 2
            best = min(v for k, v in row["us"].items() if k.startswith("r"))
            row["kv_GBps_at_best_aligned"] = round(kv_bytes / best / 1e3, 1)
            print(json.dumps(row), flush=True)
            res["shapes"].append(row)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="32x2560,32x1024,64x640,128x768,256x1100,1x3000")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--heads", default="16/4", help="query / KV heads, comma-separated (e.g. 16/4,32/4,12/2)")
    ap.add_argument("--chunks", default="256", help="KV_CHUNK sizes to time (what-if; the contract's is 256)")
    ap.add_argument("--table-len", type=int, default=0,
                    help="block-table width in keys (the engine's max_model_len; default: each shape's keys)")
    a = ap.parse_args()
    if os.path.exists(a.out):  # never overwrite an earlier run's results
        raise SystemExit(f"attn_decode_gpu: --out {a.out} already exists; give another --out")
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    heads = [tuple(int(x) for x in h.split("/")) for h in a.heads.split(",")]
    res = run(shapes, a.iters, heads, tuple(int(c) for c in a.chunks.split(",")), a.table_len)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
