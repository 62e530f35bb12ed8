#!/usr/bin/env bash
# Fetch, on a machine where pip reaches the package registry, what benchmarks/gpu/check.sh installs on a GPU machine
# without one: the packages of benchmarks/gpu/bundle.txt as wheels for that machine's Python (x86-64 Linux) and
# DeepSpeed's source archive (it is published only as one).
# Usage: bash benchmarks/gpu/bundle.sh [PYTHON_VERSION of the GPU machine, default 3.12] [DIR, default .whl]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON_VERSION="${1:-3.12}"
DIR="${2:-.whl}"
mkdir -p "$DIR"
mapfile -t packages < <(grep -v '^#' benchmarks/gpu/bundle.txt)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DIR" "${packages[@]}"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$DIR" deepspeed==0.19.8
# check.sh's optional layouts part: megatron-core and what Megatron-LM's training code imports besides it.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
  megatron-core==0.16.1 six==1.17.0 regex==2026.12.2 pyyaml==6.0.4
ls -l "$DIR"
