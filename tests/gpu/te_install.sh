#!/usr/bin/env bash
# Device side of the Transformer Engine carry (benchmarks/stage_te.sh; docs/gpu.md "Transformer Engine").
# From the project root on the GPU machine, after the vLLM carry's `device_install.sh install` (which
# recreates $SITE: TE goes in after it) and `source /root/rzbin/device_env.sh`:
#
#   bash tests/gpu/te_install.sh stash .gpu_stage/te_c1   # each carried part -> $TE_STASH
#   bash tests/gpu/te_install.sh install                   # all parts there: assemble, build, install, check
#   source /root/rzbin/te_env.sh                           # in later calls (written by install)
#
# install, step by step (timings printed; the whole log also in $OUT/te/te_install.log):
#  1. the parts -> te_payload.tar.xz (sha256 checked), unpacked under $TE_BUILD, MANIFEST.sha256 checked;
#  2. the machine: python, torch (+ its CUDA, cuDNN, NCCL), nvcc (CUDA_HOME), g++, ninja, and where
#     the headers the extension includes are (the toolkit's, else the image's nvidia-* Python packages:
#     cudnn.h from nvidia-cudnn-cu13, nccl.h from nvidia-nccl-cu13); the ones the toolkit lacks go on CPATH;
#  3. unless the payload holds a built transformer_engine_torch wheel: compile it from the source
#     archive with the image's torch, setuptools, wheel, pybind11 (torch's headers) and ninja, no build
#     isolation, no index (NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=16, NVTE_WITH_NCCL_EP=0:
#     no NCCL expert-parallel bindings; NVTE_NO_LOCAL_VERSION=1: version 2.20.2 exactly, as the core's;
#     NVTE_PYTORCH_FORCE_BUILD=TRUE: no attempt to download a prebuilt wheel). It is a C++ extension
#     (33 files, no CUDA sources): nvcc is only asked for its version;
#  4. the built wheel -> $OUT/te_wheel/ (pieces of 15 MiB if larger, and SHA256SUMS) so it comes back:
#     put it in .gpu_stage/te/built/ here and stage_te.sh stages it, so the next machine skips step 3;
#  5. pip install --target $SITE (no index, no deps) of the sm_90 core wheel, the meta wheel and the
#     extension: one pip call, as they share the transformer_engine/ folder;
#  6. /root/rzbin/te_env.sh: CUDNN_HOME = the image's nvidia/cudnn (TE's own loader looks there first,
#     else it takes a toolkit cuDNN torch did not load); LD_LIBRARY_PATH += the image's nvidia/{cudnn,nccl,cu13}/lib, so that the
#     core library's cuDNN / NCCL / cuBLAS resolve to torch's copies also when TE is imported first;
#  7. the check: import transformer_engine.pytorch (its version), a TE RMSNorm+Linear, a grouped
#     linear and a causal DotProductAttention forward + backward in bf16 (the attention backend it picked
#     and the cuDNN it loaded, beside torch's), megatron-core's HAVE_TE, te_spec.te_unavailable() is None.
set -euo pipefail
TE_VER=2.20.2
STASH=${TE_STASH:-/root/te_stage}
SITE=${SITE:-/root/vllm_site}
BUILD=${TE_BUILD:-/root/te_build}
OUT=${OUT:-/tmp/rz_out}
ENVF=${TE_ENV:-/root/rzbin/te_env.sh}
PY=${PY:-python3}
T0=$SECONDS
ts() { echo "[te_install +$((SECONDS - T0)) s] $*"; }

case "${1:-}" in
  stash)
    mkdir -p "$STASH"
    cp "$2"/* "$STASH"/
    ts "stash: $(ls "$STASH" | tr '\n' ' ')($(du -sm "$STASH" | cut -f1) MiB)"
    exit 0 ;;
  install) ;;
  *) echo "usage: $0 stash DIR | install"; exit 2 ;;
esac

mkdir -p "$OUT/te"
exec > >(tee -a "$OUT/te/te_install.log") 2>&1
if [ -f "$SITE/.te_installed" ]; then
  ts "already installed in $SITE"
else
  # 1. assemble and unpack
  n=$(cat "$STASH/NPARTS")
  have=$(ls "$STASH"/te_payload.tar.xz.* | wc -l)
  [ "$have" = "$n" ] || { ts "have $have of $n parts: $(ls "$STASH")"; exit 3; }
  cat "$STASH"/te_payload.tar.xz.* > "$STASH/te_payload.tar.xz"
  (cd "$STASH" && sha256sum -c PAYLOAD_SHA256)
  rm -rf "$BUILD" && mkdir -p "$BUILD/payload" "$BUILD/wheel"
  "$PY" - "$STASH/te_payload.tar.xz" "$BUILD/payload" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    t.extractall(sys.argv[2])
PY
  rm -f "$STASH/te_payload.tar.xz"
  (cd "$BUILD/payload" && sha256sum -c MANIFEST.sha256)
  ts "unpacked: $(ls "$BUILD/payload" | tr '\n' ' ')"

  # 2. the machine
  PURELIB=$(env -u PYTHONPATH "$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  NVCC=""
  for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc \
           "$PURELIB/nvidia/cu13/bin/nvcc"; do
    if [ -n "$c" ] && [ -x "$c" ]; then NVCC=$(readlink -f "$c"); break; fi
  done
  CUDA_HOME=${NVCC:+$(dirname "$(dirname "$NVCC")")}
  export PATH="$(dirname "$(command -v "$PY")"):$PATH"  # the venv's console scripts (ninja)
  command -v ninja >/dev/null || export PATH="$(env -u PYTHONPATH "$PY" -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null):$PATH"
  CP=""
  echo "python $("$PY" -c 'import sys; print(sys.version.split()[0])') ($(command -v "$PY")), purelib $PURELIB"
  env -u PYTHONPATH "$PY" - <<'PY' || true
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None, "gpu",
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for p in ("setuptools", "wheel", "pybind11", "ninja", "packaging", "einops", "nvidia-cudnn-cu13", "nvidia-nccl-cu13",
          "nvidia-cuda-runtime", "nvidia-cublas"):
    try:
        print(f"  {p} {md.version(p)}")
    except md.PackageNotFoundError:
        print(f"  {p} MISSING")
PY
  echo "nvcc: ${NVCC:-MISSING} ($([ -n "$NVCC" ] && "$NVCC" --version | tail -1)); CUDA_HOME=${CUDA_HOME:-}"
  echo "g++: $(command -v g++ || echo MISSING) $(g++ -dumpfullversion 2>/dev/null || true); ninja: $(command -v ninja || echo MISSING) $(ninja --version 2>/dev/null || true)"
  for h in cuda_runtime.h cuda.h cudaTypedefs.h cuda_fp8.h cublasLt.h cublas_v2.h cusparse.h cusolverDn.h nvrtc.h cudnn.h nccl.h; do
    where=""
    for d in ${CUDA_HOME:+$CUDA_HOME/include} "$PURELIB"/nvidia/*/include /usr/include; do
      if [ -f "$d/$h" ]; then where=$d; break; fi
    done
    echo "  $h: ${where:-MISSING}"
    if [ -n "$where" ] && [ "$where" != "${CUDA_HOME:-}/include" ] && [ "$where" != /usr/include ]; then
      case ":$CP:" in *":$where:"*) ;; *) CP=${CP:+$CP:}$where ;; esac
    fi
  done
  ts "CPATH for the build: ${CP:-(none)}"

  # 3. the PyTorch extension: staged built, or compiled here
  TW=$(ls "$BUILD"/payload/transformer_engine_torch-$TE_VER-cp*.whl 2>/dev/null | head -1 || true)
  if [ -n "$TW" ]; then
    ts "using the staged build $(basename "$TW")"
  else
    [ -n "$NVCC" ] || { ts "no nvcc: cannot build transformer_engine_torch"; exit 4; }
    mkdir -p "$BUILD/src"
    tar -xzf "$BUILD/payload/transformer_engine_torch-$TE_VER.tar.gz" -C "$BUILD/src"
    ts "building transformer_engine_torch $TE_VER (MAX_JOBS=${MAX_JOBS:-16}); log $BUILD/build.log"
    tb=$SECONDS
    if ! (cd "$BUILD/src/transformer_engine_torch-$TE_VER" && env -u PYTHONPATH \
          NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=${MAX_JOBS:-16} NVTE_WITH_NCCL_EP=0 \
          NVTE_NO_LOCAL_VERSION=1 NVTE_PYTORCH_FORCE_BUILD=TRUE CUDA_HOME="$CUDA_HOME" \
          CPATH="${CP}${CPATH:+:$CPATH}" PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
          "$PY" -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$BUILD/wheel" . > "$BUILD/build.log" 2>&1); then
      tail -n 80 "$BUILD/build.log"
      ts "build FAILED after $((SECONDS - tb)) s"
      exit 5
    fi
    grep -E "Time for build_ext|ninja: |\[[0-9]+/[0-9]+\]" "$BUILD/build.log" | tail -3 || true
    TW=$(ls "$BUILD"/wheel/transformer_engine_torch-$TE_VER-*.whl)
    ts "built $(basename "$TW") ($(du -b "$TW" | cut -f1) bytes) in $((SECONDS - tb)) s"
    # 4. send it back (files under $OUT come back; at most 16 MiB each)
    mkdir -p "$OUT/te_wheel"
    (cd "$(dirname "$TW")" && sha256sum "$(basename "$TW")") > "$OUT/te_wheel/SHA256SUMS"
    if [ "$(du -b "$TW" | cut -f1)" -le $((15 * 1024 * 1024)) ]; then
      cp "$TW" "$OUT/te_wheel/"
    else
      split -b 15M -d -a 2 "$TW" "$OUT/te_wheel/$(basename "$TW").part"
    fi
    ts "wheel for the next staging: $(ls "$OUT/te_wheel" | tr '\n' ' ')"
  fi

  # 5. install next to vLLM
  mkdir -p "$SITE"
  [ -f "$SITE/.installed" ] || ts "note: $SITE has no vLLM install yet; device_install.sh install would remove it"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$BUILD/payload/transformer_engine_cu13-$TE_VER-py3-none-manylinux_2_28_x86_64.whl" \
    "$BUILD/payload/transformer_engine-$TE_VER-py3-none-any.whl" "$TW" 2>&1 | grep -v "WARNING: Target directory" || true
  ts "installed: $(du -sm "$SITE/transformer_engine" | cut -f1) MiB in $SITE/transformer_engine"

  # 6. the loader path
  mkdir -p "$(dirname "$ENVF")"
  LIBS=""
  for d in "$PURELIB/nvidia/cudnn/lib" "$PURELIB/nvidia/nccl/lib" "$PURELIB/nvidia/cu13/lib"; do
    [ -d "$d" ] && LIBS=${LIBS:+$LIBS:}$d
  done
  cat > "$ENVF" <<EOF
# written by tests/gpu/te_install.sh: source after device_env.sh. Transformer Engine's core library
# needs cuDNN, NCCL and cuBLAS; these are the copies torch itself loads (the image's nvidia-* packages).
export LD_LIBRARY_PATH="\${LD_LIBRARY_PATH:+\$LD_LIBRARY_PATH:}$LIBS"
# TE loads cuDNN itself, from CUDNN_HOME before CUDA_HOME and /usr/local/cuda: without this it took a
# cuDNN 9.14 found under the toolkit while torch had loaded its 9.19, and cuDNN's sub-libraries then
# failed to load (CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED), so TE ran its unfused attention.
export CUDNN_HOME="$PURELIB/nvidia/cudnn"
EOF
  touch "$SITE/.te_installed"
fi

# 7. the check (in a fresh process with the loader path)
source "$ENVF"
ti=$SECONDS
"$PY" - <<'PY'
import time
t = time.time()
import transformer_engine
import transformer_engine.pytorch as te
import torch
print(f"transformer_engine {transformer_engine.__version__} (transformer_engine.pytorch imported in {time.time() - t:.1f} s)")
x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
lin = te.LayerNormLinear(1024, 512, bias=False, normalization="RMSNorm", params_dtype=torch.bfloat16)
y = lin(x)
y.float().square().mean().backward()
grouped = te.GroupedLinear(4, 1024, 512, bias=False, params_dtype=torch.bfloat16)
z = grouped(x, [64, 0, 100, 92])
z.float().square().mean().backward()
torch.cuda.synchronize()
print(f"TE RMSNorm+Linear {tuple(y.shape)} and grouped linear {tuple(z.shape)}: forward + backward ok "
      f"({torch.cuda.get_device_name()}, finite: {bool(torch.isfinite(x.grad).all())})")
# TE's attention for a learner's shapes: which backend it picks, with the cuDNN it loaded
from transformer_engine.pytorch.utils import get_cudnn_version
from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa
q, k, v = (torch.randn(512, 2, 12, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
attn = te.DotProductAttention(12, 128, num_gqa_groups=12, attn_mask_type="causal", qkv_format="sbhd")
attn(q, k, v).float().square().mean().backward()
torch.cuda.synchronize()
b = dpa._attention_backends
picked = ("flash" if b.get("use_flash_attention") else "fused (cuDNN)" if b.get("use_fused_attention")
          else "unfused")
print(f"TE attention (sbhd, causal, 12 heads of 128, bf16): {picked}; TE's cuDNN "
      f"{'.'.join(map(str, get_cudnn_version()))}, torch's {torch.backends.cudnn.version()}")
from megatron.core.extensions import transformer_engine as mc_te
from megatron_rz.learner.te_spec import te_unavailable
print("megatron-core HAVE_TE:", mc_te.HAVE_TE, "| te_spec.te_unavailable():", te_unavailable())
PY
ts "check done in $((SECONDS - ti)) s"
