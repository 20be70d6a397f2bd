#!/usr/bin/env bash
# One H200 session's GPU work, stage by stage (docs/gpu.md): run after the three staging calls of
# ../shared/gpu/README.md, with `source /root/rzbin/device_env.sh` done and the tree installed
# (`python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .`).
#
#   bash tests/gpu/h200_session.sh STAGE [STAGE ...]     results under $OUT/<stage>/
#
# Stages:
#   ckpt   random bf16 checkpoints for the engine benchmarks (/root/ckpt/{moe1b,dsv3_4l})
#   tests  tests/gpu/test_aligned_cuda_engine.py (aligned CUDA engine: batch invariance, decode ==
#          prefill, == learner kernels, in-place reload) and the Triton kernel tests
#   check  `rz check` (Megatron learner on the GPU beside the aligned CUDA engine, CUDA graphs)
#          for tiny_moe and tiny_dsv3 in bf16, aligned; base models carried in gpu_runs/
#   fast   the same checks in fast mode (stock vLLM CUDA classes + stock Megatron layers)
#   train  `rz train` on the GPU, aligned, a few sync updates and a few async (lag 2) ones
#   bench  rollout time aligned vs stock on moe1b (batch 256 with 7 rounds, then 32 and 1)
#   profile  per-kernel split of the batch-256 cell, aligned and stock
set -u
OUT=${OUT:-/tmp/rz_out}
mkdir -p "$OUT"
PY=$(command -v python3)
export RZ_GPU_CKPT=${RZ_GPU_CKPT:-/root/ckpt/moe1b}
log() { echo "[h200 $(date +%T)] $*"; }

run_stage() {
  local st=$1 d="$OUT/$1"
  mkdir -p "$d"
  local t0=$SECONDS
  case "$st" in
    ckpt)
      for c in moe1b dsv3_4l; do
        [ -f "/root/ckpt/$c/config.json" ] || "$PY" benchmarks/rollout_gpu.py ckpt --config "$c" --out "/root/ckpt/$c"
      done ;;
    tests)
      timeout 420 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_aligned_cuda_engine.py \
        tests/gpu/test_triton_kernels.py 2>&1 | tail -25 | tee "$d/pytest.txt" ;;
    check|fast)
      local mode=aligned; [ "$st" = fast ] && mode=fast
      for r in tiny_moe tiny_dsv3; do
        local rd=gpu_runs/$r; [ "$mode" = fast ] && rd=gpu_runs/${r}_fast
        timeout 300 rz check "recipes/$r.yaml" mode=$mode model.dtype=bfloat16 "logging.run_dir=$rd" \
          logging.wandb=false > "$d/$r.log" 2>&1
        echo "rc=$? $r $mode" | tee -a "$d/summary.txt"
        grep -E "bitwise|tokens|match|max \|" "$d/$r.log" | tail -8 | tee -a "$d/summary.txt"
        cp "$rd/check.json" "$d/$r.check.json" 2>/dev/null
      done ;;
    train)
      local r=tiny_moe rd=gpu_runs/tiny_moe_train
      timeout 300 rz train "recipes/$r.yaml" model.dtype=bfloat16 "logging.run_dir=$rd" schedule.steps=6 \
        schedule.eval_every=3 logging.wandb=false > "$d/sync.log" 2>&1
      echo "rc=$? sync" | tee -a "$d/summary.txt"; tail -5 "$d/sync.log" >> "$d/summary.txt"
      cp "$rd/metrics.jsonl" "$d/sync_metrics.jsonl" 2>/dev/null ;;
    bench)
      "$PY" benchmarks/rollout_gpu.py bench --ckpt /root/ckpt/moe1b --out "$d/bench_moe1b_256.json" \
        --cells 256x64x128 --rounds 7 2>&1 | grep -vE "^(INFO|WARNING|\(EngineCore)" | tail -15
      "$PY" benchmarks/rollout_gpu.py bench --ckpt /root/ckpt/moe1b --out "$d/bench_moe1b_small.json" \
        --cells 32x64x128,1x64x128 --rounds 3 2>&1 | grep -vE "^(INFO|WARNING|\(EngineCore)" | tail -15 ;;
    profile)
      for e in aligned stock; do
        "$PY" benchmarks/rollout_gpu.py profile --ckpt /root/ckpt/moe1b --out "$d/profile_256_$e.json" \
          --cells 256x64x64 --engine $e 2>&1 | grep -vE "^(INFO|WARNING|\(EngineCore)" | tail -30
      done ;;
    *) echo "unknown stage $st"; return 2 ;;
  esac
  log "stage $st done in $((SECONDS - t0)) s"
}

for st in "$@"; do run_stage "$st"; done
