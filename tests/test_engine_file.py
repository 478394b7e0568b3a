"""Tests for the .engine file format (runtime/engine_file.py)."""

import copy
import json
import os
import struct
import warnings

import pytest
import torch

from kiln.runtime.engine_file import (
    FORMAT_VERSION, MAGIC, BadMagicError, ChecksumError, EngineFileError, RankMismatchError,
    TruncatedEngineError, UnsupportedVersionError, read_engine_file, write_engine_file,
)


def _weights():
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(7, 13, generator=g, dtype=torch.float32),
        "w_bf16": torch.randn(5, 3, 3, generator=g).to(torch.bfloat16),
        "w_fp16": torch.randn(11, generator=g).to(torch.float16),
        "ids": torch.arange(-3, 6, dtype=torch.int32).reshape(3, 3),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "one": torch.tensor([42], dtype=torch.int64),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "transposed": torch.randn(4, 6, generator=g).t(),  # non-contiguous input
    }


def _manifest(rank=0, world_size=2):
    return {"format": "kiln-engine", "model": {"name": "tiny", "layers": 2}, "rank": rank,
            "world_size": world_size, "plan": [{"op": "matmul", "args": [1, 2]}], "note": "héllo"}


KERNELS = {
    "matmul_bf16": (b"\x7fELF" + bytes(range(256)) * 3 + b"tail", {
        "plugin": "triton", "target": "sm_90", "entry": "mm_kernel",
        "launch": {"grid": [4, 1, 1], "block": [128, 1, 1], "shared_mem": 0}}),
    "tiny": (b"x", {"plugin": "cuda", "target": "sm_90", "entry": "k"}),
}


def _raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def engine(tmp_path):
    path = tmp_path / "rank0.engine"
    write_engine_file(path, _manifest(), _weights(), KERNELS)
    return path


def _header(path):
    return struct.unpack_from("<8sIIQQQI", path.read_bytes())


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip(engine):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no non-writable-buffer warning from torch
        ef = read_engine_file(engine, rank=0, world_size=2)
    expected = _weights()
    assert list(ef.weights) == list(expected)
    for name, t in expected.items():
        got = ef.weights[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert _raw(got) == _raw(t), name
    assert ef.kernels == {k: blob for k, (blob, _) in KERNELS.items()}
    for key, (blob, meta) in KERNELS.items():
        entry = ef.manifest["kernels"][key]
        assert entry["nbytes"] == len(blob)
        assert {k: v for k, v in entry.items() if k not in ("offset", "nbytes")} == meta
    for key, value in _manifest().items():
        assert ef.manifest[key] == value
    assert ef.path == engine


def test_layout_and_index(engine):
    magic, version, flags, m_off, m_len, total, _ = _header(engine)
    assert (magic, version, flags, m_off) == (MAGIC, FORMAT_VERSION, 0, 64)
    assert total == engine.stat().st_size
    ef = read_engine_file(engine)
    secs = ef.manifest["sections"]
    assert secs["weights"]["offset"] % 4096 == 0 and secs["kernels"]["offset"] % 4096 == 0
    assert secs["weights"]["offset"] >= m_off + m_len
    assert secs["kernels"]["offset"] >= secs["weights"]["offset"] + secs["weights"]["length"]
    assert total == secs["kernels"]["offset"] + secs["kernels"]["length"]
    idx = ef.manifest["weights"]
    assert idx["w_bf16"] == {"dtype": "bfloat16", "shape": [5, 3, 3],
                             "offset": idx["w_bf16"]["offset"], "nbytes": 90}
    assert idx["scalar"]["shape"] == [] and idx["ids"]["dtype"] == "int32"
    for e in list(idx.values()) + list(ef.manifest["kernels"].values()):
        assert e["offset"] % 256 == 0


def test_caller_dicts_not_mutated(tmp_path):
    manifest = _manifest()
    before = copy.deepcopy(manifest)
    write_engine_file(tmp_path / "e.engine", manifest, _weights(), KERNELS)
    assert manifest == before


def test_weights_are_views_of_a_private_mapping(engine):
    ef = read_engine_file(engine)
    before = engine.read_bytes()
    ef.weights["embed"].clone().add_(1)
    ef.weights["embed"].add_(1)  # copy-on-write: must not reach the file
    assert engine.read_bytes() == before


def test_no_kernels_and_no_weights(tmp_path):
    path = tmp_path / "cpu.engine"
    write_engine_file(path, _manifest(0, 1), {"w": torch.ones(3)})
    ef = read_engine_file(path, rank=0, world_size=1)
    assert ef.kernels == {} and ef.manifest["kernels"] == {}
    assert ef.manifest["sections"]["kernels"]["length"] == 0
    assert torch.equal(ef.weights["w"], torch.ones(3))
    write_engine_file(path, _manifest(0, 1), {})
    ef = read_engine_file(path)
    assert ef.weights == {} and ef.kernels == {}


def test_overwrite_existing(engine):
    write_engine_file(engine, _manifest(), {"only": torch.zeros(2)})
    assert list(read_engine_file(engine).weights) == ["only"]
    assert os.listdir(engine.parent) == [engine.name]


@pytest.mark.parametrize("where", ["empty", "magic", "header", "manifest", "weights", "last_byte"])
def test_truncated(engine, where):
    data = engine.read_bytes()
    w_off = json.loads(data[64:64 + _header(engine)[4]])["sections"]["weights"]["offset"]
    cut = {"empty": 0, "magic": 5, "header": 30, "manifest": 64 + 20,
           "weights": w_off + 100, "last_byte": len(data) - 1}[where]
    engine.write_bytes(data[:cut])
    with pytest.raises(TruncatedEngineError) as ei:
        read_engine_file(engine)
    msg = str(ei.value)
    assert "truncated" in msg and str(engine) in msg and "rebuild" in msg
    if cut >= 64:
        assert f"{len(data)} bytes" in msg and f"{cut} bytes" in msg


def test_manifest_checksum(engine):
    _flip(engine, 64 + 10)
    with pytest.raises(ChecksumError, match="manifest") as ei:
        read_engine_file(engine)
    assert ei.value.section == "manifest"


@pytest.mark.parametrize("section", ["weights", "kernels"])
def test_section_checksum(engine, section):
    sec = read_engine_file(engine).manifest["sections"][section]
    _flip(engine, sec["offset"] + sec["length"] // 2)
    with pytest.raises(ChecksumError) as ei:
        read_engine_file(engine)
    assert ei.value.section == section
    assert f"{section} section" in str(ei.value) and "rebuild" in str(ei.value)
    read_engine_file(engine, verify=False)  # skipping verification loads the damaged file


def test_bad_magic(tmp_path, engine):
    _flip(engine, 0)
    with pytest.raises(BadMagicError, match="not a Kiln engine file \\(bad magic\\)"):
        read_engine_file(engine)
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(BadMagicError) as ei:
        read_engine_file(other)
    assert str(other) in str(ei.value)


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 0])
def test_unsupported_version(engine, version):
    data = bytearray(engine.read_bytes())
    struct.pack_into("<I", data, 8, version)
    engine.write_bytes(bytes(data))
    with pytest.raises(UnsupportedVersionError) as ei:
        read_engine_file(engine)
    msg = str(ei.value)
    assert f"version {version}" in msg and f"supports version {FORMAT_VERSION}" in msg
    assert "rebuild" in msg and "upgrade Kiln" in msg


def test_version_checked_before_truncation(engine):
    data = bytearray(engine.read_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    engine.write_bytes(bytes(data[:200]))
    with pytest.raises(UnsupportedVersionError):
        read_engine_file(engine)


def test_rank_mismatch(tmp_path):
    path = tmp_path / "rank1.engine"
    write_engine_file(path, _manifest(1, 2), {"w": torch.ones(1)})
    with pytest.raises(RankMismatchError) as ei:
        read_engine_file(path, rank=0, world_size=2)
    assert "engine file is rank 1 of 2 but was loaded as rank 0 of 2" in str(ei.value)
    assert "rank0.engine" in str(ei.value)
    with pytest.raises(RankMismatchError, match="rank 1 of 2 but was loaded as rank 1 of 4"):
        read_engine_file(path, rank=1, world_size=4)
    with pytest.raises(RankMismatchError, match="loaded as rank 0 of 2"):
        read_engine_file(path, rank=0)
    assert read_engine_file(path, rank=1, world_size=2).manifest["rank"] == 1


def test_errors_share_a_base_class():
    for cls in (BadMagicError, UnsupportedVersionError, TruncatedEngineError, ChecksumError,
                RankMismatchError):
        assert issubclass(cls, EngineFileError)


@pytest.mark.parametrize("case", ["json", "not_tensor", "meta_tensor", "bad_kernel"])
def test_failed_write_leaves_nothing(tmp_path, case):
    manifest, weights, kernels = _manifest(), _weights(), dict(KERNELS)
    if case == "json":
        manifest["oops"] = torch.ones(1)
    elif case == "not_tensor":
        weights["bad"] = [1, 2, 3]
    elif case == "meta_tensor":
        weights["zz"] = torch.empty(4, device="meta")  # fails mid-stream, after the temp exists
    else:
        kernels["bad"] = (12345, {})
    path = tmp_path / "rank0.engine"
    with pytest.raises((TypeError, ValueError, NotImplementedError, RuntimeError)):
        write_engine_file(path, manifest, weights, kernels)
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_old_file(engine):
    before = engine.read_bytes()
    with pytest.raises(Exception):
        write_engine_file(engine, _manifest(), {"zz": torch.empty(4, device="meta")})
    assert engine.read_bytes() == before
    assert os.listdir(engine.parent) == [engine.name]
