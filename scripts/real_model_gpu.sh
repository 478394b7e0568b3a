#!/usr/bin/env bash
# Issue 17's GPU check on trained weights: carries the real model (SmolLM2-135M-Instruct's GGUF,
# 98 MB, more than one device call carries) to the GPU machine in parts, joins it there and runs
# scripts/real_model_gpu.py and tests/test_real_gpu.py (pytest -m gpu) on it.
#
#   here, once:    bash scripts/real_model_gpu.sh prepare
#                  (fetches the GGUF into the cache if needed, splits it into .real/part0 and
#                   .real/part1 of 48 MiB, adds its SHA-256 and the pure-Python gguf wheel the GPU
#                   machine lacks; .real/ is ignored by git and travels only when carried)
#   GPU machine, two consecutive calls on one warm machine (what a call leaves in /tmp stays
#   until the machine is given back, 30 s after a call):
#     1. run: bash scripts/real_model_gpu.sh stash     carry: [".real/part0"]
#     2. run: bash scripts/real_model_gpu.sh run       carry: [".real/part1", ".real/SHA256", ".real/whl"]
#   `run` writes $OUT/real_model_gpu.txt (date, commit, device, figures, PASS/FAIL) and
#   $OUT/pytest-real-gpu.txt. `fp8kv` in its place (same carry) runs scripts/fp8_kv_accuracy.py:
#   the FP8 KV cache's perplexity against the bf16 cache's, into $OUT/fp8_kv_accuracy.json. Run `git rev-parse --short HEAD` here and pass it as KILN_COMMIT:
#   the GPU machine's copy has no usable .git.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=smollm2-135m
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
STASH=/tmp/kiln-real

case "${1:-}" in
  prepare)
    py=${PYTHON:-.venv/bin/python}
    "$py" scripts/fetch_real_models.py "$MODEL"
    gguf="$("$py" -c 'import sys; sys.path.insert(0, "tests"); import real_models as r; print(r.cache_dir())')/$MODEL/$GGUF_NAME"
    rm -rf .real && mkdir -p .real/whl
    split -b 48M -d -a 1 "$gguf" .real/part
    (cd "$(dirname "$gguf")" && sha256sum "$GGUF_NAME") > .real/SHA256
    version=$("$py" -c 'from importlib.metadata import version; print(version("gguf"))')
    "$py" -m pip download -q --no-deps --only-binary=:all: -d .real/whl "gguf==$version"
    ls -l .real .real/whl
    ;;
  stash)
    mkdir -p "$STASH"
    cp -r .real/. "$STASH"/
    ls -l "$STASH"
    ;;
  run|fp8kv)
    mkdir -p "$STASH"
    cp -r .real/. "$STASH"/
    export KILN_MODEL_CACHE=${KILN_MODEL_CACHE:-/tmp/kiln-models}
    mkdir -p "$KILN_MODEL_CACHE/$MODEL"
    cat "$STASH"/part? > "$KILN_MODEL_CACHE/$MODEL/$GGUF_NAME"
    (cd "$KILN_MODEL_CACHE/$MODEL" && sha256sum -c "$STASH/SHA256")
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$STASH"/whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site
    if [ "$1" = fp8kv ]; then
      out=${OUT:-gpu-results}
      mkdir -p "$out"
      exec python3 scripts/fp8_kv_accuracy.py --checkpoint "$KILN_MODEL_CACHE/$MODEL/$GGUF_NAME" \
        --out "$out/fp8_kv_accuracy.json"
    fi
    export KILN_GPU_WORKDIR=${KILN_GPU_WORKDIR:-$PWD/engines/gpu-work}
    out=${OUT:-gpu-results}
    mkdir -p "$out"
    set +e
    python3 scripts/real_model_gpu.py --workdir "$KILN_GPU_WORKDIR" --out "$out/real_model_gpu.txt"
    status=$?
    python3 -m pytest -m gpu -q -rP -p no:cacheprovider tests/test_real_gpu.py 2>&1 | tee "$out/pytest-real-gpu.txt"
    exit $(( status || PIPESTATUS[0] ))
    ;;
  *)
    echo "usage: $0 prepare|stash|run|fp8kv (see the top of this file)" >&2
    exit 2
    ;;
esac
