"""Recompute the one row where `rz check`'s localiser found vLLM leaving the learner at a GEMM's output.

`rz check` writes, for the first diverging tap, the differing elements of its first differing position
(column, learner value, vLLM value) and the input tap's row at that position (equal on both sides;
megatron_rz/tools/localise.py `first_divergence`). When the diverging tap is a projection's output,
this script takes that input row and the weight from the run's checkpoint and computes the output
row again:

* in float64 (the exact sum, then rounded to the tap's dtype): which side rounds like the exact sum;
* with every config of the invariant GEMM (`kernels.triton.gemm.CONFIGS`), the row alone (M = 1) and
  inside calls of M rows (the other rows random): which config and which row count give the
  learner's value and which give vLLM's.

A config or row count that gives a different value from the others is a broken invariance: the
kernels' contract is that none does. Usage (on the GPU machine, after `rz check`):

    python benchmarks/gemm_row_recompute.py --check /root/v4run/check.json --model /root/v4run/base_model \
        [--rows 1,16,17,57,64,65,128,300,1031] [--out result.json]

Taps it knows: DeepSeek-V4's query down / up projections and key projection of any layer (`TAP_WEIGHTS`);
another tap is refused with the list.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# localiser tap -> the checkpoint weight whose GEMM produces it (a plain x @ W.T, no bias)
TAP_WEIGHTS = {
    r"layer(\d+)\.attn_q_a": "layers.{}.attn.wq_a.weight",
    r"layer(\d+)\.attn_q_b": "layers.{}.attn.wq_b.weight",
}


def weight_name(tap: str) -> str:
    for pat, name in TAP_WEIGHTS.items():
        m = re.fullmatch(pat, tap)
        if m:
            return name.format(m.group(1))
    raise SystemExit(f"gemm_row_recompute: tap {tap!r} is not a known projection output; known: "
                     f"{', '.join(TAP_WEIGHTS)}")


def find_divergence(check: dict) -> dict:
    """check.json's vLLM divergence record, when it carries an input row."""
    d = (check.get("localisation") or {}).get("vllm")
    if isinstance(d, dict) and isinstance(d.get("input_row"), list):
        return d
    raise SystemExit("gemm_row_recompute: check.json has no localisation with an input row "
                     "(run rz check with this tree: localise.first_divergence records it)")


def load_weight(model_dir: Path, name: str):
    from safetensors import safe_open

    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            if name in h.keys():
                return h.get_tensor(name)
    raise SystemExit(f"gemm_row_recompute: {name} is in no safetensors file of {model_dir}")


def recompute(d: dict, w, rows: list[int], device: str) -> dict:
    import torch

    from kernels.triton.gemm import CONFIGS, default_k_segments, matmul

    dtype = getattr(torch, d["dtype"])
    x = torch.tensor(d["input_row"], dtype=torch.float64).to(dtype)
    w = w.to(dtype).to(device)
    x = x.to(device)
    N, K = w.shape
    cols = [c for c, _, _ in d["differing_elements"]]
    exact = (x.double()[None] @ w.double().T)[0]
    out = {"weight_shape": [N, K], "columns": cols,
           "learner": [r for _, r, _ in d["differing_elements"]], "vllm": [s for _, _, s in d["differing_elements"]],
           "float64": [float(exact[c]) for c in cols],
           "float64_rounded": [float(exact[c].to(dtype)) for c in cols], "configs": {}}
    nseg = default_k_segments(K, N)
    g = torch.Generator().manual_seed(0)
    for M in rows:
        others = (torch.randn(max(M - 1, 0), K, generator=g) * float(x.float().std())).to(dtype).to(device)
        for where in ("first", "last"):
            xs = torch.cat([x[None], others]) if where == "first" else torch.cat([others, x[None]])
            i = 0 if where == "first" else M - 1
            for name, cfg in CONFIGS.items():
                if cfg.split and nseg == 1:
                    continue
                y = matmul(xs, w, out_dtype=dtype, config=cfg)[i]
                out["configs"].setdefault(name, {})[f"M={M},{where}"] = [float(y[c]) for c in cols]
            if M == 1:
                break
    return out


def summarise(res: dict) -> list[str]:
    lines = [f"weight {res['weight_shape']}, columns {res['columns']}",
             f"  learner  {res['learner']}", f"  vLLM     {res['vllm']}",
             f"  float64  {res['float64']} -> rounded {res['float64_rounded']}"]
    seen: dict[tuple, list[str]] = {}
    for name, by in res["configs"].items():
        for where, vals in by.items():
            seen.setdefault(tuple(vals), []).append(f"{name}@{where}")
    for vals, who in seen.items():
        tag = ("= learner" if list(vals) == res["learner"] else "= vLLM" if list(vals) == res["vllm"] else "other")
        lines.append(f"  {tag:9s} {list(vals)}: {len(who)} (config, M) pairs, e.g. {', '.join(who[:4])}")
    lines.append("invariant: every config and row count gives one value" if len(seen) == 1 else
                 f"NOT invariant: {len(seen)} different values across configs / row counts")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", required=True, help="rz check's check.json")
    ap.add_argument("--model", required=True, help="the run's checkpoint directory (safetensors)")
    ap.add_argument("--rows", default="1,16,17,57,64,65,128,300,1031")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.out and Path(a.out).exists():
        raise SystemExit(f"gemm_row_recompute: --out {a.out} exists; give a new path (results are never overwritten)")
    d = find_divergence(json.loads(Path(a.check).read_text()))
    w = load_weight(Path(a.model), weight_name(d["first_diverging_tap"]))
    res = recompute(d, w, [int(r) for r in a.rows.split(",")], a.device)
    res["tap"] = d["first_diverging_tap"]
    print("\n".join(summarise(res)))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
