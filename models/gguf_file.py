"""One GGUF file (llama.cpp's single-file model format), read through the `gguf` package: its
metadata and its tensors, each dequantized to float32 on request.

Opening checks everything that can be checked without reading a weight: the magic, that the
header parses, that every tensor's bytes lie inside the file (a download cut short is caught
here, not halfway through a build) and that every tensor's type is one Kiln dequantizes.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.models.config import CheckpointError

GGUF_MAGIC = b"GGUF"

# The tensor types Kiln dequantizes (through gguf.quants), by their llama.cpp names.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


class GGUFFile:
    """An opened, checked GGUF file. `metadata(key)` reads one metadata value as plain Python
    (str, int, float, bool or a list of them); `tensor(name)` dequantizes one tensor."""

    def __init__(self, path: str | Path):
        # Imported here so that only GGUF users need the package.
        from gguf import GGUFReader

        self.path = Path(path)
        if not is_gguf(self.path):
            raise CheckpointError(f"{self.path} is not a GGUF file (it does not start with the magic 'GGUF')")
        try:
            self._reader = GGUFReader(self.path)
        except (ValueError, IndexError, KeyError, OSError) as e:
            raise CheckpointError(f"{self.path}: cannot read the GGUF header ({e}): the file is truncated or "
                                  "damaged; download it again") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_extent()
        self._check_types()

    def _check_extent(self) -> None:
        size = self.path.stat().st_size
        for t in self._tensors.values():
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise CheckpointError(
                    f"{self.path} is truncated: tensor {t.name!r} ends at byte {end:,} but the file has "
                    f"{size:,} bytes; download it again")

    def _check_types(self) -> None:
        unsupported = sorted({(t.tensor_type.name, name) for name, t in self._tensors.items()
                              if t.tensor_type.name not in SUPPORTED_TYPES})
        if unsupported:
            kinds = sorted({kind for kind, _ in unsupported})
            raise CheckpointError(
                f"{self.path}: tensor type {', '.join(kinds)} is not supported (first tensor: "
                f"{unsupported[0][1]!r}); Kiln dequantizes {', '.join(SUPPORTED_TYPES)}: use a GGUF "
                "quantized to one of those")

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def metadata(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        if key not in self._reader.fields:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is missing (is the file from a recent "
                                  "llama.cpp converter?)")
        return self.metadata(key)

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as float32, in PyTorch's (row-major, outermost first) shape."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        values = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the innermost dimension first
        # A copy: an F32 tensor is a view of the read-only memory map.
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The opened file, shared by every caller while the file on disk is unchanged (parsing the
    metadata of a large vocabulary takes seconds)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _open(str(path), stat.st_size, stat.st_mtime_ns)
