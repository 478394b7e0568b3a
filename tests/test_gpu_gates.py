"""scripts/gpu_gates.sh on the CPU: its stages on the tiny shape, so that the script the GPU machine runs for the
issues' gate figures keeps working between the sessions that get one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kiln.engines.format import read_engine_file

ROOT = Path(__file__).resolve().parents[1]
TINY = {"GATES_SHAPE": "tiny", "GATES_FLAGS": "--max-seq-len 64 --max-num-tokens 64",
        "GATES_BENCH": "--decode-context 16 --decode-steps 4 --batch-sizes 1,2 --offline 8/8 --offline-requests 4 "
                       "--rate-requests 4 --rate-lengths 8/8"}


def _gates(tmp_path: Path, *stages: str) -> subprocess.CompletedProcess:
    # The script runs `python3`: this interpreter's, as on the GPU machine, where it is the one with torch.
    env = {**os.environ, **TINY, "OUT": str(tmp_path / "out"), "KILN_GATES_WORKDIR": str(tmp_path / "work"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_gates.sh"), *stages], env=env, capture_output=True,
                          text=True, timeout=900)


def _names(path: Path, phase: str) -> list[str]:
    return [figure["name"] for figure in json.loads(path.read_text())[phase]]


def test_every_stage_writes_its_figures(tmp_path):
    done = _gates(tmp_path, "build", "decode", "offline-bf16", "offline-fp8kv")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out, work = tmp_path / "out", tmp_path / "work"
    assert _names(out / "decode.json", "decode") == ["decode b=1", "decode b=2", "fp8 decode b=1", "fp8 decode b=2"]
    assert _names(out / "latency.json", "startup") == ["start-up to engine loaded", "start-up to first token"]
    assert "ITL p50" in _names(out / "latency.json", "latency")
    for stage in ("offline-bf16", "offline-fp8kv"):
        assert _names(out / f"{stage}.json", "offline") == ["offline 8/8 output", "offline 8/8 total"]
    # The offline stages' engines: the ratio of issue 14 is FP8 weights with the e4m3 cache against bf16.
    fp8 = read_engine_file(work / "offline-fp8kv" / "rank0.engine").manifest
    bf16 = read_engine_file(work / "offline-bf16" / "rank0.engine").manifest
    assert (fp8.quantization, fp8.kv.dtype, fp8.max_batch_size) == ("fp8", "float8_e4m3fn", 512)
    assert (bf16.quantization, bf16.kv.dtype) == ("none", "bfloat16")
    assert (out / "stages.txt").read_text().count("== ") == 5   # four stages and the end


def test_an_unknown_stage_fails_and_names_the_stages(tmp_path):
    done = _gates(tmp_path, "offline")
    assert done.returncode != 0
    assert "unknown stage offline: build, decode, offline-bf16 or offline-fp8kv" in done.stderr
