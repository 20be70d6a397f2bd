"""The GEMM shapes a model's aligned forward runs, and the per-GPU pick table a sweep of them gives.

``model_gemm_shapes(config)`` reads a Hugging Face ``config.json`` (dict) and lists the dense GEMMs of
one decoder layer plus the lm_head as ``GemmShape(name, K, N, k_segments, max_m)``: packed q/k/v and
gate/up with one K segment, o_proj and down_proj row-parallel with ``ROW_PARALLEL_K_SEGMENTS``
(vllm_bridge/aligned/_model.py), MLA's projections for DeepSeek-V3-class configs, shared experts and
router gates of MoE configs. Routed experts run the grouped MoE kernels (not these GEMMs) and are not
listed. ``max_m`` caps the rows worth timing: the lm_head sees one row per sampled token (the batch),
never a prefill chunk.

``table_from_sweep(rows, meta)`` turns ``gpu_kernels.py --sweep`` rows into the table format of
kernels/triton/gemm_table.py (the fastest config at each measured M).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

ROW_SEGMENTS = 8  # kernels.ROW_PARALLEL_K_SEGMENTS (not imported: this module runs without torch)
LM_HEAD_MAX_M = 512


class GemmShape(NamedTuple):
    name: str
    K: int
    N: int
    k_segments: int
    max_m: int | None = None


def load_config(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())


def model_gemm_shapes(c: dict) -> list[GemmShape]:
    H = int(c["hidden_size"])
    nh = int(c["num_attention_heads"])
    shapes: list[GemmShape] = []
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V3 class)
        nope, rope, vd = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        kvr = int(c["kv_lora_rank"])
        qr = c.get("q_lora_rank")
        if qr:
            shapes += [GemmShape("q_a_proj", H, int(qr), 1), GemmShape("q_b_proj", int(qr), nh * (nope + rope), 1)]
        else:
            shapes.append(GemmShape("q_proj", H, nh * (nope + rope), 1))
        shapes += [GemmShape("kv_a_proj", H, kvr + rope, 1), GemmShape("kv_b_proj", kvr, nh * (nope + vd), 1),
                   GemmShape("o_proj", nh * vd, H, ROW_SEGMENTS)]
    else:
        hd = int(c.get("head_dim") or H // nh)
        nkv = int(c.get("num_key_value_heads") or nh)
        shapes += [GemmShape("qkv_proj", H, (nh + 2 * nkv) * hd, 1), GemmShape("o_proj", nh * hd, H, ROW_SEGMENTS)]
    experts = int(c.get("num_experts") or c.get("n_routed_experts") or 0)
    dense_layers = int(c.get("first_k_dense_replace") or 0)
    if experts == 0 or dense_layers > 0:
        inter = int(c["intermediate_size"])
        shapes += [GemmShape("gate_up_proj", H, 2 * inter, 1), GemmShape("down_proj", inter, H, ROW_SEGMENTS)]
    if experts:
        shapes.append(GemmShape("router_gate", H, experts, 1))
        shared = int(c.get("n_shared_experts") or 0) * int(c.get("moe_intermediate_size") or 0) \
            or int(c.get("shared_expert_intermediate_size") or 0)
        if shared:
            shapes += [GemmShape("shared_gate_up", H, 2 * shared, 1), GemmShape("shared_down", shared, H, ROW_SEGMENTS)]
    shapes.append(GemmShape("lm_head", H, int(c["vocab_size"]), 1, LM_HEAD_MAX_M))
    seen, out = set(), []
    for s in shapes:  # one entry per (K, N, k_segments)
        if (s.K, s.N, s.k_segments) not in seen:
            seen.add((s.K, s.N, s.k_segments))
            out.append(s)
    return out


def table_from_sweep(rows: list[dict], meta: dict) -> dict:
    """The kernels/triton/gemm_table.py document of a sweep: per (K, N, k_segments), the fastest
    config at each measured M (rows whose every config failed are left out)."""
    entries: dict[str, list] = {}
    for r in rows:
        if not r.get("best"):
            continue
        entries.setdefault(f"{r['K']},{r['N']},{r['nseg']}", []).append([int(r["M"]), r["best"]])
    for v in entries.values():
        v.sort()
    return {"device": meta.get("device"), "triton": meta.get("triton"), "torch": meta.get("torch"),
            "command": meta.get("command"), "entries": entries}


def dump_table(table: dict) -> str:
    """The table as JSON with one ``[M, config]`` row list per line (readable diffs)."""
    head = {k: v for k, v in table.items() if k != "entries"}
    lines = [json.dumps(head, indent=1)[:-2] + ',\n "entries": {']
    items = list(table["entries"].items())
    for i, (key, rows) in enumerate(items):
        lines.append(f'  {json.dumps(key)}: {json.dumps(rows)}' + ("," if i < len(items) - 1 else ""))
    lines.append(" }\n}\n")
    return "\n".join(lines)


def merge_tables(docs: list[dict]) -> dict:
    """One device's tables (e.g. one per model) as one: entries of different shapes side by side; a
    shape in several tables takes the later table's rows. Refuses tables of different devices."""
    devices = {d.get("device") for d in docs}
    if len(devices) != 1:
        raise ValueError(f"merge_tables: tables of several devices {sorted(map(str, devices))}")
    out = {k: v for k, v in docs[-1].items() if k != "entries"}
    out["command"] = " + ".join(str(d.get("command")) for d in docs)
    out["entries"] = {}
    for d in docs:
        out["entries"].update(d["entries"])
    return out


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="merge GEMM pick tables of one GPU model "
                                             "(python benchmarks/gemm_shapes.py merge --out F A.json B.json)")
    ap.add_argument("cmd", choices=["merge"])
    ap.add_argument("tables", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if Path(a.out).exists() and str(Path(a.out).resolve()) not in {str(Path(t).resolve()) for t in a.tables}:
        raise SystemExit(f"gemm_shapes: --out {a.out} exists and is not one of the merged tables")
    merged = merge_tables([json.loads(Path(t).read_text()) for t in a.tables])
    Path(a.out).write_text(dump_table(merged))
    print(f"{a.out}: {len(merged['entries'])} shapes")


if __name__ == "__main__":
    main()
