bash /root/rzbin/device_install.sh stash .gpu_stage/c3 > $OUT/install.log 2>&1 && bash /root/rzbin/device_install.sh install >> $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
source /root/rzbin/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
(lscpu | grep -E "Model name|^CPU\(s\)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,pstate --format=csv) > $OUT/machine.txt
python3 benchmarks/sampler_host.py --out $OUT/sampler_host.json > $OUT/sampler_host.log 2>&1; tail -8 $OUT/sampler_host.log
python3 benchmarks/rollout_gpu.py ckpt --config moe1b --out /root/ckpt/moe1b > $OUT/ckpt.log 2>&1
C="--ckpt /root/ckpt/moe1b --cells 1x64x128,32x64x128,64x512x512 --rounds 3 --seeded on,off"
B="python3 benchmarks/rollout_gpu.py bench-one $C"
$B --engine stock --out $OUT/d_stock_mp.json > $OUT/d_stock_mp.log 2>&1
$B --engine aligned --out $OUT/d_aligned_mp.json > $OUT/d_aligned_mp.log 2>&1
VLLM_ENABLE_V1_MULTIPROCESSING=0 $B --engine aligned --out $OUT/d_aligned_ip.json > $OUT/d_aligned_ip.log 2>&1
VLLM_ENABLE_V1_MULTIPROCESSING=0 $B --engine stock --out $OUT/d_stock_ip.json > $OUT/d_stock_ip.log 2>&1
RZ_BATCHED_DRAW=0 $B --engine aligned --out $OUT/d_aligned_vdraw.json > $OUT/d_aligned_vdraw.log 2>&1
for f in $OUT/d_*.log; do echo "== $f"; grep -E "engine up|median" $f | cut -c1-200; done
