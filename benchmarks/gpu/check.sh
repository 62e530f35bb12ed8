#!/usr/bin/env bash
# The GPU check of the granular offload, as one script of a few minutes, on a machine that has torch (with CUDA)
# but maybe no DeepSpeed and no package registry: installs the bundle from benchmarks/gpu/bundle.sh (only what is
# missing), then runs benchmarks/offload.py twice and writes everything under $OUT (default benchmarks/results/gpu):
#   1. exactness and byte accounting of a small model on the device (CUDA streams, pinned host buffers): the
#      granular losses must equal the no-offload losses and the bytes the plan's prediction;
#   2. the planner's pinned-memory rounding and side-stream pool, measured (benchmarks/gpu/byte_model.py); then
#      step time and peak device memory of no offload, ZeRO-2 + full offload_optimizer, ZeRO-3 + ratio and the
#      granular plan for a 1.2B-parameter GPT in bf16 under a 12 GB budget (all resident it needs 18 GiB).
# Without CUDA it runs step 1 on the CPU only. Usage: bash benchmarks/gpu/check.sh [BUNDLE_DIR, default .whl]
set -uo pipefail
cd "$(dirname "$0")/../.."
BUNDLE="${1:-.whl}"
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}"
PY="${PYTHON:-python3}"
LOG="$OUT/check_log.txt"
exec > >(tee "$LOG") 2>&1

missing=$("$PY" - <<'PY'
import importlib.util
print(" ".join(m for m in ("hjson", "pydantic", "deepspeed") if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "installing from $BUNDLE: $missing"
  SITE=/tmp/ds_pseudo_real_site
  wheels=$(ls "$BUNDLE"/*.whl 2>/dev/null)
  [ -n "$wheels" ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels
  if [[ " $missing " == *" deepspeed "* ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" "$BUNDLE"/deepspeed-*.tar.gz || exit 1
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'deepspeed', deepspeed.__version__)" || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
# budgets that offload part of the 6.5M-parameter model (129 MB of fp32 params, gradients and Adam state under
# ZeRO 2); on CUDA the plan adds its 26 MB reduce bucket and a 22 MiB allocator pool per side stream
if [ "$cuda" = 1 ]; then budgets=(140MB 100MB); else budgets=(100MB 60MB); fi
timeout 240 "$PY" benchmarks/offload.py --layers 8 --d-model 256 --device-memory "${budgets[0]}" --arms none,granular \
  --out "$OUT/offload_exactness.json"
status=$?
# host_params under ZeRO 2: parameters fetched on a side stream, gradients streamed off in backward hooks
timeout 240 "$PY" benchmarks/offload.py --layers 8 --d-model 256 --device-memory "${budgets[1]}" --max-level host_params \
  --gradient-clipping 0 --arms none,granular --out "$OUT/offload_host_params.json" || status=$?
if [ "$cuda" = 1 ]; then
  # the planner's pinned-memory rounding and side-stream pool, measured (seconds)
  timeout 120 "$PY" benchmarks/gpu/byte_model.py --out "$OUT/byte_model.json" || status=$?
  timeout 330 "$PY" benchmarks/offload.py --layers 24 --d-model 2048 --seq-len 256 --micro-batch 2 --bf16 --device-memory 12GB \
    --max-level host_params --arms all --out "$OUT/offload_gpu.json" || status=$?
else
  echo "no CUDA device: step 2 (step time and peak device memory) skipped"
fi
echo "gpu check finished with status $status"
exit $status
