#!/usr/bin/env bash
# Tensor parallelism on two GPUs, in one run of at most 10 minutes (issue 13), for an
# `nvidia-h200-x2` machine: a random Llama-3-8B-shape bf16 checkpoint, its TP 1 and TP 2
# engines, the TP GPU tests (the custom all-reduce against NCCL, eagerly and in replayed CUDA
# graphs; TP 2 greedy and seeded tokens against TP 1's), then bench-engine decode at batch 1 and
# 64 for TP 1, TP 2 (overlapped loop, custom all-reduce), TP 2 with the plain loop and TP 2 with
# NCCL alone (KILN_ALL_REDUCE=nccl).
#
#   KILN_COMMIT=<short hash> OUT=/somewhere bash scripts/gpu_tp.sh [build|bench]
#
# With no argument it does both; `build` (checkpoint, engines, GPU tests) and `bench` split it
# over two device calls of 10 minutes on one warm machine (set KILN_GPU_WORKDIR under /tmp).
#
# Each step writes its output to its own file under $OUT (default gpu-results) and has its own
# time limit; a step that fails or runs out of time does not stop the later ones, and
# $OUT/steps.txt lists every step's exit status and seconds. The engines are built with
# smaller bounds than BENCHMARKS.md's 8B runs (batch 64, 1024 tokens a sequence, 2048 a step) to
# fit the time: decode at batch 1 and 64 needs no more, and TP 1 and TP 2 share them.
set -uo pipefail
set -x
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD
# The GPU machine gets a copy of the tree without a usable .git: pass KILN_COMMIT from here.
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
work=${KILN_GPU_WORKDIR:-$PWD/engines/gpu-tp}
export KILN_CACHE=$work/kernel-cache
mkdir -p "$work"
ckpt=$work/llama3-8b-bf16
BUILD_FLAGS="--dtype bfloat16 --target sm_90 --max-batch-size 64 --max-seq-len 1024 --max-num-tokens 2048 --quiet"
BENCH="python3 -c 'from kiln.bench.cli import bench_engine; bench_engine()' --only decode --batch-sizes 1,64 --no-baseline"

# step NAME SECONDS COMMAND: run COMMAND (a shell string) with a time limit, output to $out/NAME.txt.
step() {
  local name=$1 limit=$2 command=$3 start=$SECONDS
  timeout --kill-after=10 "$limit" bash -c "$command" > "$out/$name.txt" 2>&1
  local status=$?
  echo "$name exit $status after $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/steps.txt"
  return 0
}

phase=${1:-all}
if [ "$phase" != bench ]; then
step environment 60 "date -u +'date %Y-%m-%dT%H:%M:%SZ'; echo commit $KILN_COMMIT; nvidia-smi; nvidia-smi topo -m;
  python3 -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"gpus\", torch.cuda.device_count())'"
step checkpoint 150 "p=\$(python3 -c 'import sys; from pathlib import Path; from kiln.bench.model import SHAPES, ensure_checkpoint
print(ensure_checkpoint(Path(sys.argv[1]), SHAPES[\"llama3-8b\"], \"bfloat16\", \"cuda\")[0])' $work | tail -1) && ln -sfn \$p $ckpt && ls -la \$p"

# The two builds run side by side on the CPUs and disk; the GPU tests need only the GPUs (and
# build their own small engines), so they run meanwhile, one after the other.
step build-and-test 330 "
  build() { python3 -c 'from kiln.builder.cli import build_engine; build_engine()' --checkpoint $ckpt --output \$1 $BUILD_FLAGS \${@:2}; }
  ( [ -f $work/tp1/rank0.engine ] || build $work/tp1 ) > $out/build-tp1.txt 2>&1 & tp1=\$!
  ( [ -f $work/tp2/rank1.engine ] || build $work/tp2 --tp-size 2 ) > $out/build-tp2.txt 2>&1 & tp2=\$!
  timeout --kill-after=10 120 python3 -m pytest -m gpu -q -rP -p no:cacheprovider tests/test_all_reduce_gpu.py \
    > $out/pytest-all-reduce.txt 2>&1
  echo pytest all-reduce exit \$?
  timeout --kill-after=10 180 python3 -m pytest -m gpu -q -rP -p no:cacheprovider tests/test_tp_gpu.py > $out/pytest-tp.txt 2>&1
  echo pytest tp exit \$?
  wait \$tp1; echo build tp1 exit \$?
  wait \$tp2; echo build tp2 exit \$?
  ls -la $work/tp1 $work/tp2"

fi
if [ "$phase" != build ]; then
step bench-tp1 100 "$BENCH --engine $work/tp1 --json $out/bench-tp1.json"
step bench-tp2 110 "$BENCH --engine $work/tp2 --json $out/bench-tp2.json"
step bench-tp2-plain 110 "$BENCH --no-overlap --engine $work/tp2 --json $out/bench-tp2-plain.json"
step bench-tp2-nccl 110 "KILN_ALL_REDUCE=nccl $BENCH --engine $work/tp2 --json $out/bench-tp2-nccl.json"
fi

cat "$out/steps.txt"
