#!/usr/bin/env bash
# The open issues' gate figures on one GPU (BENCHMARKS.md's status table), in stages that fit the device's
# 10-minute calls: what a stage writes to the work folder stays there while the machine is warm, so a later call
# takes it on. Results go to $OUT (or ./gpu-results), a JSON and a text file per run.
#
#   bash scripts/gpu_gates.sh build          # the random 8B checkpoint, and the two engines of the offline runs
#   bash scripts/gpu_gates.sh decode         # issues 11, 12 and 14: decode b=1/8/64/256, bf16 beside the
#                                            # calibrated FP8 engine; startup and latency on the bf16 engine
#   bash scripts/gpu_gates.sh offline-bf16   # issue 14's 2048/2048 (1,000 requests): bf16 ...
#   bash scripts/gpu_gates.sh offline-fp8kv  # ... and FP8 weights with the e4m3 cache, whose ratio is the gate
#
# Several stages may go in one call (`build decode`). On an H200 `build` takes about 3 minutes, `decode` 4,
# `offline-bf16` 6 and `offline-fp8kv` 4; an H100's KV pool is too small to finish 2048/2048 inside a call.
# GATES_SHAPE (a `bench.model.SHAPES` name, default llama3-8b) and GATES_FLAGS (build flags in place of the
# gates') exist for a smoke run on a CPU: GATES_SHAPE=tiny GATES_FLAGS="--max-seq-len 64 --max-num-tokens 64"
# GATES_BENCH="--decode-context 16 --decode-steps 4 --offline 8/8 --offline-requests 4 ..." (see --help).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
work=${KILN_GATES_WORKDIR:-$PWD/engines/gates}
shape=${GATES_SHAPE:-llama3-8b}
mkdir -p "$out" "$work"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The GPU machine gets a copy of the tree without a usable .git: pass KILN_COMMIT from here.
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
read -r -a build_flags <<< "${GATES_FLAGS:---max-seq-len 4352 --max-num-tokens 8192}"
read -r -a bench_flags <<< "${GATES_BENCH:-}"
device=$(python3 -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
target=$([ "$device" = cuda ] && echo sm_90 || echo cpu)
fp8kv=(--quantization fp8 --kv-cache-dtype fp8)   # the offline gate's FP8 engine: e4m3 weights and cache

build() { python3 -c 'from kiln.builder.cli import build_engine; build_engine()' "$@"; }
bench() {   # bench-engine, its progress bars left out of the log
  local name=$1; shift
  python3 -c 'from kiln.bench.cli import bench_engine; bench_engine()' "$@" "${bench_flags[@]}" \
    --json "$out/$name.json" 2>&1 | tr '\r' '\n' | grep -v -E '(it|req)/s\]$' | tee "$out/$name.txt"
}
checkpoint() {   # bench-engine's own random checkpoint of the shape, so `decode` reuses it
  python3 -c "
import sys
from pathlib import Path
from kiln.bench.model import SHAPES, ensure_checkpoint
print(ensure_checkpoint(Path(sys.argv[1]), SHAPES[sys.argv[2]], 'bfloat16', sys.argv[3])[0])" "$work" "$shape" "$device"
}
offline_engine() {   # the engine of an offline stage, built once: issue 14's 2048/2048 runs 512 sequences at once
  local engine=$work/offline-$1; shift
  [ -f "$engine/rank0.engine" ] || build --checkpoint "$(checkpoint | tail -1)" --output "$engine" --dtype bfloat16 \
    --target "$target" --max-batch-size 512 "${build_flags[@]}" --quiet "$@" >&2 || return 1
  echo "$engine"
}
calibration_prompts() {   # static activation scales for the FP8 engine of the decode gates, as in session 49
  cat > "$work/calibration.txt" <<'EOF'
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
In 1905 Albert Einstein published four papers: on light quanta, Brownian motion, special relativity and mass-energy.
def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a
Translate into French: the weather is lovely today, and we should go for a walk by the river.
Summarize: the committee met on Tuesday to discuss next year's budget, agreeing to spend more on schools and roads.
Q: What is the capital of Australia? A: Canberra. Q: What is the largest planet? A:
The mitochondria is the powerhouse of the cell, producing ATP through oxidative phosphorylation.
SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY name;
Once upon a time, in a kingdom by the sea, there lived a princess who could speak to birds.
Prices rose 3.2% in October, the central bank said, as energy costs climbed for the third month.
EOF
  echo "$work/calibration.txt"
}

{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $KILN_COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no GPU"
} >> "$out/environment.txt"
status=0
for stage in "$@"; do
  echo "== $stage $(date -u +%H:%M:%S)" | tee -a "$out/stages.txt"
  case $stage in
    build)
      offline_engine bf16 && offline_engine fp8kv "${fp8kv[@]}" ;;
    decode)
      bench decode --work-dir "$work" --shape "$shape" --quantization fp8 --calibration-prompts "$(calibration_prompts)" \
        --only decode --batch-sizes 1,8,64,256 --no-baseline --max-batch-size 256 "${build_flags[@]}" &&
      bench latency --work-dir "$work" --shape "$shape" --only startup,decode,latency --batch-sizes 1,8,64 \
        --no-baseline --max-batch-size 256 "${build_flags[@]}" ;;
    offline-bf16|offline-fp8kv)
      flags=(); [ "$stage" = offline-fp8kv ] && flags=("${fp8kv[@]}")
      engine=$(offline_engine "${stage#offline-}" "${flags[@]}") &&
      bench "$stage" --engine "$engine" --only offline --offline 2048/2048 --no-baseline ;;
    *)
      echo "unknown stage $stage: build, decode, offline-bf16 or offline-fp8kv" >&2; false ;;
  esac
  status=$((status || $?))
done
echo "== end $(date -u +%H:%M:%S)" | tee -a "$out/stages.txt"
exit "$status"
