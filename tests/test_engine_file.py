"""Tests for the .engine file format (engines/format.py)."""

import copy
import dataclasses
import json
import os
import struct
import warnings
import zlib

import pytest
import torch

from kiln.engines.format import (
    FORMAT_VERSION, MAGIC, BadMagicError, ChecksumError, CorruptEngineError, EngineFileError, RankMismatchError,
    TruncatedEngineError, UnsupportedVersionError, read_engine_file, write_engine_file,
)
from kiln.engines.manifest import KVLayout, Manifest, PlanEntry, Slot, TensorSpec


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


# One op that names a weight and both kernels: only for files written with _weights() and KERNELS.
PLAN = (PlanEntry("embedding", 2, {"input_ids": "input_ids", "weight": "embed"}, {"scale": 1.0}, "logits", "model.embed",
                  {"sm_90": ("matmul_bf16", "tiny")}),)


def _manifest(rank=0, world_size=2, plan=()):
    return Manifest(
        kiln_version="test", model={"name": "tiny", "layers": 2, "note": "héllo"}, dtype="float32",
        targets=("cpu", "sm_90"), rank=rank, world_size=world_size, max_num_tokens=16, max_batch_size=4,
        max_seq_len=32, kv=KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32"),
        tokenizer_file=None, inputs=("input_ids",), outputs=("logits",),
        tensors={"input_ids": TensorSpec(("T",), "int32", "input"),
                 "logits": TensorSpec(("L", 7), "float32", "activation")},
        plan=plan,
        arena_bytes=512, slots={"input_ids": Slot(0, 256), "logits": Slot(256, 256)})


def _meta(entry, **launch):
    return {"plugin": "embedding", "target": "sm_90", "entry": entry, "signature": ["*fp32", "i32"],
            "num_warps": 4, "shared_bytes": 0, "launch": launch}


KERNELS = {
    "matmul_bf16": (b"\x7fELF" + bytes(range(256)) * 3 + b"tail", _meta("mm_kernel", grid=[4, 1, 1])),
    "tiny": (b"x", _meta("k")),
    "tma": (b"\x7fELF tma", {**_meta("tma_kernel", grid="min(cdiv(T, 128) * 16, SMS)"), "global_scratch": 384}),
}


def _raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def engine(tmp_path):
    path = tmp_path / "rank0.engine"
    write_engine_file(path, _manifest(plan=PLAN), _weights(), KERNELS)
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
        entry = ef.manifest.kernels[key]
        assert entry.nbytes == len(blob)
        # global_scratch is written only where a kernel needs it, and reads as 0 where absent.
        assert {**dataclasses.asdict(entry), "signature": list(entry.signature)} == {
            "global_scratch": 0, **meta, "offset": entry.offset, "nbytes": len(blob)}
    written = _manifest(plan=PLAN)
    assert dataclasses.replace(ef.manifest, weights={}, kernels={}, sections={}) == written
    assert ef.path == engine


def test_layout_and_index(engine):
    magic, version, flags, m_off, m_len, total, _ = _header(engine)
    assert (magic, version, flags, m_off) == (MAGIC, FORMAT_VERSION, 0, 64)
    assert total == engine.stat().st_size
    ef = read_engine_file(engine)
    w, k = ef.manifest.sections["weights"], ef.manifest.sections["kernels"]
    assert w.offset % 4096 == 0 and k.offset % 4096 == 0
    assert w.offset >= m_off + m_len
    assert k.offset >= w.offset + w.length
    assert total == k.offset + k.length
    idx = ef.manifest.weights
    assert (idx["w_bf16"].dtype, idx["w_bf16"].shape, idx["w_bf16"].nbytes) == ("bfloat16", (5, 3, 3), 90)
    assert idx["scalar"].shape == () and idx["ids"].dtype == "int32"
    for e in list(idx.values()) + list(ef.manifest.kernels.values()):
        assert e.offset % 256 == 0
    # The manifest's JSON is the documented layout (engines/README.md), and reads back equal.
    raw = json.loads(engine.read_bytes()[m_off:m_off + m_len])
    assert set(raw) == {"kiln_version", "model", "dtype", "targets", "rank", "world_size", "limits", "kv_cache",
                        "tokenizer", "chat_template", "quantization", "inputs", "outputs", "tensors", "plan", "all_reduce_kernels",
                        "memory_plan", "weights", "kernels", "sections"}
    assert Manifest.from_json(raw) == ef.manifest


def test_caller_manifest_not_mutated(tmp_path):
    manifest = _manifest()
    before = copy.deepcopy(manifest)
    write_engine_file(tmp_path / "e.engine", manifest, _weights(), KERNELS)
    assert manifest == before and manifest.weights == {}


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
    assert ef.kernels == {} and ef.manifest.kernels == {}
    assert ef.manifest.sections["kernels"].length == 0
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
    w_off = read_engine_file(engine).manifest.sections["weights"].offset
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
    sec = read_engine_file(engine).manifest.sections[section]
    _flip(engine, sec.offset + sec.length // 2)
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


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_a_version_3_engine_loads_unless_it_holds_fp8_kernels(tmp_path, quantization):
    """Version 3's FP8 decode kernels quantized x themselves, with other launch arguments."""
    path = tmp_path / "rank0.engine"
    write_engine_file(path, dataclasses.replace(_manifest(plan=PLAN), quantization=quantization), _weights(), KERNELS)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, 3)
    path.write_bytes(bytes(data))
    if quantization == "none":
        assert read_engine_file(path).manifest.quantization == "none"
        return
    with pytest.raises(UnsupportedVersionError, match="fp8 engine \\(format version 3\\).*rebuild the engine"):
        read_engine_file(path)


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
    assert read_engine_file(path, rank=1, world_size=2).manifest.rank == 1


def test_errors_share_a_base_class():
    for cls in (BadMagicError, UnsupportedVersionError, TruncatedEngineError, ChecksumError,
                RankMismatchError):
        assert issubclass(cls, EngineFileError)


@pytest.mark.parametrize("case", ["json", "not_tensor", "meta_tensor", "bad_kernel"])
def test_failed_write_leaves_nothing(tmp_path, case):
    manifest, weights, kernels = _manifest(), _weights(), dict(KERNELS)
    if case == "json":
        manifest = dataclasses.replace(manifest, model={"oops": torch.ones(1)})
    elif case == "not_tensor":
        weights["bad"] = [1, 2, 3]
    elif case == "meta_tensor":
        weights["zz"] = torch.empty(4, device="meta")  # fails mid-stream, after the temp exists
    else:
        kernels["bad"] = (12345, _meta("bad"))
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


def _write_raw(path, version, manifest: dict):
    """An engine file of `version` with `manifest` as its JSON and empty sections, byte by byte."""
    body = json.dumps(manifest).encode()
    total = 4096
    header = struct.pack("<8sIIQQQI", MAGIC, version, 0, 64, len(body), total, zlib.crc32(body)).ljust(64, b"\0")
    path.write_bytes((header + body).ljust(total, b"\0"))


def _version_1_manifest():
    """The manifest as format version 1 wrote it: build flags and memory_plan.bounds, both with the limits."""
    empty = {"offset": 4096, "length": 0, "crc32": 0}
    sections = {"weights": empty, "kernels": empty}
    return {"kiln_version": "0.1.0", "model": {}, "targets": ["cpu"], "rank": 0, "world_size": 1,
            "build": {"dtype": "float32", "tp_size": 1, "max_batch_size": 8, "max_seq_len": 64, "max_num_tokens": 64,
                      "kv_block_size": 16, "targets": ["cpu"]},
            "inputs": [], "outputs": ["logits"], "tensors": {"logits": {"shape": ["L", 7], "dtype": "float32",
                                                                      "kind": "activation"}},
            "plan": [], "memory_plan": {"arena_bytes": 256, "bounds": {"T": 64, "S": 8, "L": 8, "B": 4},
                                        "tensors": {"logits": {"offset": 0, "nbytes": 256}}},
            "kv_cache": {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"},
            "weights": {}, "kernels": {}, "sections": sections}


def test_an_engine_of_the_old_format_is_refused_with_a_rebuild_message(tmp_path):
    path = tmp_path / "rank0.engine"
    _write_raw(path, 1, _version_1_manifest())
    with pytest.raises(UnsupportedVersionError) as ei:
        read_engine_file(path)
    msg = str(ei.value)
    assert str(path) in msg and "version 1 was written by an older Kiln" in msg
    assert f"reads version {FORMAT_VERSION}" in msg and "rebuild the engine" in msg


def test_a_manifest_of_another_shape_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "rank0.engine"
    _write_raw(path, FORMAT_VERSION, _version_1_manifest())
    with pytest.raises(CorruptEngineError, match="manifest has no 'limits'.*rebuild"):
        read_engine_file(path)


@pytest.mark.parametrize("change, message", [
    (lambda m: m["limits"].update(max_num_tokens=0), r"manifest.limits.max_num_tokens must be an integer >= 1, got 0"),
    (lambda m: m["kv_cache"].update(dtype="float7"), r"manifest.kv_cache.dtype must be a torch dtype name"),
    (lambda m: m.update(rank=2), r"rank 2 is not below world_size 2"),
    (lambda m: m["plan"][0]["inputs"].update(weight="nowhere"), r"plan op 0 \(embedding\) names tensor 'nowhere'"),
    (lambda m: m["plan"][0]["kernel_keys"].update(sm_90=["gone"]), r"plan op 0 \(embedding\) names kernel 'gone'"),
    (lambda m: m.update(all_reduce_kernels={"sm_90": ["lost"]}), r"all_reduce_kernels names kernel 'lost'"),
    (lambda m: m.update(all_reduce_kernels={"sm_90": "key"}), r"manifest.all_reduce_kernels.sm_90 must be a list"),
    (lambda m: m["memory_plan"]["tensors"].pop("logits"), r"tensor 'logits' has no place in the memory plan"),
    (lambda m: m["tensors"]["logits"].update(shape=["L", "V"]), r"the first output must be a tensor of fixed width"),
    (lambda m: m.update(targets="cpu"), r"manifest.targets must be a list of strings"),
    (lambda m: m["model"].update(eos_token_ids=2), r"manifest.model.eos_token_ids must be a list of token ids"),
])
def test_manifest_checks_each_field_once_when_read(engine, change, message):
    raw = read_engine_file(engine).manifest.to_json()
    change(raw)
    with pytest.raises(ValueError, match=message):
        Manifest.from_json(raw)


def test_each_fact_is_stored_once(engine):
    m = read_engine_file(engine).manifest
    assert m.blocks_per_sequence == 8 and m.vocab_size == 7
    assert m.symbol_bounds == {"T": 16, "S": 4, "L": 4, "B": 8}
    assert m.kv.bytes_per_token == 2 * 2 * 1 * 8 * 4 and m.kv.bytes_per_block == 4 * m.kv.bytes_per_token
    text = json.dumps(m.to_json())
    for derived in ("blocks_per_sequence", "vocab_size", "bounds", "bytes_per_token", "tp_size", "kv_block_size"):
        assert derived not in text
