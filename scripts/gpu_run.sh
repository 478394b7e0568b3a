#!/usr/bin/env bash
# Everything that belongs on the GPU machine, in one run: `pytest -m gpu`, then (with
# KILN_BENCH=1) bench-engine on the Llama-3-8B shape. Results go to $OUT (or ./gpu-results) so one
# run answers many questions; extra arguments go to pytest. KILN_GPU_WORKDIR (default
# engines/gpu-work) keeps checkpoints and engines between runs on a warm machine.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD
export KILN_GPU_WORKDIR=${KILN_GPU_WORKDIR:-$PWD/engines/gpu-work}
export KILN_GPU_RESULTS=${KILN_GPU_RESULTS:-$out/parity.txt}
# The GPU machine gets a copy of the tree without a usable .git: pass KILN_COMMIT from here.
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $KILN_COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$out/environment.txt" 2>&1
python3 -m pytest -m gpu -q -rP -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest-gpu.txt"
status=${PIPESTATUS[0]}
if [ "${KILN_BENCH:-0}" = 1 ]; then
  python3 -c 'from kiln.bench.cli import bench_engine; bench_engine()' --work-dir "$KILN_GPU_WORKDIR/bench" \
    --json "$out/bench.json" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$' | tee "$out/bench.txt"
  status=$((status || PIPESTATUS[0]))
fi
exit "$status"
