#!/usr/bin/env bash
# One H200 session's GPU work, stage by stage (docs/gpu.md): run after the three staging calls of
# ../shared/gpu/README.md, with `source /root/rzbin/device_env.sh` done and the tree installed
# (`python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .`).
#
#   bash tests/gpu/h200_session.sh STAGE [STAGE ...]     results under $OUT/<stage>/
#
# A call returns at most 8 files of $OUT: with more, each stage's folder is packed into $OUT/<stage>.tgz
# at the end (PACK_OUT=0: leave them), and if that is still more than 8 files, all of $OUT into out.tgz.
#
# Stages:
#   te     Transformer Engine for the fast learner: tests/gpu/te_install.sh install (its parts stashed by the
#          call that carried them: `bash tests/gpu/te_install.sh stash .gpu_stage/te_c1`), then the import
#          check; exports te_env.sh's LD_LIBRARY_PATH for the stages after it (later calls: source
#          /root/rzbin/te_env.sh). A built extension wheel comes back in $OUT/te_wheel/ (docs/gpu.md)
#   te_fp8 TE's blockwise FP8 recipe vs the project's FP8 (benchmarks/te_fp8_compare.py; after te; TE_FP8_SHAPES)
#   ckpt   random bf16 checkpoints for the engine benchmarks (/root/ckpt/<config>, CKPT_CONFIGS: default
#          "moe1b dsv3_4l"; rollout_gpu.py CONFIGS)
#   sync   colocated weight sync, ipc vs inprocess, every parameter verified (benchmarks/sync_gpu.py)
#   learner  the learner's train step aligned vs fast_te vs fast_local (benchmarks/learner_gpu.py; LEARNER_CONFIGS,
#          LEARNER_MODES, LEARNER_PROFILE=1, LEARNER_TE_DEBUG=1: TE's attention-backend reasons in the JSON)
#   step   `rz bench step recipes/gpu_moe.yaml`: the whole RL step aligned vs fast (rollout / learner / sync)
#   stab   one GPU segment of the stability comparison (tiny_moe, bf16 both sides, lag 8 aligned vs fast;
#          STAB_ROOT_IN continues a carried root, STAB_LEGS / STAB_STEPS / STAB_SLICE / STAB_BUDGET / STAB_S)
#   verify_cost  the sync check's exact checksum per GB: per tensor vs the whole list at once (benchmarks/verify_cost.py)
#   sampler  the sampler's host / GPU cost per call, stock vs aligned, fused epilogue on and off
#          (benchmarks/sampler_host.py)
#   tests  tests/gpu/test_aligned_cuda_engine.py (aligned CUDA engine: batch invariance, decode ==
#          prefill, == learner kernels, in-place reload), stock vLLM's in-place reload of the routed
#          experts, and the Triton kernel tests (GPU_TESTS=... picks files)
#   tune   the GEMM pick table of a model's shapes on this GPU (TUNE_CONFIGS, default qwen2_1p5b; ckpts in
#          /root/ckpt; TUNE_MS): $OUT/tune/table_<config>.json and /root/gemm_tables/<config>.json (kept on
#          the machine while it stays warm), used by the bench with RZ_GEMM_TABLE=/root/gemm_tables/<config>.json
#   segments  the Triton GEMM / routed-expert down GEMM at 1-16 row-parallel K segments
#   check  `rz check` (Megatron learner on the GPU beside the aligned CUDA engine, CUDA graphs)
#          for tiny_moe and tiny_dsv3 in bf16, aligned; base models carried in gpu_runs/
#   fast   the same checks in fast mode (stock vLLM CUDA classes + stock Megatron layers: TE ones after the te stage)
#   train  `rz train` on the GPU: aligned sync, aligned async (lag 2), fast sync; per-update D3 / bitwise
#   d3     the D3 experiment on recipes/gpu_moe.yaml: GPU warm start, aligned and fast at lag 2
#          (D3_MODES, D3_LAG, D3_S seconds, D3_EXTRA: more recipe overrides, e.g. algo.lr=1e-5, D3_TAG: run-dir suffix)
#   warm   only the gpu_moe warm start of d3 (kept on the machine for the later calls)
#   async  `rz bench async recipes/gpu_moe.yaml --lags ASYNC_LAGS` (default 2,8): updates/s async vs
#          sync on one H200 (learner and engine share it), weight-sync bytes / seconds, copy bandwidth
#   bench_dsv3  rollout time aligned vs stock on the DeepSeek-V3-shaped dsv3_4l (batch 256, 32, 1)
#   bench_long  moe1b with 1024-token prompts (256 x 1024 x 128) and 1024 new tokens (32 x 64 x 1024)
#   profile_small  per-kernel split of the batch-32 cell, aligned and stock
#   bench  rollout time aligned vs stock on moe1b (batch 256 with 7 rounds, then 32 and 1)
#   profile  per-kernel split of the batch-256 cell, aligned and stock
#   profile_rl  the RL cell 64 x 512 x 256: aligned, aligned_base (this round's decode plans off) and
#          stock, each alone in its own process: wall, marginal decode step, kernels, host (cProfile)
#   attn   decode attention alone: the aligned paged kernel at several split counts beside vLLM's
#          FlashAttention, RL decode shapes (benchmarks/attn_decode_gpu.py; ATTN_SHAPES)
#   bench_rl   the RL grid (rollout_gpu.py DEFAULT_CELLS), each engine alone in its own process, 5
#          rounds per cell: BENCH_ENGINES (default stock,aligned), BENCH_SEEDED (default on), BENCH_CKPT
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
    te)
      bash tests/gpu/te_install.sh install
      echo "rc=$? te_install" >> "$d/summary.txt"
      [ -f /root/rzbin/te_env.sh ] && source /root/rzbin/te_env.sh
      "$PY" -c "import transformer_engine, transformer_engine.pytorch as te; print('transformer_engine', transformer_engine.__version__)" \
        2>&1 | tail -3 | tee -a "$d/summary.txt" ;;
    te_fp8)
      # whether TE's Float8BlockScaling computes the project's blockwise FP8 bits (after the te stage)
      "$PY" benchmarks/te_fp8_compare.py --out "$d/te_fp8.json" ${TE_FP8_SHAPES:+--shapes $TE_FP8_SHAPES} \
        > "$d/te_fp8.log" 2>&1
      echo "rc=$? te_fp8" >> "$d/summary.txt"
      tail -8 "$d/te_fp8.log" | cut -c1-600 | tee -a "$d/summary.txt" ;;
    ckpt)
      for c in ${CKPT_CONFIGS:-moe1b dsv3_4l}; do
        [ -f "/root/ckpt/$c/config.json" ] || "$PY" benchmarks/rollout_gpu.py ckpt --config "$c" --out "/root/ckpt/$c"
      done ;;
    tests)
      timeout ${TESTS_TIMEOUT:-540} "$PY" -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu/test_aligned_cuda_engine.py \
        tests/gpu/test_stock_reload.py tests/gpu/test_triton_kernels.py} > "$d/pytest_full.txt" 2>&1
      grep -E "^E  |^FAILED|^ERROR|passed|failed" "$d/pytest_full.txt" | tail -40 | tee "$d/pytest.txt" ;;
    tune)
      # measured GEMM tile picks for a model's own shapes on this GPU (kernels/triton/gemm_table.py):
      # every config at every M, the fastest per (K, N, k_segments, M) written as a pick table; the
      # bench uses it with RZ_GEMM_TABLE=$d/table_<config>.json (commit it under kernels/triton/gemm_tables/)
      for c in ${TUNE_CONFIGS:-qwen2_1p5b}; do
        "$PY" benchmarks/gpu_kernels.py --sweep --model "/root/ckpt/$c" \
          --ms ${TUNE_MS:-1 16 32 64 128 256 512 1024 2048 4096 8192} --out "$d/sweep_$c.json" \
          --table-out "$d/table_$c.json" > "$d/sweep_$c.log" 2>&1
        echo "rc=$? tune $c" | tee -a "$d/summary.txt"
        # $OUT is a fresh folder in every call: keep the table on the machine for the later calls
        mkdir -p /root/gemm_tables && cp "$d/table_$c.json" "/root/gemm_tables/$c.json" 2>/dev/null
        grep -E "^shapes|^K=|table|Error" "$d/sweep_$c.log" | sed -E 's/  \|.*//' | tail -70 | tee -a "$d/summary.txt"
      done ;;
    segments)
      "$PY" benchmarks/gpu_kernels.py --groups segments --out "$d/segments.json" 2>&1 | tail -120 ;;
    check|fast)
      local mode=aligned; [ "$st" = fast ] && mode=fast
      for r in ${CHECK_RECIPES:-tiny_moe tiny_dsv3 tiny_qwen2}; do
        local rd=gpu_runs/$r; [ "$mode" = fast ] && rd=gpu_runs/${r}_fast
        # the warm start on the GPU: on the machine's CPU tiny_moe's 2000 SFT steps take ~80 s
        # (measured 2026-12-04: two 100 s checks timed out before their engines started)
        timeout 300 rz check "recipes/$r.yaml" mode=$mode model.dtype=bfloat16 "logging.run_dir=$rd" \
          logging.wandb=false ${CHECK_OVERRIDES:-warm_start.device=cuda} > "$d/$r.log" 2>&1
        echo "rc=$? $r $mode" | tee -a "$d/summary.txt"
        grep -E "bitwise|tokens|match|max \|" "$d/$r.log" | tail -8 | tee -a "$d/summary.txt"
        cp "$rd/check.json" "$d/$r.check.json" 2>/dev/null
      done ;;
    train)
      # aligned sync (lag 0: every update bitwise), aligned async (lag 2), fast sync; base models carried
      local r=tiny_moe
      local variants=${TRAIN_VARIANTS:-"aligned:0:tiny_moe_train aligned:2:tiny_moe_train fast:0:tiny_moe_fast"}
      for v in $variants; do
        set -- ${v//:/ }
        local rd=/root/runs/${r}_$1_lag$2
        mkdir -p "$rd" && cp -r "gpu_runs/$3/base_model" "$rd/" 2>/dev/null
        timeout 280 rz train "recipes/$r.yaml" mode=$1 model.dtype=bfloat16 "logging.run_dir=$rd" \
          schedule.steps=${TRAIN_STEPS:-6} schedule.max_lag=$2 schedule.eval_every=0 logging.wandb=false \
          > "$d/$1_lag$2.log" 2>&1
        echo "rc=$? $1 lag $2" | tee -a "$d/summary.txt"
        cp "$rd/metrics.jsonl" "$d/$1_lag$2.metrics.jsonl" 2>/dev/null
        cp "$rd/summary.json" "$d/$1_lag$2.summary.json" 2>/dev/null
        "$PY" - "$rd/metrics.jsonl" <<'PYEOF' | tee -a "$d/summary.txt"
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])]
except OSError:
    sys.exit(0)
for r in rows:
    if "d3" in r:
        print(f"  step {r['step']}: d3 {r['d3']:.3g} bitwise {r.get('frac_bitwise')} lag0 {r.get('lag0_pure_frac_bitwise')}"
              f" reward {r.get('reward_mean'):.3f} t_step {r.get('time_step', 0):.2f}s t_learner {r.get('time_learner', 0):.2f}s")
PYEOF
        tail -c 600 "$d/$1_lag$2.log" | tr '\r' '\n' | tail -4 >> "$d/summary.txt"
      done
      set -- ;;
    warm|async|d3)
      # the D3 experiment on recipes/gpu_moe.yaml: one warm start on the GPU, then aligned
      # and fast at lag 2 from the same base model, each with D3_S seconds of updates
      # (schedule.time_limit_s: the run finishes at an update boundary with its summary and plots;
      # the outer timeout only guards start-up, evaluation and the final checkpoint)
      local base=/root/runs/gpu_moe_base/base_model
      if [ ! -f "$base/config.json" ]; then
        local t1=$SECONDS
        timeout 400 rz make-model recipes/gpu_moe.yaml --out "$base" > "$d/warm_start.log" 2>&1
        echo "rc=$? warm start in $((SECONDS - t1)) s" | tee -a "$d/summary.txt"
        tail -c 400 "$d/warm_start.log" | tr '\r' '\n' | tail -2 | tee -a "$d/summary.txt"
        cp "$base/warm_start.json" "$d/" 2>/dev/null
      fi
      if [ "$st" = async ]; then
        local rd=/root/runs/gpu_moe_bench_async
        mkdir -p "$rd/bench_async" && cp -r "$base" "$rd/bench_async/"
        timeout -k 30 ${ASYNC_TIMEOUT:-540} rz bench async recipes/gpu_moe.yaml --lags ${ASYNC_LAGS:-2,8} \
          schedule.steps=${ASYNC_STEPS:-12} "logging.run_dir=$rd" logging.wandb=false ${ASYNC_EXTRA:-} \
          > "$d/bench_async.log" 2>&1
        echo "rc=$? bench async" | tee -a "$d/summary.txt"
        grep -E "updates/s" "$d/bench_async.log" | tail -2 | tee -a "$d/summary.txt"
        cp "$rd"/bench_async/run*/bench_async.json "$d/" 2>/dev/null
        for r in "$rd"/bench_async/run*/*/metrics.jsonl; do cp "$r" "$d/$(basename "$(dirname "$r")").metrics.jsonl"; done
      fi
      [ "$st" = d3 ] || { log "stage $st done in $((SECONDS - t0)) s"; return 0; }
      for mode in ${D3_MODES-aligned fast}; do
        local rd=/root/runs/gpu_moe_${mode}_lag${D3_LAG:-2}${D3_TAG:-}
        mkdir -p "$rd" && cp -r "$base" "$rd/"
        timeout -s TERM -k 30 $(( ${D3_S:-240} + 200 )) rz train recipes/gpu_moe.yaml mode=$mode "logging.run_dir=$rd" \
          schedule.max_lag=${D3_LAG:-2} schedule.steps=${D3_STEPS:-400} schedule.time_limit_s=${D3_S:-240} \
          logging.wandb=false ${D3_EXTRA:-} > "$d/$mode.log" 2>&1
        echo "rc=$? gpu_moe $mode lag ${D3_LAG:-2}" | tee -a "$d/summary.txt"
        for f in metrics.jsonl summary.json run.json; do cp "$rd/$f" "$d/$mode.$f" 2>/dev/null; done
        cp -r "$rd/plots" "$d/$mode.plots" 2>/dev/null
        tail -c 800 "$d/$mode.log" | tr '\r' '\n' | tail -4 >> "$d/summary.txt"
      done ;;
    bench_dsv3)
      "$PY" benchmarks/rollout_gpu.py bench --ckpt /root/ckpt/dsv3_4l --out "$d/bench_dsv3_4l.json" \
        --cells 256x64x128,32x64x128,1x64x128 --rounds 3 2>&1 | grep -vE "^(INFO|WARNING|\(EngineCore)" | tail -15 ;;
    bench_long)
      "$PY" benchmarks/rollout_gpu.py bench --ckpt /root/ckpt/moe1b --out "$d/bench_moe1b_long.json" \
        --cells 256x1024x128,32x64x1024 --rounds 3 --mem-gb 30 2>&1 | grep -vE "^(INFO|WARNING|\(EngineCore)" | tail -15 ;;
    profile_small)
      for e in aligned stock; do
        "$PY" benchmarks/rollout_gpu.py profile --ckpt /root/ckpt/moe1b --out "$d/profile_32_$e.json" \
          --cells 32x64x64 --engine $e 2>&1 | grep -vE "^(INFO|WARNING|\(EngineCore)" | tail -30
      done ;;
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
    profile_rl)
      for e in ${PROFILE_ENGINES:-aligned aligned_base stock}; do
        "$PY" benchmarks/rollout_gpu.py profile --ckpt "${BENCH_CKPT:-/root/ckpt/moe1b}" --out "$d/profile_rl_$e.json" \
          --cells ${PROFILE_CELLS:-64x512x256} --engine $e --seeded ${PROFILE_SEEDED:-on} > "$d/profile_rl_$e.log" 2>&1
        echo "rc=$? $e" >> "$d/summary.txt"
        grep -E "^== |Asynchronous scheduling|cudagraph|CUDA graph|Error|error" "$d/profile_rl_$e.log" | tail -12 | tee -a "$d/summary.txt"
      done ;;
    attn)
      "$PY" benchmarks/attn_decode_gpu.py --out "$d/attn_decode.json" ${ATTN_SHAPES:+--shapes $ATTN_SHAPES} \
        > "$d/attn_decode.log" 2>&1
      echo "rc=$? attn" >> "$d/summary.txt"
      grep -E "^\{|Error|error" "$d/attn_decode.log" | tail -20 | tee -a "$d/summary.txt" ;;
    bench_rl)
      "$PY" benchmarks/rollout_gpu.py bench --ckpt "${BENCH_CKPT:-/root/ckpt/moe1b}" --out "$d/bench_rl.json" \
        --engines ${BENCH_ENGINES:-stock,aligned} --seeded ${BENCH_SEEDED:-on} --rounds ${BENCH_ROUNDS:-5} \
        ${BENCH_CELLS:+--cells $BENCH_CELLS} > "$d/bench_rl.log" 2>&1
      echo "rc=$? bench_rl" >> "$d/summary.txt"
      grep -E "^\{|summary|engine up|failed|Traceback|Error" "$d/bench_rl.log" | tail -60 | tee -a "$d/summary.txt" ;;
    sync)
      # colocated weight sync (learner + aligned engine on one GPU), every parameter verified
      "$PY" benchmarks/sync_gpu.py --out "$d/sync_gpu.json" --transports ${SYNC_TRANSPORTS:-ipc,inprocess} \
        --rounds ${SYNC_ROUNDS:-3} > "$d/sync_gpu.log" 2>&1
      echo "rc=$? sync" >> "$d/summary.txt"
      grep -E "^\[sync\]|^\{|Traceback|Error" "$d/sync_gpu.log" | tail -20 | tee -a "$d/summary.txt" ;;
    learner)
      # the learner's train step, aligned vs fast, each alone in its own process
      "$PY" benchmarks/learner_gpu.py bench --out "$d/learner_gpu.json" --configs ${LEARNER_CONFIGS:-gpu_moe,qwen2_1p5b} \
        ${LEARNER_MODES:+--modes $LEARNER_MODES} \
        --rounds ${LEARNER_ROUNDS:-2} --budget-s ${LEARNER_BUDGET_S:-420} ${LEARNER_PROFILE:+--profile-dir $d/prof} \
        ${LEARNER_TE_DEBUG:+--te-debug} \
        > "$d/learner_gpu.log" 2>&1
      echo "rc=$? learner" >> "$d/summary.txt"
      grep -vE "^(INFO|WARNING|\(EngineCore)" "$d/learner_gpu.log" | tail -30 | tee -a "$d/summary.txt"
      # one file for all the profiles: a call's reply brings back a limited number of files
      if [ -d "$d/prof" ]; then tar -czf "$d/prof.tgz" -C "$d" prof && rm -rf "$d/prof"; fi ;;
    stab)
      # one segment of the stability comparison on the GPU (benchmarks/stability.py, bf16 learner and
      # vLLM in both modes, tiny_moe: its run directories are small enough to travel back under $OUT).
      # STAB_ROOT_IN: a root carried from an earlier segment (copied, then continued: nothing is
      # restarted); the continued root and the report come back in $d
      root="$d/root"
      if [ -n "${STAB_ROOT_IN:-}" ] && [ -d "$STAB_ROOT_IN" ]; then cp -r "$STAB_ROOT_IN" "$root"; fi
      timeout ${STAB_S:-540} "$PY" benchmarks/stability.py run --root "$root" --bf16 both \
        --legs ${STAB_LEGS:-aligned:8,fast:8} --steps ${STAB_STEPS:-2000} --slice-s ${STAB_SLICE:-120} \
        --budget-s ${STAB_BUDGET:-480} warm_start.device=cuda > "$d/stab.log" 2>&1
      echo "rc=$? stab" >> "$d/summary.txt"
      "$PY" benchmarks/stability.py report --root "$root" --out "$d/report" >> "$d/stab.log" 2>&1
      tail -12 "$d/report/report.md" 2>/dev/null | tee -a "$d/summary.txt" ;;
    verify_cost)
      # the every-parameter sync check's checksum: per tensor and the whole list at once (kernels.triton.bits)
      "$PY" benchmarks/verify_cost.py --device cuda --gb ${VERIFY_GB:-2} --out "$d/verify_cost.json" 2>&1 | tail -4 | tee "$d/summary.txt" ;;
    step)
      # the whole RL step, aligned vs fast, gpu_moe (GPU warm start), each mode in its own process
      timeout -k 30 ${STEP_TIMEOUT:-540} rz bench step recipes/gpu_moe.yaml schedule.steps=${STEP_STEPS:-8} \
        logging.run_dir=/root/runs/gpu_moe_bench_step logging.wandb=false ${STEP_EXTRA:-} > "$d/bench_step.log" 2>&1
      echo "rc=$? bench step" | tee -a "$d/summary.txt"
      grep -E "^RL step" "$d/bench_step.log" | tee -a "$d/summary.txt"
      cp /root/runs/gpu_moe_bench_step/bench_step/run*/bench_step.json "$d/" 2>/dev/null ;;
    sampler)
      "$PY" benchmarks/sampler_host.py --out "$d/sampler_host.json" > "$d/sampler_host.log" 2>&1
      echo "rc=$? sampler" >> "$d/summary.txt"
      tail -40 "$d/sampler_host.log" | tee -a "$d/summary.txt" ;;
    *) echo "unknown stage $st"; return 2 ;;
  esac
  log "stage $st done in $((SECONDS - t0)) s"
}

pack_out() {
  # a call to the GPU machine brings back at most 8 files of $OUT (the rest are left out): past that,
  # each stage's folder travels as one archive, or all of $OUT as one if that would still be too many
  local n folders top
  n=$(find "$OUT" -type f | wc -l)
  [ "$n" -le 8 ] && return 0
  folders=$(find "$OUT" -mindepth 1 -maxdepth 1 -type d | wc -l)
  top=$(find "$OUT" -mindepth 1 -maxdepth 1 -type f | wc -l)
  if [ $((folders + top)) -le 8 ]; then
    local d b
    for d in "$OUT"/*/; do
      b=$(basename "$d")
      tar -czf "$OUT/$b.tgz" -C "$OUT" "$b" && rm -rf "${OUT:?}/$b"
    done
  else
    local all
    all=$(mktemp "${TMPDIR:-/tmp}/rz_out.XXXXXX")
    tar -czf "$all" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$all" "$OUT/out.tgz"
  fi
  log "packed $n files of \$OUT into $(find "$OUT" -type f | wc -l) (a call returns at most 8 files)"
}

rc=0  # the first stage that failed sets the exit status (a later stage that passes does not hide it)
for st in "$@"; do run_stage "$st" || { s=$?; [ "$rc" -eq 0 ] && rc=$s; }; done
if [ "${PACK_OUT:-1}" = 1 ]; then pack_out; fi
exit $rc
