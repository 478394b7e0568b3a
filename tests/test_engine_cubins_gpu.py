"""The cubins in an engine load on this GPU through the driver API (GPU only: `pytest -m gpu`).

Set KILN_GPU_ENGINE to an engine folder built elsewhere (for example on a machine without a
GPU) to check that one; otherwise an engine for this GPU is built here first.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.engines.format import read_engine_file

pytestmark = pytest.mark.gpu


def test_every_cubin_for_this_gpu_loads(factory, tmp_path):
    from kiln.runtime.cuda_driver import device_arch, load_kernel
    from gpu_build import build_cli

    arch = device_arch()
    engine = os.environ.get("KILN_GPU_ENGINE")
    if engine is None:
        result = build_cli(factory.checkpoint("llama3"), tmp_path / "engine", [arch], tmp_path / "cache")
        assert result.returncode == 0, result.stderr
        engine = tmp_path / "engine"
    ef = read_engine_file(Path(engine) / "rank0.engine")
    mine = {k: e for k, e in ef.manifest.kernels.items() if e.target == arch}
    assert mine, f"the engine has no cubins for {arch}; its targets are {ef.manifest.targets}"
    for key, entry in mine.items():
        load_kernel(ef.kernels[key], entry.entry, list(entry.signature), entry.num_warps, entry.shared_bytes)
