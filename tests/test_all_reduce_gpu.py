"""The custom all-reduce between two GPUs (GPU only: `pytest -m gpu`, on a machine with two):
two processes, one per GPU, as a tensor-parallel engine's workers are. Its sums equal NCCL's
for every size up to its capacity in bf16, fp16 and fp32; a CUDA graph of custom all-reduces
replayed 200 times with new data gives the right sum every time (the epoch comes from the
kernel's own counters, not from the captured arguments); and its time per call against
NCCL's is printed for decode sizes. tests/all_reduce_rank.py is what each rank runs."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_build import compiler_env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def test_custom_all_reduce_sums_as_nccl_does_eagerly_and_in_graphs(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Compiling the kernel needs Triton out of interpreter mode (kernel test modules set it here).
    env = compiler_env()
    outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "all_reduce_rank.py"), str(r), str(WORLD),
                               str(port), str(outs[r])], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    try:
        logs = [p.communicate(timeout=540)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * WORLD, "\n".join(log[-3000:] for log in logs)
    results = [json.loads(o.read_text()) for o in outs]
    for rank, result in enumerate(results):
        assert result["eager"] == [], f"rank {rank}: {result['eager']}"
        assert result["graph"] == [], f"rank {rank}: {result['graph']}"
    print(json.dumps({"timing_us_rank0": results[0]["timing_us"], "seconds": results[0]["seconds"]}, indent=1))
