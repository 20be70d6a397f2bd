"""Decode attention over a paged KV cache on the GPU: the aligned kernel at every split count beside
vLLM's FlashAttention (what stock vLLM runs), on RL decode shapes.

    python benchmarks/attn_decode_gpu.py --out attn_decode.json [--shapes 32x2560,64x640,128x768,256x1100]

A shape ``BxL``: B sequences of L keys each, one query each (moe1b's heads: 16 query / 4 KV heads of
128, bf16, 16-slot pages, a shuffled block table). For each shape: microseconds per call (CUDA
events over ``--iters`` calls after a warm-up) of ``kernels.triton.attn.paged_attention`` at
``splits`` = 1 (one pass), the default (:func:`decode_splits`) and one program per chunk, and of
FlashAttention's ``flash_attn_varlen_func`` with a block table; and whether every split gave the
one-pass kernel's bits (``torch.equal``; the split is a launch plan, never a numerics choice).
"""

from __future__ import annotations

import argparse
import json

import torch


def _setup(B: int, L: int, Hq=16, Hkv=4, D=128, PAGE=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nbs = (L + PAGE - 1) // PAGE
    nb = B * nbs + 8
    cache = torch.randn(nb, Hkv, PAGE, 2 * D, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(nb, device="cuda", generator=g)[: B * nbs].to(torch.int32)
    bt = perm.view(B, nbs).contiguous()
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    sl = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, cache, bt, cu, sl


def _time(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000.0 / iters


def run(shapes: list[tuple[int, int]], iters: int) -> dict:
    from kernels.triton import attn as A

    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - report, run the rest
        flash_attn_varlen_func, fa_err = None, repr(e)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "shapes": []}
    for B, L in shapes:
        q, cache, bt, cu, sl = _setup(B, L)
        D = q.shape[-1]
        kc, vc = cache[..., :D], cache[..., D:]
        Hkv = kc.shape[1]
        nc = (bt.shape[1] * kc.shape[2] + A.KV_CHUNK - 1) // A.KV_CHUNK
        default = A.decode_splits(B, Hkv, nc, sms)
        row = {"batch": B, "keys": L, "chunks": nc, "default_splits": default, "us": {}}
        one = torch.empty_like(q)
        A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=one, splits=1)
        same = True
        for s in sorted({1, max(1, default // 2), default, 2 * default, nc}):
            s = min(s, nc)
            o = torch.empty_like(q)
            f = lambda s=s, o=o: A.paged_attention(q, kc, vc, bt, cu, sl, D ** -0.5, max_q_len=1, out=o,  # noqa: E731
                                                   splits=s)
            row["us"][f"aligned_splits{s}"] = round(_time(f, iters), 2)
            same = same and torch.equal(o, one)
        row["every_split_equals_one_pass"] = same
        if flash_attn_varlen_func is not None:
            # vLLM's layout: [num_blocks, PAGE, Hkv, D] (slot-major); the same keys, copied
            kf = kc.permute(0, 2, 1, 3).contiguous()
            vf = vc.permute(0, 2, 1, 3).contiguous()
            try:
                fa = lambda: flash_attn_varlen_func(q, kf, vf, max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=L,  # noqa: E731
                                                    seqused_k=sl, block_table=bt, softmax_scale=D ** -0.5,
                                                    causal=True)
                row["us"]["flash_attn"] = round(_time(fa, iters), 2)
                row["flash_attn_max_abs_vs_aligned"] = float((fa().float() - one.float()).abs().max())
            except Exception as e:  # noqa: BLE001
                row["flash_attn_error"] = repr(e)[:300]
        else:
            row["flash_attn_error"] = fa_err[:300]
        kv_bytes = B * L * Hkv * D * 2 * 2
        row["kv_GBps_at_best_aligned"] = round(kv_bytes / min(v for k, v in row["us"].items()
                                                              if k.startswith("aligned")) / 1e3, 1)
        print(json.dumps(row), flush=True)
        res["shapes"].append(row)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="32x2560,32x1024,64x640,128x768,256x1100,1x3000")
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    res = run(shapes, a.iters)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
