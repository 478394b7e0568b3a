"""Loading engine folders in the runtime: each wrong folder gets its own clear error."""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

import pytest

from kiln.engines.format import RankMismatchError, read_engine_file, write_engine_file
from kiln.runtime.engine import EngineLoadError, load_engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step


def test_missing_folder_and_empty_folder(tmp_path):
    with pytest.raises(EngineLoadError, match="does not exist: build one with build-engine"):
        load_engine(tmp_path / "nope")
    with pytest.raises(EngineLoadError, match="holds no rank\\*.engine files"):
        load_engine(tmp_path)


def test_rank_file_missing_from_tp_folder(factory, tmp_path):
    engine = factory.engine(factory.checkpoint("llama2"), dtype="float32", tp_size=2)
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(engine / "rank1.engine", lonely / "rank1.engine")
    with pytest.raises(EngineLoadError, match="has no rank0.engine"):
        load_engine(lonely, rank=0)
    with pytest.raises(EngineLoadError, match="rank 1 of 2 but the folder holds 1 rank files"):
        load_engine(lonely, rank=1)


def test_file_renamed_to_wrong_rank(factory, tmp_path):
    engine = factory.engine(factory.checkpoint("llama2"), dtype="float32", tp_size=2)
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    shutil.copy(engine / "rank1.engine", swapped / "rank0.engine")
    shutil.copy(engine / "rank0.engine", swapped / "rank1.engine")
    with pytest.raises(RankMismatchError, match="rank 1 of 2 but was loaded as rank 0"):
        load_engine(swapped, rank=0)


def test_engine_for_another_target_is_refused(factory, tmp_path):
    src = read_engine_file(factory.engine(factory.checkpoint("llama2"), dtype="float32") / "rank0.engine")
    manifest = dataclasses.replace(src.manifest, targets=("sm_89",))
    gpu_only = tmp_path / "gpu-only"
    gpu_only.mkdir()
    write_engine_file(gpu_only / "rank0.engine", manifest, src.weights)
    with pytest.raises(EngineLoadError, match="engine built for sm_89; this machine needs cpu: rebuild with --target cpu"):
        load_engine(gpu_only)


def test_step_beyond_build_bounds_is_refused(factory):
    engine = load_engine(factory.engine(factory.checkpoint("llama2"), dtype="float32", max_num_tokens=8))
    ex = CpuExecutor(engine, num_kv_blocks=8)
    step = pack_step([SequenceChunk(list(range(3, 13)), 0, [0, 1, 2])], 4, engine.manifest.blocks_per_sequence)
    with pytest.raises(ValueError, match="step has 10 tokens; the engine was built for at most 8"):
        ex.run(step)


_opened: list[str] | None = None


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_record_open)  # audit hooks stay for the process: it records only inside the test


@pytest.mark.parametrize("device", [None, "cpu"])
def test_start_up_reads_the_rank_file_once(factory, device):
    global _opened
    engine = factory.engine(factory.checkpoint("llama2"), dtype="float32")
    _opened = []
    try:
        core = EngineCore(engine, device=device)
    finally:
        opened, _opened = _opened, None
    core.close()
    assert sum(Path(p).name == "rank0.engine" for p in opened) == 1, opened
