"""Can Transformer Engine's blockwise FP8 recipe compute the project's blockwise FP8 numerics bit for bit?

    python benchmarks/te_fp8_compare.py --out $OUT/te_fp8.json [--shapes 256x2048x1536,4096x1536x8960]

The project's FP8 (kernels/fp8.py, the learner's fake-quant linear and the engine's FP8 GEMM) and TE's
``Float8BlockScaling`` recipe have the same layout: 1 x 128 activation groups per row, 128 x 128 weight
blocks, e4m3. Whether TE can replace it depends on two things, measured here per shape ``M x K x N``
(random bf16 ``x[M, K]`` and ``w[N, K]``, a fixed seed) on a CUDA machine with TE installed:

* **quantisation**: TE's ``Float8BlockQuantizer`` (power-of-two scales, the recipe's default, and fp32
  scales, what ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` selects) against ``kernels.quantize_act_groupwise``
  / ``quantize_weight_blockwise``: the fraction of equal e4m3 codes and of equal dequantised values;
* **the GEMM**: ``te.Linear`` under ``fp8_autocast(Float8BlockScaling)`` (both scale kinds) against
  ``kernels.fp8_linear`` (the Triton kernel both sides of this project call): the fraction of equal bf16
  outputs and the largest difference relative to the output's largest magnitude; and, apart from the
  quantisation, TE's output against a float64 product of TE's own dequantised operands.

Expected from the sources, to be measured here: TE's scale is ``448 / amax`` rounded once
(``compute_scale_from_amax`` in TE's recipe_common.cuh; power-of-two scales keep only its exponent),
applied as a product ``x * scale``; the project's is ``amax / 448``, applied as a division
``x / scale``. The two can give different codes near a rounding boundary, and cuBLAS's blockwise FP8
GEMM accumulates in its own order. A shape TE refuses is recorded with its error. Nothing here changes a recipe: the result says whether
``model.fp8=blockwise`` could run through TE, and if not, by how much the two differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_SHAPES = "256x2048x1536,4096x1536x8960,32x7168x2048"


def _frac_equal(a, b) -> float:
    return float((a == b).float().mean())


def _rel(a, b) -> float:
    scale = float(b.float().abs().max()) or 1.0
    return float((a.float() - b.float()).abs().max()) / scale


def compare(M: int, K: int, N: int, seed: int = 0) -> dict:
    import torch
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import Float8BlockScaling, QParams
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    import kernels
    from kernels import fp8 as F8

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, K, device="cuda", generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    xq, xs = kernels.quantize_act_groupwise(x)
    wq, ws = kernels.quantize_weight_blockwise(w)
    ours = kernels.fp8_linear(x, wq, ws, out_dtype=torch.bfloat16)
    x_deq = F8.dequantize_act_groupwise(xq, xs)
    w_deq = F8.dequantize_weight_blockwise(wq, ws)
    out: dict = {"shape": [M, K, N]}
    for pow2 in (True, False):
        key = "pow2_scales" if pow2 else "fp32_scales"
        r: dict = {}
        try:
            for name, t, dim, q_ours, deq_ours in (("x", x, 1, xq, x_deq), ("w", w, 2, wq, w_deq)):
                quant = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, amax_epsilon=0.0,
                                             force_pow_2_scales=pow2, block_scaling_dim=dim)
                qt = quant(t)
                codes = qt._rowwise_data.view(torch.float8_e4m3fn)  # TE's own storage: [rows, K] e4m3 codes
                deq = qt.dequantize(dtype=torch.float32)
                r[f"{name}_codes_equal"] = _frac_equal(codes.view(torch.uint8), q_ours.view(torch.uint8))
                r[f"{name}_dequantised_equal"] = _frac_equal(deq, deq_ours)
                r[f"{name}_dequantised_max_rel_diff"] = _rel(deq, deq_ours)
                r[f"_{name}_te_deq"] = deq
            # the recipe's scale kind is a class attribute read from the environment when TE is imported
            # (NVTE_FP8_BLOCK_SCALING_FP32_SCALES); set on the instance, it applies to this recipe only
            recipe = Float8BlockScaling()
            qp = QParams(power_2_scale=pow2, amax_epsilon=0.0)
            recipe.fp8_quant_fwd_inp = recipe.fp8_quant_fwd_weight = recipe.fp8_quant_bwd_grad = qp
            lin = te.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda")
            with torch.no_grad():
                lin.weight.copy_(w)
                with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                    y = lin(x)
            torch.cuda.synchronize()
            r["gemm_equal"] = _frac_equal(y, ours)
            r["gemm_max_rel_diff_vs_ours"] = _rel(y, ours)
            ref = (r.pop("_x_te_deq").double() @ r.pop("_w_te_deq").double().T)  # TE's operands, exact product
            r["te_gemm_max_rel_diff_vs_float64_of_its_operands"] = _rel(y.double(), ref)
            r["ours_max_rel_diff_vs_float64_of_our_operands"] = _rel(ours.double(), x_deq.double() @ w_deq.double().T)
        except Exception as e:  # a shape or scale kind TE refuses: recorded, the others still run
            r = {k: v for k, v in r.items() if not k.startswith("_")}
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
        out[key] = r
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="M x K x N, comma separated (K and N multiples of 128)")
    a = ap.parse_args(argv)
    if Path(a.out).exists():  # never overwrite an earlier run's results
        raise SystemExit(f"te_fp8_compare: {a.out} already exists; give another --out")
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        assert all(len(s) == 3 and s[1] % 128 == 0 and s[2] % 128 == 0 for s in shapes)
    except (ValueError, AssertionError):
        raise SystemExit(f"te_fp8_compare: --shapes {a.shapes!r}: expected MxKxN,... with K and N multiples of 128")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("te_fp8_compare: needs a CUDA device with Transformer Engine (docs/gpu.md, \"Transformer Engine\")")
    t0 = time.time()
    import transformer_engine

    rows = [compare(*s) for s in shapes]
    report = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "transformer_engine": transformer_engine.__version__, "torch": torch.__version__, "shapes": rows,
              "wall_s": time.time() - t0}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
