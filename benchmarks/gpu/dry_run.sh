#!/usr/bin/env bash
# benchmarks/gpu/check.sh on the CPU, in a virtual environment made of torch and the bundle alone: the bundle for this
# machine's Python (bundle.sh, where pip reaches the package index; the GPU machine's is bundle.sh 3.12), a new venv
# with torch==2.13.0 (the CPU wheel), then check.sh, whose installs read nothing but the bundle (no index, no pip
# configuration, no other environment), on smaller models (CHECK_SIZE=dry). Every install, import and build step of
# the GPU check runs, CPU Adam built from scratch: what the bundle lacks or the build needs fails here first. CI runs
# it (.ci/run); about 5 minutes on 2 cores, most of it the CPU Adam build.
# Usage: [CHECK_CAP_FACTOR=5] bash benchmarks/gpu/dry_run.sh [WORK_DIR, default a new temporary directory]
# (CHECK_CAP_FACTOR: every step's cap times this; .ci/run, which runs it beside the tests, gives it more)
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK="${1:-$(mktemp -d)}"
version=$(python3 -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
bash benchmarks/gpu/bundle.sh "$version" "$WORK/bundle" >/dev/null
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q torch==2.13.0
env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u VIRTUAL_ENV -u PYTHONPATH \
  PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PATH="$WORK/venv/bin:/usr/local/bin:/usr/bin:/bin" \
  PYTHON="$WORK/venv/bin/python" OUT="$WORK/out" CHECK_SITE="$WORK/site" TORCH_EXTENSIONS_DIR="$WORK/extensions" \
  CHECK_SIZE=dry CHECK_CAP_FACTOR="${CHECK_CAP_FACTOR:-5}" OMP_NUM_THREADS=1 bash benchmarks/gpu/check.sh "$WORK/bundle"
