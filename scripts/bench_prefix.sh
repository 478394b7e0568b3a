#!/usr/bin/env bash
# Prefix caching on the GPU: bench-engine's prefix phase alone, on the Llama-3-8B-shape engine
# that bench-engine builds (random bf16 checkpoint, --max-batch-size 256 --max-seq-len 4352
# --max-num-tokens 8192): 64 conversations sharing a 1,024-token system prompt, 3 turns each,
# with prefix caching on and off in the same run, then the no-hit cost. Results go to $OUT (or
# ./gpu-results): bench-prefix.json and bench-prefix.txt. KILN_GPU_WORKDIR (default
# engines/gpu-work) keeps the checkpoint and engine between runs, as scripts/gpu_run.sh does.
# Extra arguments go to bench-engine, e.g. --engine DIR to measure an engine built already.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD
export KILN_GPU_WORKDIR=${KILN_GPU_WORKDIR:-$PWD/engines/gpu-work}
# The GPU machine gets a copy of the tree without a usable .git: pass KILN_COMMIT from here.
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
python3 -c 'from kiln.bench.cli import bench_engine; bench_engine()' --work-dir "$KILN_GPU_WORKDIR/bench" \
  --only prefix --no-baseline --json "$out/bench-prefix.json" "$@" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$' \
  | tee "$out/bench-prefix.txt"
exit "${PIPESTATUS[0]}"
