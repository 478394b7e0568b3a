"""Kiln's own GGUF header parser (models/gguf_file.py): every metadata value type comes back as
written, as the `gguf` package's GGUFReader reads it, the data section honours
general.alignment, and a header cut short or damaged is refused with the header error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.models.config import CheckpointError
from kiln.models.gguf_file import GGUFFile

VALUES = {  # key -> (value type name, value, array item type name or None)
    "t.u8": ("UINT8", 200, None), "t.i8": ("INT8", -5, None), "t.u16": ("UINT16", 60000, None),
    "t.i16": ("INT16", -30000, None), "t.u32": ("UINT32", 4_000_000_000, None), "t.i32": ("INT32", -7, None),
    "t.f32": ("FLOAT32", 0.5, None), "t.bool": ("BOOL", True, None), "t.no": ("BOOL", False, None),
    "t.str": ("STRING", "héllo ✓", None), "t.empty": ("STRING", "", None),
    "t.u64": ("UINT64", 2**64 - 1, None), "t.i64": ("INT64", -2**63, None), "t.f64": ("FLOAT64", 0.1, None),
    "t.strs": ("ARRAY", ["a", "", "ü", "<0x0A>"], "STRING"),
    "t.u8s": ("ARRAY", [0, 255], "UINT8"), "t.i8s": ("ARRAY", [-128, 127], "INT8"),
    "t.u16s": ("ARRAY", [1, 65535], "UINT16"), "t.i16s": ("ARRAY", [-2, 3], "INT16"),
    "t.u32s": ("ARRAY", [5, 2**32 - 1], "UINT32"), "t.i32s": ("ARRAY", [-5, 6], "INT32"),
    "t.f32s": ("ARRAY", [0.25, -2.5], "FLOAT32"), "t.bools": ("ARRAY", [True, False], "BOOL"),
    "t.u64s": ("ARRAY", [2**64 - 1, 7], "UINT64"), "t.i64s": ("ARRAY", [-2**63, 8], "INT64"),
    "t.f64s": ("ARRAY", [0.1, 1e300], "FLOAT64"),
    "t.nested": ("ARRAY", [[1, 2, 3], [4]], "ARRAY"), "t.nested_strs": ("ARRAY", [["x", "y"], ["z"]], "ARRAY"),
}
NESTED = ("t.nested", "t.nested_strs")  # GGUFReader flattens nested arrays; Kiln keeps their structure


def write(path, alignment=None, keys=VALUES):
    from gguf import GGUFValueType, GGUFWriter

    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key in keys:
        vtype, value, sub = VALUES[key]
        w.add_key_value(key, value, GGUFValueType[vtype], sub_type=None if sub is None else GGUFValueType[sub])
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b", np.arange(40, dtype=np.float16).reshape(2, 4, 5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_reads_back_as_written(tmp_path):
    f = GGUFFile(write(tmp_path / "m.gguf"))
    for key, (_, value, _) in VALUES.items():
        got = f.metadata(key)
        assert got == value and type(got) is type(value), key
    assert f.metadata("no.such.key", "x") == "x" and f.architecture == "llama"
    assert f.metadata("GGUF.version") == 3 and f.metadata("GGUF.tensor_count") == 2
    f.metadata("t.u32s").append(1)  # a caller's list is its own
    assert f.metadata("t.u32s") == [5, 2**32 - 1]


def test_metadata_equals_the_gguf_packages_reader(tmp_path):
    from gguf import GGUFReader

    path = write(tmp_path / "m.gguf", keys=[k for k in VALUES if k not in NESTED])
    f, reader = GGUFFile(path), GGUFReader(path)
    assert list(f._fields) == list(reader.fields)
    for key, field in reader.fields.items():
        want = field.contents()
        assert f.metadata(key) == want and type(f.metadata(key)) is type(want), key


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_tensors_are_found_at_the_aligned_data_section(tmp_path, alignment):
    f = GGUFFile(write(tmp_path / "m.gguf", alignment))
    assert f.tensor_names == ["a", "b"] and [f.tensor_type(n) for n in "ab"] == ["F32", "F16"]
    assert torch.equal(f.tensor("a"), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(f.tensor("b"), torch.arange(40, dtype=torch.float32).reshape(2, 4, 5))


def test_a_header_cut_short_anywhere_is_refused(tmp_path):
    data = write(tmp_path / "m.gguf").read_bytes()
    header_end = data.index(np.arange(6, dtype=np.float32).tobytes())
    for keep in list(range(4, 200)) + list(range(200, header_end, 37)):
        (tmp_path / "cut.gguf").write_bytes(data[:keep])
        with pytest.raises(CheckpointError, match="truncated"):
            GGUFFile(tmp_path / "cut.gguf")


@pytest.mark.parametrize("offset, value, why", [
    (4, 1, "version 1"),  # GGUF version 1 (32-bit counts) is not read
    (4, 0x03000000, "version"),  # a big-endian file
    (24 + 8 + len("general.architecture"), 13, "value type 13"),  # the first key's value type
])
def test_a_damaged_header_is_refused(tmp_path, offset, value, why):
    data = bytearray(write(tmp_path / "m.gguf").read_bytes())
    data[offset:offset + 4] = value.to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"cannot read the GGUF header.*{why}"):
        GGUFFile(tmp_path / "bad.gguf")
