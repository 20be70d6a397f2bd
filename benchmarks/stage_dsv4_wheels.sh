#!/usr/bin/env bash
# The Python packages stock DeepSeek-V4 of CUDA vLLM 0.26 imports at run time and that neither the
# GPU image nor ../shared/gpu/stage_vllm.sh's payload has (docs/gpu.md "Stock DeepSeek-V4 on CUDA
# vLLM 0.26"): TileLang (the hyper-connection kernels, model_executor/kernels/mhc/tilelang_kernels.py,
# no fallback on CUDA) with z3-solver, and the CUTLASS Python DSL (the compressor of every compressed
# layer, models/deepseek_v4/nvidia/ops/sparse_attn_compress_cutedsl.py) with quack-kernels and
# cuda-python. DeepGEMM is benchmarks/stage_deep_gemm.sh.
#
#   here (project root):  bash benchmarks/stage_dsv4_wheels.sh .gpu_stage/v4
#       -> .gpu_stage/v4/w1 .. wN, one part of at most PART_MB (45) MiB each, so that a part and the
#          project tree (~15 MB) stay under the 64 MiB one call to the GPU machine brings along.
#          The wheels are repacked uncompressed (same files, same RECORD) so that xz sees raw bytes:
#          ~30% smaller than the registry's deflated wheels.
#   GPU machine (project root), one call per part, each within 30 s of the previous one's end:
#          bash benchmarks/stage_dsv4_wheels.sh --stash .gpu_stage/v4/wK     (copies to $V4_STASH)
#          bash benchmarks/stage_dsv4_wheels.sh --install                    (all parts there; after
#                                                                           device_install.sh install)
#       then `source benchmarks/dsv4_gpu_env.sh` after /root/rzbin/device_env.sh.
#
# Versions: vLLM 0.26 pins tilelang 0.1.9 and nvidia-cutlass-dsl 4.6.0; quack-kernels 0.6.0 is the
# release that pins cutlass-dsl 4.6.0 (0.6.1+ want newer ones); z3-solver < 4.15.5 (tilelang's
# bound); only the cu13 flavour of the DSL's libraries (the image's torch is cu130, and the DSL picks
# the flavour that is installed). Not carried: nvidia-cuda-nvdisasm (the DSL runs it only to dump
# SASS), the DSL's cu12 libraries. cuda-python / cuda-bindings, ml-dtypes and einops are carried but
# installed only where the image cannot import them already.
set -euo pipefail
SITE=${SITE:-/root/vllm_site}
V4_STASH=${V4_STASH:-/root/stage_v4}
PAYLOAD=dsv4_wheels.tar.xz

# always installed / installed only when the module does not import (module=requirement)
WHEELS=(tilelang==0.1.9 z3-solver==4.15.4.0 nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-base==4.6.0
        nvidia-cutlass-dsl-libs-core==4.6.0 nvidia-cutlass-dsl-libs-cu13==4.6.0 quack-kernels==0.6.0
        torch-c-dlpack-ext==0.1.5)
IF_MISSING=(cuda.bindings.driver=cuda-bindings==13.0.3 cuda.pathfinder=cuda-pathfinder==1.9.1
            cuda=cuda-python==13.0.3 ml_dtypes=ml-dtypes==0.7.0 einops=einops==0.8.2)

case "${1:-}" in
  --stash)
    mkdir -p "$V4_STASH"
    cp -v "$2"/* "$V4_STASH"/
    echo "v4 stash: $(ls "$V4_STASH" | tr '\n' ' ')"
    exit 0 ;;
  --install)
    [ -d "$SITE/vllm" ] || { echo "no vLLM in $SITE: run device_install.sh install first"; exit 3; }
    n=$(cat "$V4_STASH/NPARTS")
    have=$(ls "$V4_STASH"/$PAYLOAD.[0-9]* | wc -l)
    [ "$have" = "$n" ] || { echo "have $have of $n parts: $(ls "$V4_STASH")"; exit 3; }
    cd "$V4_STASH"
    cat $PAYLOAD.[0-9]* > $PAYLOAD
    sha256sum -c $PAYLOAD.sha256
    rm -rf x && mkdir x && tar -xJf $PAYLOAD -C x && rm -f $PAYLOAD
    whl=()
    for r in "${WHEELS[@]}"; do n=${r%%==*}; whl+=("$(ls x/"${n//-/_}"-"${r##*==}"-*.whl)"); done
    for mr in "${IF_MISSING[@]}"; do
      m=${mr%%=*}; r=${mr#*=}; n=${r%%==*}
      if PYTHONPATH="$SITE" python3 -c "import $m" 2>/dev/null; then echo "have $m: not installing $r"
      else whl+=("$(ls x/"${n//-/_}"-"${r##*==}"-*.whl)"); fi
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${whl[@]}" 2>&1 \
      | grep -v "WARNING: Target directory" || true
    rm -rf x
    echo "installed in $SITE: $(printf '%s ' "${whl[@]##*/}")"
    exit 0 ;;
esac

OUT=${1:?usage: stage_dsv4_wheels.sh OUTDIR | --stash DIR | --install}
PART_MB=${PART_MB:-45}
PY=${PY:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-.gpu_stage/.work}
mkdir -p "$WORK/v4whl" "$WORK/v4stored"
WORK=$(cd "$WORK" && pwd)
PIPDL=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$WORK/v4whl")
reqs=("${WHEELS[@]}")
for mr in "${IF_MISSING[@]}"; do reqs+=("${mr#*=}"); done
rm -rf "$WORK/v4stored" && mkdir -p "$WORK/v4stored"
for r in "${reqs[@]}"; do
  n=${r%%==*}; v=${r##*==}
  f=$(ls "$WORK/v4whl/${n//-/_}-$v-"*.whl 2>/dev/null | head -1 || true)
  [ -n "$f" ] || { "${PIPDL[@]}" "$r" 2>&1 | grep -v "is ignored" || true; f=$(ls "$WORK/v4whl/${n//-/_}-$v-"*.whl | head -1); }
  # the same wheel with every member stored (pip installs it alike; RECORD hashes the files, not the zip)
  "$PY" - "$f" "$WORK/v4stored/$(basename "$f")" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zi, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_STORED) as zo:
    for info in zi.infolist():
        zo.writestr(info, zi.read(info.filename), compress_type=zipfile.ZIP_STORED)
PY
done
echo "wheels: $(ls "$WORK/v4whl" | wc -l) files, $(du -cm "$WORK"/v4stored/*.whl | tail -1 | cut -f1) MiB stored"
(cd "$WORK/v4stored" && tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00Z' -cf - *.whl \
   | xz -6 -T"${XZ_THREADS:-2}" > "$WORK/$PAYLOAD")
rm -rf "$OUT"/w[0-9]* "$WORK/v4split" && mkdir -p "$WORK/v4split"
split -b "${PART_MB}M" -d -a 2 "$WORK/$PAYLOAD" "$WORK/v4split/$PAYLOAD."
i=0
for p in "$WORK"/v4split/$PAYLOAD.*; do
  i=$((i + 1)); mkdir -p "$OUT/w$i"; mv "$p" "$OUT/w$i/"
done
(cd "$WORK" && sha256sum $PAYLOAD > "$OUT/w$i/$PAYLOAD.sha256")
echo "$i" > "$OUT/w$i/NPARTS"
rm -f "$WORK/$PAYLOAD"
echo "$PAYLOAD in $i parts:"
du -k "$OUT"/w*/$PAYLOAD.*
