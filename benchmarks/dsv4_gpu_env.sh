# Source on the GPU machine after /root/rzbin/device_env.sh, once stage_deep_gemm.sh and
# stage_dsv4_wheels.sh have installed their parts into $SITE (docs/gpu.md "Stock DeepSeek-V4").
# * The CUTLASS Python DSL's wheel puts its packages on sys.path through a .pth file, which Python
#   reads only in site directories; $SITE is on PYTHONPATH, so add the folder here (vLLM's engine
#   and worker processes inherit it).
# * DeepGEMM and TileLang compile their kernels at first use with the CUDA toolkit: point CUDA_HOME
#   at /usr/local/cuda when nothing set it and nvcc is not on PATH.
SITE=${SITE:-/root/vllm_site}
case ":$PYTHONPATH:" in
  *":$SITE/nvidia_cutlass_dsl/dsl_packages:"*) ;;
  *) export PYTHONPATH="$PYTHONPATH:$SITE/nvidia_cutlass_dsl/dsl_packages" ;;
esac
if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda PATH="/usr/local/cuda/bin:$PATH"
fi
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/root/.cache/deep_gemm}
