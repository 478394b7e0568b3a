#!/usr/bin/env bash
# Everything that belongs on the GPU machine, in one run: the GPU tests (and, once they exist,
# the benchmarks). Results go to $OUT (or ./gpu-results) so one run answers many questions.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  # The GPU machine gets a copy of the tree without .git: pass KILN_COMMIT from here.
  echo "commit ${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$out/environment.txt" 2>&1
python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest-gpu.txt"
exit "${PIPESTATUS[0]}"
