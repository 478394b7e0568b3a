"""Reader and writer for Kiln's `.engine` files (one file per tensor-parallel rank).

An engine file is a 64-byte header, a UTF-8 JSON manifest (`engines.manifest.Manifest`) and
two page-aligned sections (weights, kernels), so the runtime can memory-map the weights
instead of copying them. The byte layout is documented in engines/README.md.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.atomic import atomic_file
from kiln.dtypes import dtype_name, torch_dtype
from kiln.engines.manifest import KernelEntry, Manifest, Section, WeightEntry

# 2: the typed manifest (limits stored once, no memory_plan.bounds, no duplicate build keys).
# 3: `quantization` and the FP8 scale inputs of the GEMM ops, which a Kiln that reads only 2
#    would run as plain projections; version 2 files still load (as quantization "none").
# 4: every FP8 GEMM reads the rows of its quantize pre-pass. Version 3's FP8 decode kernels
#    quantized x themselves and take other arguments, so a version 3 FP8 engine is refused;
#    version 3 files without FP8 weights still load.
FORMAT_VERSION: int = 4
READS_VERSIONS: tuple[int, ...] = (2, 3, 4)
MAGIC: bytes = b"KILNENG\x00"

HEADER_SIZE = 64
SECTION_ALIGN = 4096  # page size: lets sections be mmapped
TENSOR_ALIGN = 256  # enough for any dtype and for vectorised/DMA loads
# magic, version, flags, manifest offset, manifest length, total length, manifest crc32
_HEADER = struct.Struct("<8sIIQQQI")
_PLACEHOLDER_CRC = 0xFFFFFFFF  # widest crc32 in JSON, so the reserved manifest size always fits
_CRC_CHUNK = 64 << 20


class EngineFileError(Exception):
    """Base class for every problem found while loading an engine file."""


class BadMagicError(EngineFileError):
    pass


class UnsupportedVersionError(EngineFileError):
    pass


class TruncatedEngineError(EngineFileError):
    pass


class ChecksumError(EngineFileError):
    def __init__(self, message: str, section: str) -> None:
        super().__init__(message)
        self.section = section


class RankMismatchError(EngineFileError):
    pass


class CorruptEngineError(EngineFileError):
    """The checksums pass but the contents are inconsistent (a writer bug or a hand-edited file)."""


@dataclass
class EngineFile:
    """A loaded engine file.

    `weights` are views over a private copy-on-write mmap of the file: writes never
    reach the file, but treat them as read-only and `.clone()` before modifying.
    """

    path: Path
    manifest: Manifest
    weights: dict[str, torch.Tensor]
    kernels: dict[str, bytes]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dump(manifest: Manifest) -> bytes:
    return json.dumps(manifest.to_json(), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _check_little_endian() -> None:
    # Tensors are stored as raw host bytes; the format is defined as little-endian.
    if sys.byteorder != "little":
        raise EngineFileError("Kiln engine files are little-endian; big-endian hosts are not supported")


def write_engine_file(path: str | Path, manifest: Manifest, weights: dict[str, torch.Tensor],
                      kernels: dict[str, tuple[bytes, dict]] | None = None) -> None:
    """Atomically write an engine file: `path` holds either the old file or the complete new one.

    `kernels` maps a key to its blob and its launch metadata (the fields of `KernelEntry` other
    than `offset` and `nbytes`). The manifest's weight and kernel indexes and sections are
    replaced by the ones of the data written."""
    _check_little_endian()
    kernels = kernels or {}

    # Lay out both sections from sizes alone, so the data can be streamed later.
    weight_index, off = {}, 0
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(t).__name__}, not a torch.Tensor")
        off = _align(off, TENSOR_ALIGN)
        weight_index[name] = WeightEntry(dtype_name(t.dtype), tuple(t.shape), off, t.nbytes)
        off += t.nbytes
    weights_len = off
    kernel_index, off = {}, 0
    for key, (blob, meta) in kernels.items():
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"kernel {key!r} blob is a {type(blob).__name__}, not bytes")
        if {"offset", "nbytes"} & set(meta):
            raise ValueError(f"kernel {key!r} metadata may not use the reserved keys 'offset'/'nbytes'")
        off = _align(off, TENSOR_ALIGN)
        kernel_index[key] = KernelEntry(offset=off, nbytes=len(blob),
                                        **{**meta, "signature": tuple(meta["signature"])})
        off += len(blob)
    kernels_len = off

    def settled(weights_off: int, crcs: tuple[int, int]) -> Manifest:
        kernels_off = _align(weights_off + weights_len, SECTION_ALIGN)
        return dataclasses.replace(manifest, weights=weight_index, kernels=kernel_index, sections={
            "weights": Section(weights_off, weights_len, crcs[0]), "kernels": Section(kernels_off, kernels_len, crcs[1])})

    # The manifest holds the section offsets, which depend on the manifest's length.
    # That length grows monotonically with the offsets, so iterating from 0 converges.
    placeholder = (_PLACEHOLDER_CRC, _PLACEHOLDER_CRC)
    weights_off = 0
    while True:
        reserved = _dump(settled(weights_off, placeholder))
        needed = _align(HEADER_SIZE + len(reserved), SECTION_ALIGN)
        if needed == weights_off:
            break
        weights_off = needed
    manifest_len = len(reserved)
    kernels_off = settled(weights_off, placeholder).sections["kernels"].offset
    total_len = kernels_off + kernels_len

    with atomic_file(path) as f:
        f.seek(weights_off)  # header and manifest are written last, once the crcs are known
        weights_crc = 0
        for name, t in weights.items():
            weights_crc = _pad_to(f, weights_off + weight_index[name].offset, weights_crc)
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
            weights_crc = zlib.crc32(data, weights_crc)
        f.write(bytes(kernels_off - f.tell()))  # gap between sections
        kernels_crc = 0
        for key, (blob, _meta) in kernels.items():
            kernels_crc = _pad_to(f, kernels_off + kernel_index[key].offset, kernels_crc)
            f.write(blob)
            kernels_crc = zlib.crc32(blob, kernels_crc)
        if f.tell() != total_len:
            raise AssertionError(f"engine layout error: wrote {f.tell()} bytes, expected {total_len}")

        # Real crcs are never wider than the placeholder, so pad back to the reserved size.
        manifest_bytes = _dump(settled(weights_off, (weights_crc, kernels_crc))).ljust(manifest_len, b" ")
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, HEADER_SIZE, manifest_len, total_len,
                              zlib.crc32(manifest_bytes)).ljust(HEADER_SIZE, b"\0")
        f.seek(0)
        f.write(header + manifest_bytes)
        f.write(bytes(weights_off - f.tell()))


def _pad_to(f, target: int, crc: int) -> int:
    """Write zeros up to absolute offset `target`, folding them into the running crc."""
    gap = target - f.tell()
    if gap:
        zeros = bytes(gap)
        f.write(zeros)
        crc = zlib.crc32(zeros, crc)
    return crc


def _crc_of(buf: memoryview) -> int:
    crc = 0
    for start in range(0, len(buf), _CRC_CHUNK):
        crc = zlib.crc32(buf[start:start + _CRC_CHUNK], crc)
    return crc


def read_engine_file(path: str | Path, rank: int | None = None, world_size: int | None = None,
                     verify: bool = True) -> EngineFile:
    """Load an engine file, checking it in an order that gives each kind of damage its own error."""
    _check_little_endian()
    path = Path(path)
    rebuild = "rebuild it with build-engine or copy it again"
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
        size = os.fstat(f.fileno()).st_size
        if head[:len(MAGIC)] != MAGIC[:len(head)]:
            raise BadMagicError(f"not a Kiln engine file (bad magic): {path}")
        if len(head) < HEADER_SIZE:
            raise TruncatedEngineError(
                f"{path}: engine file is truncated: only {size} bytes, shorter than the "
                f"{HEADER_SIZE}-byte header; {rebuild}")
        _magic, version, _flags, m_off, m_len, total, m_crc = _HEADER.unpack_from(head)
        if 0 < version < min(READS_VERSIONS):
            raise UnsupportedVersionError(
                f"{path}: engine file format version {version} was written by an older Kiln; this Kiln "
                f"reads version {FORMAT_VERSION}: rebuild the engine with this Kiln's build-engine")
        if version not in READS_VERSIONS:
            raise UnsupportedVersionError(
                f"{path}: engine file format version {version} is not supported by this Kiln "
                f"(supports version {FORMAT_VERSION}); rebuild the engine with this Kiln or upgrade Kiln")
        if size < total:
            raise TruncatedEngineError(
                f"{path}: engine file is truncated: header says {total} bytes but the file has "
                f"{size} bytes; {rebuild}")
        if m_off < HEADER_SIZE or m_off + m_len > total:
            raise CorruptEngineError(f"{path}: header points the manifest outside the file; {rebuild}")
        mm = mmap.mmap(f.fileno(), total, access=mmap.ACCESS_COPY)
    try:
        return _load(path, mm, version, m_off, m_len, m_crc, total, rank, world_size, verify, rebuild)
    except BaseException:
        try:
            mm.close()
        except BufferError:
            pass  # tensors already built keep it alive; it is freed with them
        raise


def _load(path: Path, mm: mmap.mmap, version: int, m_off: int, m_len: int, m_crc: int, total: int,
          rank: int | None, world_size: int | None, verify: bool, rebuild: str) -> EngineFile:
    raw = mm[m_off:m_off + m_len]
    if zlib.crc32(raw) != m_crc:
        raise ChecksumError(f"{path}: checksum mismatch in the manifest section "
                            f"(the file is corrupted); {rebuild}", "manifest")
    try:
        manifest = Manifest.from_json(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as e:  # ManifestError is a ValueError
        raise CorruptEngineError(f"{path}: manifest is unreadable ({e}); {rebuild}") from None
    if version == 3 and manifest.quantization != "none":
        raise UnsupportedVersionError(
            f"{path}: this {manifest.quantization} engine (format version 3) holds FP8 decode kernels of an "
            f"older Kiln, which this one cannot launch: rebuild the engine with this Kiln's build-engine")

    # Before the section checksums: no point hashing gigabytes of the wrong rank.
    f_rank, f_world = manifest.rank, manifest.world_size
    want_rank = f_rank if rank is None else rank
    want_world = f_world if world_size is None else world_size
    if (want_rank, want_world) != (f_rank, f_world):
        hint = (f"load {Manifest.rank_file(want_rank)} for each rank" if want_world == f_world else
                f"launch {f_world} ranks, or rebuild the engine for {want_world} ranks")
        raise RankMismatchError(f"{path}: engine file is rank {f_rank} of {f_world} but was loaded "
                                f"as rank {want_rank} of {want_world}: {hint}")

    view = memoryview(mm)
    try:
        for name, sec in manifest.sections.items():
            start, length = sec.offset, sec.length
            if start % SECTION_ALIGN or start + length > total:
                raise CorruptEngineError(f"{path}: {name} section lies outside the file; {rebuild}")
            if verify and _crc_of(view[start:start + length]) != sec.crc32:
                raise ChecksumError(f"{path}: checksum mismatch in the {name} section "
                                    f"(the file is corrupted); {rebuild}", name)
    finally:
        view.release()

    w_off, w_len = manifest.sections["weights"].offset, manifest.sections["weights"].length
    specs = []
    for name, e in manifest.weights.items():
        dtype = torch_dtype(e.dtype)  # a known name: Manifest.from_json checked it
        numel = 1
        for d in e.shape:
            numel *= d
        if numel * dtype.itemsize != e.nbytes or e.offset + e.nbytes > w_len:
            raise CorruptEngineError(f"{path}: weight {name!r} index entry is inconsistent; {rebuild}")
        specs.append((name, dtype, e.shape, numel, w_off + e.offset))
    k_off, k_len = manifest.sections["kernels"].offset, manifest.sections["kernels"].length
    kernels = {}
    for key, e in manifest.kernels.items():
        if e.offset + e.nbytes > k_len:
            raise CorruptEngineError(f"{path}: kernel {key!r} lies outside its section; {rebuild}")
        kernels[key] = mm[k_off + e.offset:k_off + e.offset + e.nbytes]

    # ACCESS_COPY makes the mapping writable (so frombuffer does not warn) without
    # any write ever reaching the file. frombuffer rejects empty ranges, hence empty().
    weights = {name: (torch.frombuffer(mm, dtype=dtype, count=numel, offset=off).reshape(shape)
                      if numel else torch.empty(shape, dtype=dtype))
               for name, dtype, shape, numel, off in specs}
    return EngineFile(path=path, manifest=manifest, weights=weights, kernels=kernels)
