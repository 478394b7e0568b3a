"""GGUF weights are read as their block formats define: every tensor type Kiln accepts, written
raw into a GGUF with gguf.GGUFWriter and read back through Kiln's reader, equals an independent
reading of the format (tests/gguf_reference.py), or numpy's own conversion for the float types."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_files import write_gguf
from gguf_reference import REFERENCES, random_blocks, reference_dequantize
from kiln.models.gguf_file import SUPPORTED_TYPES, GGUFFile

ROWS, COLS = 3, 512


@pytest.mark.parametrize("qtype", sorted(REFERENCES))
def test_quantized_type_matches_the_reference(tmp_path, qtype):
    raw = random_blocks(qtype, ROWS, COLS, seed=len(qtype))
    path = write_gguf(tmp_path / "q.gguf", "llama", {}, {"w": (raw, qtype)})
    got = GGUFFile(path).tensor("w")
    want = torch.from_numpy(reference_dequantize(qtype, raw, COLS))
    assert got.shape == (ROWS, COLS) and got.dtype == torch.float32
    assert torch.isfinite(want).all() and want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_float_types_read_exactly(tmp_path, dtype):
    values = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(dtype)
    path = write_gguf(tmp_path / "f.gguf", "llama", {}, {"w": (values, None)})
    assert torch.equal(GGUFFile(path).tensor("w"), torch.from_numpy(values.astype(np.float32)))


def test_bf16_reads_exactly(tmp_path):
    values = torch.randn(ROWS, COLS).to(torch.bfloat16)
    raw = values.view(torch.int16).numpy().view(np.uint8).reshape(ROWS, COLS * 2)
    path = write_gguf(tmp_path / "b.gguf", "llama", {}, {"w": (raw, "BF16")})
    assert torch.equal(GGUFFile(path).tensor("w"), values.float())


def test_every_supported_quantized_type_has_a_reference():
    assert set(SUPPORTED_TYPES) - set(REFERENCES) == {"F32", "F16", "BF16"}
