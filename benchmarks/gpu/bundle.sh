#!/usr/bin/env bash
# Fetch, on a machine with the package registry, what benchmarks/gpu/check.sh installs on a GPU machine without one:
# DeepSpeed's source archive (it is published only as one) and the wheels it needs that such a machine may lack.
# Usage: bash benchmarks/gpu/bundle.sh [PYTHON_VERSION of the GPU machine, default 3.12] [DIR, default .whl]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON_VERSION="${1:-3.12}"
DIR="${2:-.whl}"
mkdir -p "$DIR"
# Versions this project is tested with; pydantic-core is the only compiled one, hence the platform flags.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0
python3 -m pip download -q --no-deps --no-binary=:all: -d "$DIR" deepspeed==0.19.8
# check.sh's optional layouts part: megatron-core and what Megatron-LM's training code imports besides it.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
  megatron-core==0.16.1 six==1.17.0 regex==2026.12.2 einops==0.8.2 pyyaml==6.0.4
ls -l "$DIR"
