#!/usr/bin/env bash
# The GPU check of the granular offload and the delink, as one script that fits one 10-minute device call, on a
# machine that has torch (with CUDA) but maybe no DeepSpeed and no package registry: installs from the bundle of
# benchmarks/gpu/bundle.sh what the machine lacks (benchmarks/gpu/install_bundle.py), says what DeepSpeed's CPU Adam
# build needs that is missing, builds it, then runs the steps of the parts CHECK_PARTS names and writes everything
# under $OUT (default benchmarks/results/gpu):
#   offload (parts 1-2):
#     exactness and byte accounting of a small model on the device (CUDA streams, pinned host buffers): the granular
#     losses must equal the no-offload losses and the bytes the plan's prediction; at host_optimizer, at host_params
#     under ZeRO 2, and at host_params with activation checkpointing, gradient accumulation 2 and a skipped step, in
#     fp32 and bf16, and on CUDA in fp16 (dynamic loss scaling); on CUDA the planner's pinned host pages, torch's pinned cache emptied and the side-stream pool,
#     measured (benchmarks/gpu/byte_model.py); then step time and peak device memory (the granular one against the
#     plan) of no offload, ZeRO-2 + full offload_optimizer, ZeRO-3 + ratio and the granular plan for a 1.2B-parameter
#     GPT in bf16 under a 12 GB budget (all resident it needs 18 GiB), each arm's step time over granular's;
#   delink (part 3): tests/scripts/delink_matrix.py --check --poison-unfilled: ZeRO 0-3, fp32 and bf16, and ZeRO 1-3
#     in fp16 where the accelerator has it (the loss scaler carried, its scale DeepSpeed's own step by step), the real
#     model built where the engine trains and the pseudo state gathered on the host, every element of the moments
#     written (the memory left unfilled is NaN), the device's peak bytes during the delink and after it; on CUDA the
#     delink of a 1.0B GPT against one copy of its parameters (benchmarks/overhead.py), and DeepSpeed's ZeRO-3 NVMe
#     optimizer offload against its cpu offload (benchmarks/nvme_offload.py) where libaio is;
#   convergence (part 4, only when named): the memory-bound regime of benchmarks/convergence.py trained on the device
#     with real offload, SEEDS seeds (default 8): the headline arms, scratch on 5x its steps (the strong baseline, at
#     the regime's LR and twice it), the shared model until 60 % of them and a 2-layer model grown to 8 at 60 %; the
#     GPU wall clock to the baseline's final loss per seed.
#   host_step (part 6, only when named): the plan calibrated on this machine (`plan --calibrate`: host Adam's rate
#     with the cores one of 8 ranks gets, pinned host-device bandwidth) for the M6-10T config, and
#     benchmarks/host_step.py: the host step during the backward and one step late against after it, DeepSpeed's
#     ZeRO-2 CPU offload and SuperOffload, on one model, losses compared (its GIL-free CPU Adam op built first, under
#     a cap of its own).
#   layouts (part 5, only when named): the pseudo model's tokens/s on its own layout (data parallel over every GPU)
#     against it on the real layouts (TP = PP = the GPU count), side by side in one run on the same GPUs
#     (benchmarks/layouts.py: Megatron-LM's pretrain_gpt.py through the drop-in, NCCL, bf16); needs 2 or more GPUs,
#     megatron-core 0.16.1 (the bundle's wheel when missing) and a Megatron-LM checkout of tag core_v0.16.1 in
#     MEGATRON_LM_PATH (default ../shared/third_party/megatron-lm).
#
# The budget. Every step runs under `timeout` with a cap (seconds, below; estimates for a 16-core H100 machine, not
# measured there yet: the log gives each step's seconds), clipped to what is left of CHECK_SECONDS (default 540: a
# 10-minute call less a minute for the machine's own probes). The caps of the steps that run add up to at most 540 s
# with the default parts (offload,delink) on CUDA:
#   install 60 + build_cpu_adam 75 + exactness 30 + host_params 30 + host_params_ckpt_ga2_skip 30
#   + host_params_ckpt_ga2_skip_bf16 30 + host_params_ckpt_ga2_skip_fp16 30 + byte_model 15 + delink_on_device 75
#   + timing 90 + delink_time 45 + nvme_offload 30 = 540
# with CHECK_PARTS=convergence: install 60 + build_cpu_adam 75 + convergence 405 = 540; with CHECK_PARTS=layouts:
# install 60 + build_cpu_adam 75 + layouts 300 = 435; with CHECK_PARTS=host_step: install 60 + build_cpu_adam 75
# + build_host_step_op 75 + calibrate 90 + host_step 150 = 450. The correctness steps run first, the timings last: a step over
# its cap is killed and reported, and the steps after it keep their time. The script prints the sum for the parts
# asked before it starts. Without CUDA only the offload exactness steps (not the fp16 one: DeepSpeed's CPU accelerator
# refuses fp16) and the delink matrix (its fp16 cases skipped, saying so) run.
# CHECK_SIZE=dry (benchmarks/gpu/dry_run.sh, CI): the same steps on smaller models, on the CPU; CHECK_CAP_FACTOR
# multiplies every cap and the default budget (the dry run on 2 CPU cores, where CPU Adam alone builds in minutes).
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

# what the bundle installs goes to SITE, ahead of the machine's own packages; the ninja it may bring, on PATH
SITE="${CHECK_SITE:-/tmp/ds_pseudo_real_site}"
mkdir -p "$SITE"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
cuda=$("$PY" -W ignore -c "import torch; print(int(torch.cuda.is_available()))") || { echo "cannot import torch with $PY"; exit 1; }
dry=0
[ "${CHECK_SIZE:-full}" = dry ] && dry=1

declare -A CAP=([install]=60 [build_cpu_adam]=75 [exactness]=30 [host_params]=30 [host_params_ckpt_ga2_skip]=30
                [host_params_ckpt_ga2_skip_bf16]=30 [host_params_ckpt_ga2_skip_fp16]=30 [byte_model]=15
                [delink_on_device]=75 [timing]=90 [delink_time]=45 [nvme_offload]=30 [convergence]=405
                [layouts]=300 [build_host_step_op]=75 [calibrate]=90 [host_step]=150)
FACTOR=${CHECK_CAP_FACTOR:-1}  # a slower machine: every cap and the default budget times this
for name in "${!CAP[@]}"; do CAP[$name]=$((CAP[$name] * FACTOR)); done
PARTS=",${CHECK_PARTS:-offload,delink},"
want() { [[ "$PARTS" == *",$1,"* ]]; }  # want PART: whether CHECK_PARTS names it
steps=(install build_cpu_adam)
if want offload; then
  steps+=(exactness host_params host_params_ckpt_ga2_skip host_params_ckpt_ga2_skip_bf16)
  [ "$cuda" = 1 ] && steps+=(host_params_ckpt_ga2_skip_fp16 byte_model)
fi
want delink && steps+=(delink_on_device)
[ "$cuda" = 1 ] && want offload && steps+=(timing)
[ "$cuda" = 1 ] && want delink && steps+=(delink_time nvme_offload)  # nvme_offload counted even where it skips
want convergence && steps+=(convergence)
want layouts && steps+=(layouts)  # counted even where it skips (fewer than 2 GPUs)
want host_step && steps+=(build_host_step_op calibrate host_step)
total=0 sum=""
for name in "${steps[@]}"; do total=$((total + CAP[$name])); sum+="${sum:+ + }$name ${CAP[$name]}"; done
BUDGET=${CHECK_SECONDS:-$((540 * FACTOR))}
echo "budget: $sum = $total s of CHECK_SECONDS $BUDGET$([ "$total" -gt "$BUDGET" ] && echo ": over it, the last steps get what is left")"

DEADLINE=$((SECONDS + BUDGET))
status=0
step() {  # step NAME COMMAND...: run COMMAND for at most CAP[NAME] seconds (less if the deadline is closer)
  local name=$1 limit=${CAP[$1]} left=$((DEADLINE - SECONDS)) start=$SECONDS
  shift
  if [ "$left" -lt 10 ]; then echo "== $name: skipped, ${left}s left of the check's time"; status=1; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most ${limit}s)"
  timeout "$limit" "$@"
  local rc=$?
  if [ "$rc" = 0 ]; then echo "== $name: done in $((SECONDS - start))s"
  else echo "== $name: exit $rc after $((SECONDS - start))s$([ "$rc" = 124 ] && echo ", its cap")"; status=1; fi
  return $rc
}

step install "$PY" benchmarks/gpu/install_bundle.py "$BUNDLE" "$SITE" || { echo "gpu check finished with status 1"; exit 1; }
# DeepSpeed's CPU Adam is compiled on first use: here, under a cap of its own, so that no benchmark's cap can kill the
# build halfway (a killed build leaves a lock in TORCH_EXTENSIONS_DIR that the next process waits on). What
# torch.utils.cpp_extension needs for it: a C++ compiler ($CXX, else c++) with OpenMP, Python's headers, ninja.
cxx="${CXX:-c++}"
missing=()
command -v "$cxx" >/dev/null || missing+=("the C++ compiler $cxx (e.g. apt-get install g++)")
if command -v "$cxx" >/dev/null && ! printf '#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n' |
    "$cxx" -fopenmp -x c++ - -o "$OUT/openmp_probe" >/dev/null 2>&1; then
  missing+=("OpenMP for $cxx (-fopenmp, omp.h and libgomp: g++ has them)")
fi
include=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
[ -f "$include/Python.h" ] || missing+=("Python's headers: no Python.h in $include (e.g. apt-get install python$("$PY" -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")-dev)")
command -v ninja >/dev/null || missing+=("ninja on PATH")
rm -f "$OUT/openmp_probe"
if [ ${#missing[@]} -gt 0 ]; then
  echo "CPU Adam cannot build here; missing: $(IFS=';'; echo "${missing[*]}")"
else
  echo "CPU Adam build: $("$cxx" --version | head -1), OpenMP, $include/Python.h, ninja $(ninja --version)"
fi
if ! step build_cpu_adam "$PY" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"; then
  echo "the steps after it need CPU Adam (and would wait on the lock a killed build leaves): stopped"
  echo "gpu check finished with status 1"
  exit 1
fi
# DeepSpeed's async_io op (the nvme_offload step, last) is compiled on first use too: a dozen C++ files, more than that
# step's cap. Built here in the background while the correctness steps run (4 compiler jobs at the lowest priority,
# so that their caps hold); the step waits on torch's build lock if it is not done by then (inside the step's cap),
# the timing step says so if it still runs, and a build still running when the check ends is stopped.
aio_build=""
if [ "$cuda" = 1 ] && want delink && "$PY" -c "from deepspeed.ops.op_builder import AsyncIOBuilder; import sys; sys.exit(not AsyncIOBuilder().is_compatible(verbose=False))" 2>/dev/null; then
  MAX_JOBS=4 nice -n 19 "$PY" -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()" \
    >"$OUT/async_io_build.log" 2>&1 &
  aio_build=$!
  echo "async_io: building in the background (log: $OUT/async_io_build.log)"
fi

if want offload; then
  # budgets that offload part of the small model (the 8-layer one: 129 MB of fp32 params, gradients and Adam state
  # under ZeRO 2; on CUDA the plan adds its 26 MB reduce bucket and a 22 MiB allocator pool per side stream)
  if [ "$dry" = 1 ]; then small=(--layers 4 --d-model 128 --steps 3 --warmup 1); budgets=(16MB 4MB)
  elif [ "$cuda" = 1 ]; then small=(--layers 8 --d-model 256); budgets=(140MB 100MB)
  else small=(--layers 8 --d-model 256); budgets=(100MB 60MB); fi
  step exactness "$PY" benchmarks/offload.py "${small[@]}" --device-memory "${budgets[0]}" --arms none,granular \
    --check --out "$OUT/offload_exactness.json"
  # host_params under ZeRO 2: parameters fetched on a side stream, gradients streamed off in backward hooks
  host_params=("${small[@]}" --device-memory "${budgets[1]}" --max-level host_params --gradient-clipping 0
    --arms none,granular --check)
  step host_params "$PY" benchmarks/offload.py "${host_params[@]}" --out "$OUT/offload_host_params.json"
  # the paths a real run takes, at host_params: each layer recomputed in backward (the recompute fetches the layer
  # again), 2 micro-batches per step, and an inf gradient at step 3 that DeepSpeed and the offload groups must skip;
  # in fp32 (non-reentrant checkpointing), bf16 (reentrant) and, on CUDA, fp16 with dynamic loss scaling (the inf
  # skipped by every arm with the scale halved; DeepSpeed's CPU accelerator refuses fp16)
  real_run=(--gradient-accumulation 2 --skip-step 3 --steps 4)
  [ "$dry" = 1 ] && real_run=(--gradient-accumulation 2 --skip-step 2 --steps 3)
  step host_params_ckpt_ga2_skip "$PY" benchmarks/offload.py "${host_params[@]}" "${real_run[@]}" \
    --checkpoint-activations non-reentrant --out "$OUT/offload_host_params_ckpt_ga2_skip.json"
  step host_params_ckpt_ga2_skip_bf16 "$PY" benchmarks/offload.py "${host_params[@]}" "${real_run[@]}" --bf16 \
    --checkpoint-activations reentrant --out "$OUT/offload_host_params_ckpt_ga2_skip_bf16.json"
  [ "$cuda" = 1 ] && step host_params_ckpt_ga2_skip_fp16 "$PY" benchmarks/offload.py "${host_params[@]}" \
    "${real_run[@]}" --fp16 --checkpoint-activations non-reentrant \
    --out "$OUT/offload_host_params_ckpt_ga2_skip_fp16.json"
  [ "$cuda" = 1 ] && step byte_model "$PY" benchmarks/gpu/byte_model.py --out "$OUT/byte_model.json"
fi
if want delink; then
  # the delink building the real model on the device it trains on: every ZeRO stage and dtype on one rank, the loss
  # across it, the fp32 masters and moments carried (fp16: the loss scaler too), the parameters' device, the gathered
  # state on the host
  matrix=(--check --poison-unfilled)
  [ "$dry" = 1 ] && matrix+=(--stages 1)
  step delink_on_device "$PY" -m torch.distributed.run --nproc_per_node 1 tests/scripts/delink_matrix.py "${matrix[@]}"
fi
if [ -n "$aio_build" ] && kill -0 "$aio_build" 2>/dev/null; then
  echo "async_io: its background build still runs; the timings below share the CPU with it"
fi
if [ "$cuda" = 1 ] && want offload; then
  # step time and peak device memory (vs the plan) of every arm at the same 12 GB budget; ratios printed
  step timing "$PY" benchmarks/offload.py --layers 24 --d-model 2048 --seq-len 256 --micro-batch 2 --bf16 \
    --device-memory 12GB --max-level host_params --arms all --steps 4 --warmup 1 --out "$OUT/offload_gpu.json"
fi
if [ "$cuda" = 1 ] && want delink; then
  # issue 14's time: the delink of a 1.0B-parameter GPT (fp32, ZeRO 0, moments scaled) on the device, against one
  # copy of its parameters there -> $OUT/overhead_delink.json (delink_over_copy, with its phases)
  step delink_time "$PY" benchmarks/overhead.py --delink-only --delinks 2 --threads 8 --out "$OUT"
  # DeepSpeed's ZeRO-3 NVMe optimizer offload on CUDA: losses and a resume against the cpu offload (wrong on the CPU
  # accelerator, benchmarks/README.md); only where DeepSpeed's async_io op can build (libaio)
  if "$PY" -c "from deepspeed.ops.op_builder import AsyncIOBuilder; import sys; sys.exit(not AsyncIOBuilder().is_compatible(verbose=False))"; then
    step nvme_offload "$PY" benchmarks/nvme_offload.py --out "$OUT/nvme_offload.json"
  else
    echo "== nvme_offload: skipped, DeepSpeed's async_io op cannot build here (no libaio)"
  fi
fi
if want convergence; then
  # every run is written as it ends: a run cut short by the deadline keeps its finished seeds (--reanalyse reads them)
  step convergence "$PY" benchmarks/convergence.py --regime memory_bound --seeds "${SEEDS:-8}" --threads 8 \
    --arms "scratch,scratch budget 500%,scratch budget 500% lr x2,p2r@60% scale budget 500% lr x0.7,stack 2->8 @60% budget 500%" \
    --baseline "scratch budget 500%" --tag _gpu --out "$OUT"
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
    step layouts "$PY" benchmarks/layouts.py --nproc "$gpus" --layers 16 --hidden 2048 --heads 16 --seq-len 2048 \
      --vocab 32768 --micro-batch 1 --global-batch $((gpus * 8)) --iters 20 --warmup 5 --bf16 \
      --real-layout "tp=$gpus" --real-layout "pp=$gpus" --out "$OUT"
  fi
fi
if want host_step; then
  # the overlapped host step's CPU Adam op (DeepSpeed's kernel, this package's GIL-free binding): built under its own
  # cap, as CPU Adam above, so that no benchmark's cap kills its build halfway
  step build_host_step_op "$PY" -c "from ds_pseudo_real.offload.kernel import gil_free_builder; gil_free_builder().load()" &&
  step calibrate "$PY" -m ds_pseudo_real.plan_command --config configs/offload_m6_10t.json --world-size 512 \
    --device-memory 32GB --calibrate --ranks-per-node 8 --calibration-out "$OUT/calibration.json" &&
  if [ "$dry" = 1 ]; then hs=(--hidden 64 --layers 2 --vocab 64 --rounds 1 --block 2 --triad-numel 262144)
  elif [ "$cuda" = 1 ]; then hs=(--hidden 2048 --layers 8 --vocab 32768 --tokens 2048 --threads 8)
  else hs=(); fi &&
  step host_step "$PY" benchmarks/host_step.py "${hs[@]}" --out "$OUT/host_step.json"
fi
if [ -n "$aio_build" ] && kill -0 "$aio_build" 2>/dev/null; then
  echo "async_io: its background build had not finished; stopped"
  kill "$aio_build" 2>/dev/null
fi
echo "gpu check finished with status $status"
exit $status
