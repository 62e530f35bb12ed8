#!/usr/bin/env bash
# The GPU check of the granular offload, as one script of a few minutes, on a machine that has torch (with CUDA)
# but maybe no DeepSpeed and no package registry: installs the bundle from benchmarks/gpu/bundle.sh (only what is
# missing), then runs benchmarks/offload.py and writes everything under $OUT (default benchmarks/results/gpu), all
# within 480 s (CHECK_SECONDS):
#   1. exactness and byte accounting of a small model on the device (CUDA streams, pinned host buffers): the
#      granular losses must equal the no-offload losses and the bytes the plan's prediction; at host_optimizer, at
#      host_params, and at host_params with activation checkpointing, gradient accumulation 2 and a skipped step,
#      in fp32 and bf16;
#   2. the planner's pinned-memory rounding and side-stream pool, measured (benchmarks/gpu/byte_model.py); then
#      step time and peak device memory (the granular one against the plan) of no offload, ZeRO-2 + full
#      offload_optimizer, ZeRO-3 + ratio and the granular plan for a 1.2B-parameter GPT in bf16 under a 12 GB
#      budget (all resident it needs 18 GiB), each arm's step time over granular's printed side by side;
#   3. the delink on the device (tests/scripts/delink_matrix.py --check --poison-unfilled): ZeRO 0-3, fp32 and
#      bf16, the real model built and the pseudo state gathered where the engine trains, every element of the
#      moments written (the memory left unfilled is NaN), the device's peak bytes during the delink and after it; on CUDA, the delink of a 1.0B GPT against one copy of its parameters (benchmarks/overhead.py), and
#      DeepSpeed's ZeRO-3 NVMe optimizer offload against its cpu offload (benchmarks/nvme_offload.py) where libaio is.
#   4. (only when CHECK_PARTS names it) convergence: the memory-bound regime of benchmarks/convergence.py trained on
#      the device with real offload, 8 seeds (SEEDS), scratch, a pseudo phase as long as scratch's run (at half the
#      LR, the real model at twice it) and a 2-layer model grown to 8 layers on a 300 % schedule, with scratch on
#      those schedules, where a pseudo or shallow step (all on the device) is far cheaper than an offloaded real
#      one: the GPU wall clock to scratch's final loss per seed
#      (gpu_wall_to_target_ratio_to_scratch, and against the same-schedule scratch), within what is left of
#      CHECK_SECONDS.
#   5. (only when CHECK_PARTS names it) layouts: the pseudo model's tokens/s on its own layout (data parallel over
#      every GPU) against it on the real layouts (TP = PP = the GPU count), side by side in one run on the same GPUs
#      (benchmarks/layouts.py: Megatron-LM's pretrain_gpt.py through the drop-in, NCCL, bf16); needs 2 or more
#      GPUs, megatron-core 0.16.1 (the bundle's wheel when missing) and a Megatron-LM checkout of tag core_v0.16.1 in
#      MEGATRON_LM_PATH (default ../shared/third_party/megatron-lm).
# CHECK_PARTS (default "offload,delink") picks parts 1-2 (offload), 3 (delink), 4 (convergence) and 5 (layouts);
# e.g. CHECK_PARTS=delink,convergence CHECK_SECONDS=540. Without CUDA it runs steps 1 and 3 on the CPU only.
# Usage: bash benchmarks/gpu/check.sh [BUNDLE_DIR, default .whl]
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
# every step runs under `timeout`, clipped to what is left of the script's 480 s, so that the whole check fits one
# 10-minute device call; a step left without time is reported and counts as a failure
DEADLINE=$((SECONDS + ${CHECK_SECONDS:-480}))
status=0
PARTS=",${CHECK_PARTS:-offload,delink},"
want() { [[ "$PARTS" == *",$1,"* ]]; }  # want PART: whether CHECK_PARTS names it
step() {  # step LIMIT_S NAME COMMAND...: run COMMAND for at most LIMIT_S seconds (less if the deadline is closer)
  local limit=$1 name=$2 left=$((DEADLINE - SECONDS))
  shift 2
  if [ "$left" -lt 20 ]; then echo "== $name: skipped, ${left}s left of the check's time"; status=1; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most ${limit}s)"
  timeout "$limit" "$@" || { echo "== $name: exit $?"; status=1; }
}
# DeepSpeed's CPU Adam is compiled on first use: once here, so that no benchmark's time limit can kill the build
# halfway (a killed build leaves a lock in TORCH_EXTENSIONS_DIR that the next process waits on)
step 180 build_cpu_adam "$PY" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
if want offload; then
  # budgets that offload part of the 6.5M-parameter model (129 MB of fp32 params, gradients and Adam state under
  # ZeRO 2); on CUDA the plan adds its 26 MB reduce bucket and a 22 MiB allocator pool per side stream
  if [ "$cuda" = 1 ]; then budgets=(140MB 100MB); else budgets=(100MB 60MB); fi
  small=(--layers 8 --d-model 256)
  step 120 exactness "$PY" benchmarks/offload.py "${small[@]}" --device-memory "${budgets[0]}" --arms none,granular \
    --out "$OUT/offload_exactness.json"
  # host_params under ZeRO 2: parameters fetched on a side stream, gradients streamed off in backward hooks
  host_params=("${small[@]}" --device-memory "${budgets[1]}" --max-level host_params --gradient-clipping 0
    --arms none,granular)
  step 120 host_params "$PY" benchmarks/offload.py "${host_params[@]}" --out "$OUT/offload_host_params.json"
  # the paths a real run takes, at host_params: each layer recomputed in backward (the recompute fetches the layer
  # again), 2 micro-batches per step, and an inf gradient at step 3 that DeepSpeed and the offload groups must skip;
  # in fp32 (non-reentrant checkpointing) and, after the timing, bf16 (reentrant)
  real_run=(--gradient-accumulation 2 --skip-step 3 --steps 4)
  step 120 host_params_ckpt_ga2_skip "$PY" benchmarks/offload.py "${host_params[@]}" "${real_run[@]}" \
    --checkpoint-activations non-reentrant --out "$OUT/offload_host_params_ckpt_ga2_skip.json"
fi
if want delink; then
  # the delink building the real model on the device it trains on (the host never holding it): every ZeRO stage and
  # dtype on one rank, the loss across it, the fp32 masters and moments carried, the parameters' device
  step 150 delink_on_device "$PY" -m torch.distributed.run --nproc_per_node 1 tests/scripts/delink_matrix.py --check --poison-unfilled
  if [ "$cuda" = 1 ]; then
    # issue 14's time: the delink of a 1.0B-parameter GPT (fp32, ZeRO 0, moments scaled) on the device, against one
    # copy of its parameters there -> $OUT/overhead_delink.json (delink_over_copy, with its phases)
    step 240 delink_time "$PY" benchmarks/overhead.py --delink-only --delinks 2 --threads 8 --out "$OUT"
    # DeepSpeed's ZeRO-3 NVMe optimizer offload on CUDA: losses and a resume against the cpu offload (wrong on the CPU
    # accelerator, benchmarks/README.md); only where DeepSpeed's async_io op can build (libaio)
    if "$PY" -c "from deepspeed.ops.op_builder import AsyncIOBuilder; import sys; sys.exit(not AsyncIOBuilder().is_compatible(verbose=False))"; then
      step 120 nvme_offload "$PY" benchmarks/nvme_offload.py --out "$OUT/nvme_offload.json"
    else
      echo "== nvme_offload: skipped, DeepSpeed's async_io op cannot build here (no libaio)"
    fi
  fi
fi
if want offload; then
  if [ "$cuda" = 1 ]; then
    # the planner's pinned-memory rounding and side-stream pool, measured (seconds)
    step 60 byte_model "$PY" benchmarks/gpu/byte_model.py --out "$OUT/byte_model.json"
    # step time and peak device memory (vs the plan) of every arm at the same 12 GB budget; ratios printed
    step 300 timing "$PY" benchmarks/offload.py --layers 24 --d-model 2048 --seq-len 256 --micro-batch 2 --bf16 \
      --device-memory 12GB --max-level host_params --arms all --out "$OUT/offload_gpu.json"
  else
    echo "no CUDA device: step time and peak device memory skipped"
  fi
  step 120 host_params_ckpt_ga2_skip_bf16 "$PY" benchmarks/offload.py "${host_params[@]}" "${real_run[@]}" --bf16 \
    --checkpoint-activations reentrant --out "$OUT/offload_host_params_ckpt_ga2_skip_bf16.json"
fi
if want convergence; then
  # every run is written as it ends: a run cut short by the deadline keeps its finished seeds (--reanalyse reads them)
  step 600 convergence "$PY" benchmarks/convergence.py --regime memory_bound --seeds "${SEEDS:-8}" --threads 8 \
    --arms "scratch,scratch budget 200% lr x2,scratch budget 300%,p2r@50% scale budget 200% lr x2 pseudo x0.25 rewarmup 10,stack 2->8 @67% budget 300%" \
    --tag _gpu --out "$OUT"
fi
if want layouts; then
  export MEGATRON_LM_PATH="${MEGATRON_LM_PATH:-$PWD/../shared/third_party/megatron-lm}"
  gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if ! "$PY" -c "import megatron.core, six, regex, einops, yaml" 2>/dev/null; then
    wheels=$(ls "$BUNDLE"/megatron_core-0.16.1-*.whl "$BUNDLE"/six-*.whl "$BUNDLE"/regex-*.whl "$BUNDLE"/einops-*.whl \
      "$BUNDLE"/pyyaml-*.whl 2>/dev/null)
    [ -n "$wheels" ] && "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
      --target /tmp/ds_pseudo_real_megatron $wheels && export PYTHONPATH="$PYTHONPATH:/tmp/ds_pseudo_real_megatron"
  fi
  if [ "$cuda" != 1 ] || [ "$gpus" -lt 2 ]; then
    echo "== layouts: skipped, it needs 2 or more GPUs (found $gpus, CUDA $cuda)"
  elif ! "$PY" -c "import megatron.core, six, regex, einops, yaml" 2>/dev/null \
      || [ ! -f "$MEGATRON_LM_PATH/pretrain_gpt.py" ]; then
    echo "== layouts: skipped, it needs megatron-core 0.16.1 and pretrain_gpt.py in MEGATRON_LM_PATH=$MEGATRON_LM_PATH"
  else
    # a 16-layer, hidden-2048 pseudo model (one shared set), sequence 2048, 8 micro-batches of 1 per data-parallel rank
    step 300 layouts "$PY" benchmarks/layouts.py --nproc "$gpus" --layers 16 --hidden 2048 --heads 16 --seq-len 2048 \
      --vocab 32768 --micro-batch 1 --global-batch $((gpus * 8)) --iters 20 --warmup 5 --bf16 \
      --real-layout "tp=$gpus" --real-layout "pp=$gpus" --out "$OUT"
  fi
fi
echo "gpu check finished with status $status"
exit $status
