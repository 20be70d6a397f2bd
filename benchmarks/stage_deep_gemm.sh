#!/usr/bin/env bash
# DeepGEMM for the GPU machine: vLLM 0.26 vendors it as vllm/third_party/deep_gemm, which
# ../shared/gpu/stage_vllm.sh strips from the payload. Stock DeepSeek-V4 needs it (docs/gpu.md
# "Stock DeepSeek-V4 on CUDA vLLM 0.26"): the lightning indexer refuses to build without it, and the
# output projection (wo_a) and the hyper-connection pre-norm GEMM call it.
#
#   here (project root):  VLLM_WHEEL=/path/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl \
#                         bash benchmarks/stage_deep_gemm.sh .gpu_stage/dg
#       -> .gpu_stage/dg/deep_gemm.tar.xz (+ .sha256): one part, the cp312 extension, the Python
#          package and the headers its JIT compiles against (include/deep_gemm, cute, cutlass)
#   GPU machine (project root, any call that carries .gpu_stage/dg):
#                         bash benchmarks/stage_deep_gemm.sh --install .gpu_stage/dg
#       -> copies the part to $DG_STASH (/root/stage_dg); once vLLM is installed in $SITE
#          (/root/vllm_site, device_install.sh install) it unpacks it to
#          $SITE/vllm/third_party/deep_gemm. Before that it only stashes: run
#          `bash benchmarks/stage_deep_gemm.sh --install` (no folder) after the vLLM install.
#
# Only the cp312 extension is kept (the image runs Python 3.12); PY_TAG=cpython-311 etc. for another.
# DeepGEMM compiles its kernels at first use with the CUDA toolkit of $CUDA_HOME (else the nvcc on
# PATH, else /usr/local/cuda); its cache goes to $DG_JIT_CACHE_DIR (vLLM: ~/.cache/vllm/deep_gemm).
set -euo pipefail
PY_TAG=${PY_TAG:-cpython-312}
SITE=${SITE:-/root/vllm_site}
DG_STASH=${DG_STASH:-/root/stage_dg}
PART=deep_gemm.tar.xz

if [ "${1:-}" = --install ]; then
  if [ -n "${2:-}" ]; then
    mkdir -p "$DG_STASH"
    cp "$2/$PART" "$2/$PART.sha256" "$DG_STASH/"
  fi
  (cd "$DG_STASH" && sha256sum -c "$PART.sha256")
  if [ ! -d "$SITE/vllm" ]; then
    echo "deep_gemm stashed in $DG_STASH; vLLM is not installed in $SITE yet: run this again with --install" \
         "(no folder) after device_install.sh install"
    exit 0
  fi
  rm -rf "$SITE/vllm/third_party/deep_gemm"
  tar -xJf "$DG_STASH/$PART" -C "$SITE"
  echo "deep_gemm installed: $(du -sm "$SITE/vllm/third_party/deep_gemm" | cut -f1) MiB in" \
       "$SITE/vllm/third_party/deep_gemm; CUDA_HOME=${CUDA_HOME:-unset}, nvcc: $(command -v nvcc || echo none)"
  exit 0
fi

OUT=${1:?usage: stage_deep_gemm.sh OUTDIR | --install [DIR]}
WHL=${VLLM_WHEEL:-$(ls .gpu_stage/.work/dl/vllm-0.26.0-*.whl 2>/dev/null | head -1 || true)}
[ -n "$WHL" ] && [ -f "$WHL" ] || { echo "no vLLM 0.26.0 wheel: set VLLM_WHEEL (stage_vllm.sh downloads it)"; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# the wheel is only read: unzip lists and extracts the one folder
(cd "$TMP" && unzip -q "$WHL" 'vllm/third_party/deep_gemm/*')
D=$TMP/vllm/third_party/deep_gemm
[ -f "$D/_C.$PY_TAG-x86_64-linux-gnu.so" ] || { echo "no _C.$PY_TAG extension in $WHL"; exit 3; }
find "$D" -maxdepth 1 -name '_C.cpython-*.so' ! -name "_C.$PY_TAG-*" -delete
find "$D" -name __pycache__ -prune -exec rm -rf {} +
# sorted names and fixed owner / time: the same wheel gives the same bytes
(cd "$TMP" && tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00Z' \
   -cf - vllm/third_party/deep_gemm | xz -9e -T"${XZ_THREADS:-2}" > "$OUT/$PART")
(cd "$OUT" && sha256sum "$PART" > "$PART.sha256")
echo "deep_gemm: $(find "$D" -type f | wc -l) files, $(du -sm "$D" | cut -f1) MiB unpacked ->" \
     "$OUT/$PART $(du -k "$OUT/$PART" | cut -f1) KiB"
