"""Building engines and compiling kernels for GPU targets from a test: in a fresh process, since
the test process runs Triton in its interpreter when there is no GPU (conftest.py) and AOT
compilation needs it out of interpreter mode."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compiler_env() -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def compiled_json(script: str, *args: str, timeout: float = 600):
    """What `script` (Python source, run with `args` out of interpreter mode from the repository
    root) prints as JSON on its standard output."""
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT,
                          env={**compiler_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def build_cli(checkpoint, output, targets, cache, *, dtype: str = "bfloat16", max_seq_len: int = 64,
              max_num_tokens: int = 64, max_batch_size: int | None = None, kv_block_size: int = 16,
              timeout: float = 600, extra: list[str] = ()) -> subprocess.CompletedProcess:
    """Run `build-engine` for `targets` with its cubins cached under `cache` (KILN_CACHE).
    `max_batch_size` None keeps build-engine's default; `extra` are more flags."""
    env = {**compiler_env(), "KILN_CACHE": str(cache)}
    args = ["--checkpoint", str(checkpoint), "--output", str(output), "--dtype", dtype,
            "--max-seq-len", str(max_seq_len), "--max-num-tokens", str(max_num_tokens),
            "--kv-block-size", str(kv_block_size), "--quiet"]
    if max_batch_size is not None:
        args += ["--max-batch-size", str(max_batch_size)]
    for t in targets:
        args += ["--target", t]
    args += list(extra)
    code = "import sys; from kiln.builder.cli import build_engine; build_engine(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
