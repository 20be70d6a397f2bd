#!/usr/bin/env bash
# Run tests/gpu/test_learner_gpu.py on a GPU machine that has torch + triton but no megatron-core
# and no package registry. Wheels (megatron-core 0.16.1 cp312 and the pure-python / small deps of
# the learner path: pydantic(+core, annotated-types, typing-inspection, typing-extensions), pyyaml,
# safetensors, packaging, numpy) and a tiny_moe HF checkpoint travel in a git-ignored directory:
#
#   .venv/bin/pip download megatron-core==0.16.1 pydantic pyyaml safetensors packaging numpy \
#       pydantic-core annotated-types typing-inspection typing-extensions --no-deps \
#       --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d gpu_carry/wheels
#   python -c "from megatron_rz.recipe import load_recipe; from megatron_rz.learner.tiny_models import \
#       make_random_checkpoint as m; m(load_recipe('recipes/tiny_moe.yaml'), 'gpu_carry/tiny_moe')"
#
#   bash tests/gpu/learner_gpu_bootstrap.sh gpu_carry/wheels gpu_carry/tiny_moe OUT_DIR
#
# Wheels are unzipped into /tmp/rz_site (no pip needed) and put first on PYTHONPATH; numpy only if
# the machine has none.
set -u
WHEELS=$1; CKPT=$2; OUT=$3
SITE=/tmp/rz_site
mkdir -p "$SITE" "$OUT"
PY=$(command -v python || command -v python3)
"$PY" - "$WHEELS" "$SITE" <<'PY'
import glob, importlib.util, os, sys, zipfile
wheels, site = sys.argv[1:]
for w in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    name = os.path.basename(w)
    if name.startswith("numpy-") and importlib.util.find_spec("numpy") is not None:
        print("keep system numpy"); continue
    zipfile.ZipFile(w).extractall(site)
    print("unpacked", name)
PY
export PYTHONPATH="$SITE:$PWD"
{
  nvidia-smi -L
  "$PY" -c "import sys, torch, triton, megatron.core, pydantic, yaml, safetensors, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', megatron.core.__version__, 'pydantic', pydantic.VERSION, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
} 2>&1 | tee "$OUT/env.txt"
export RZ_GPU_CKPT="$CKPT" RZ_GPU_RESULTS="$OUT"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout "${RZ_GPU_TIMEOUT:-330}" "$PY" -m pytest -q -s -p no:cacheprovider tests/gpu/test_learner_gpu.py 2>&1 | tee "$OUT/pytest.log"
else
  timeout "${RZ_GPU_TIMEOUT:-330}" "$PY" tests/gpu/test_learner_gpu.py --out "$OUT" 2>&1 | tee "$OUT/driver.log"
fi
