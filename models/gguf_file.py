"""One GGUF file (llama.cpp's single-file model format): its metadata and its tensors, each
dequantized to float32 on request.

The header (metadata and tensor table) is parsed here, from a memory map of the file: the `gguf`
package's GGUFReader makes a numpy view per array element and takes most of a minute over a
262k-token vocabulary. Numeric arrays are read in one np.frombuffer each; strings stay bytes
until `metadata` returns them. The weights are dequantized by the `gguf` package (gguf.quants).

Opening checks everything that can be checked without reading a weight: the magic, that the
header parses, that every tensor's bytes lie inside the file (a download cut short is caught
here, not halfway through a build) and that every tensor's type is one Kiln dequantizes.
"""
from __future__ import annotations

import functools
import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kiln.models.config import CheckpointError

GGUF_MAGIC = b"GGUF"

# The tensor types Kiln dequantizes (through gguf.quants), by their llama.cpp names.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# GGUF metadata value types (the spec's numbering) with fixed-size values, as struct/numpy codes.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_UINT32, _STRING, _ARRAY = 4, 8, 9
_U64 = struct.Struct("<Q")


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


class _Tensor(NamedTuple):
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch's order: GGUF lists the innermost dimension first
    offset: int  # absolute, in the file
    n_bytes: int


class _Reader:
    """A cursor over the little-endian header. A read past the end raises (struct.error or
    ValueError): a cut-short header is a parse error, never garbage."""

    def __init__(self, buf: mmap.mmap, pos: int):
        self.buf, self.pos = buf, pos

    def fixed(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def array(self, code: str, count: int) -> np.ndarray:
        array = np.frombuffer(self.buf, np.dtype("<" + code), count, self.pos)
        self.pos += array.nbytes
        return array

    def strings(self, count: int) -> list[bytes]:
        # Locals, not attributes: this loop runs once per vocabulary token.
        buf, pos, size, unpack, out = self.buf, self.pos, len(self.buf), _U64.unpack_from, []
        for _ in range(count):
            end = pos + 8 + unpack(buf, pos)[0]
            if end > size:
                raise ValueError(f"a string at byte {pos:,} runs past the end of the file")
            out.append(buf[pos + 8:end])
            pos = end
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        """Numbers as Python, strings as bytes, numeric arrays as numpy arrays, other arrays as lists."""
        if vtype in _FIXED:
            return self.fixed(_FIXED[vtype])
        if vtype == _STRING:
            return self.strings(1)[0]
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        item_type, count = self.fixed("I"), self.fixed("Q")
        if item_type in _FIXED:
            return self.array(_FIXED[item_type], count)
        if item_type == _STRING:
            return self.strings(count)
        return [self.value(item_type) for _ in range(count)]


def _plain(value: Any) -> Any:
    """A parsed metadata value as fresh plain Python: callers may change what they get."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return str(value, "utf-8")
    if isinstance(value, list):
        return [str(v, "utf-8") if isinstance(v, bytes) else _plain(v) for v in value]
    return value


class GGUFFile:
    """An opened, checked GGUF file. `metadata(key)` reads one metadata value as plain Python
    (str, int, float, bool or a list of them); `tensor(name)` dequantizes one tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not is_gguf(self.path):
            raise CheckpointError(f"{self.path} is not a GGUF file (it does not start with the magic 'GGUF')")
        try:
            self._parse()
        except (ValueError, IndexError, KeyError, OSError, OverflowError, struct.error) as e:
            raise CheckpointError(f"{self.path}: cannot read the GGUF header ({e}): the file is truncated or "
                                  "damaged; download it again") from None
        self._check_extent()
        self._check_types()

    def _parse(self) -> None:
        # Imported here so that only GGUF users need the package.
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        r = _Reader(self._map, len(GGUF_MAGIC))
        version = r.fixed("I")
        if version not in (2, 3):  # 1 had 32-bit counts; a byte-swapped (big-endian) file reads as huge
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = r.fixed("Q"), r.fixed("Q")
        # The counts are readable as metadata, as GGUFReader made them.
        self._fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        alignment = 32
        for _ in range(n_kv):
            key = str(r.strings(1)[0], "utf-8")
            if key in self._fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            vtype = r.fixed("I")
            self._fields[key] = r.value(vtype)
            if key == "general.alignment":
                alignment = self._fields[key]
                if vtype != _UINT32 or alignment <= 0 or alignment & (alignment - 1):
                    raise ValueError("general.alignment is not a power of two stored as uint32")
        infos = []
        for _ in range(n_tensors):
            name, dims = str(r.strings(1)[0], "utf-8"), r.array("Q", r.fixed("I")).tolist()
            infos.append((name, dims, GGMLQuantizationType(r.fixed("I")), r.fixed("Q")))
        data_start = -(-r.pos // alignment) * alignment  # the data section starts aligned
        self._tensors: dict[str, _Tensor] = {}
        for name, dims, qtype, offset in infos:
            if name in self._tensors:
                raise ValueError(f"tensor {name!r} appears twice")
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = math.prod(dims) * type_size // block_size
            self._tensors[name] = _Tensor(qtype, tuple(reversed(dims)), data_start + offset, n_bytes)

    def _check_extent(self) -> None:
        size = self.path.stat().st_size
        for name, t in self._tensors.items():
            end = t.offset + t.n_bytes
            if end > size:
                raise CheckpointError(
                    f"{self.path} is truncated: tensor {name!r} ends at byte {end:,} but the file has "
                    f"{size:,} bytes; download it again")

    def _check_types(self) -> None:
        unsupported = sorted({(t.qtype.name, name) for name, t in self._tensors.items()
                              if t.qtype.name not in SUPPORTED_TYPES})
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
        if key not in self._fields:
            return default
        return _plain(self._fields[key])

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is missing (is the file from a recent "
                                  "llama.cpp converter?)")
        return self.metadata(key)

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].qtype.name

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as float32, in PyTorch's (row-major, outermost first) shape."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        # dequantize reinterprets raw bytes by type (F32 and F16 by a view), so bytes serve every type.
        values = dequantize(np.frombuffer(self._map, np.uint8, t.n_bytes, t.offset), t.qtype)
        # A copy: an F32 tensor is a view of the read-only memory map.
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(t.shape))


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The opened file, shared by every caller while the file on disk is unchanged (parsing the
    header once per process is enough)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _open(str(path), stat.st_size, stat.st_mtime_ns)
