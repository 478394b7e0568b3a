"""Reader and writer for Kiln's `.engine` files (one file per tensor-parallel rank).

An engine file is a 64-byte header, a UTF-8 JSON manifest and two page-aligned
sections (weights, kernels), so the runtime can memory-map the weights instead of
copying them. The byte layout is documented in engines/README.md.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT_VERSION: int = 1
MAGIC: bytes = b"KILNENG\x00"

HEADER_SIZE = 64
SECTION_ALIGN = 4096  # page size: lets sections be mmapped
TENSOR_ALIGN = 256  # enough for any dtype and for vectorised/DMA loads
# magic, version, flags, manifest offset, manifest length, total length, manifest crc32
_HEADER = struct.Struct("<8sIIQQQI")
_SECTIONS = ("weights", "kernels")
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
    manifest: dict
    weights: dict[str, torch.Tensor]
    kernels: dict[str, bytes]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dump(manifest: dict) -> bytes:
    return json.dumps(manifest, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _check_little_endian() -> None:
    # Tensors are stored as raw host bytes; the format is defined as little-endian.
    if sys.byteorder != "little":
        raise EngineFileError("Kiln engine files are little-endian; big-endian hosts are not supported")


def write_engine_file(path: str | Path, manifest: dict, weights: dict[str, torch.Tensor],
                      kernels: dict[str, tuple[bytes, dict]] | None = None) -> None:
    """Atomically write an engine file: `path` holds either the old file or the complete new one."""
    _check_little_endian()
    path = Path(path)
    kernels = kernels or {}
    for key in ("rank", "world_size"):
        if not isinstance(manifest.get(key), int):
            raise ValueError(f"manifest[{key!r}] must be an int, got {manifest.get(key)!r}")

    # Lay out both sections from sizes alone, so the data can be streamed later.
    weight_index, off = {}, 0
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(t).__name__}, not a torch.Tensor")
        off = _align(off, TENSOR_ALIGN)
        weight_index[name] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                              "offset": off, "nbytes": t.nbytes}
        off += t.nbytes
    weights_len = off
    kernel_index, off = {}, 0
    for key, (blob, meta) in kernels.items():
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"kernel {key!r} blob is a {type(blob).__name__}, not bytes")
        if {"offset", "nbytes"} & set(meta):
            raise ValueError(f"kernel {key!r} metadata may not use the reserved keys 'offset'/'nbytes'")
        off = _align(off, TENSOR_ALIGN)
        kernel_index[key] = {"offset": off, "nbytes": len(blob), **meta}
        off += len(blob)
    kernels_len = off

    out = dict(manifest)  # shallow copy: only top-level keys are replaced
    out["weights"], out["kernels"] = weight_index, kernel_index
    sections = {"weights": {"offset": 0, "length": weights_len, "crc32": _PLACEHOLDER_CRC},
                "kernels": {"offset": 0, "length": kernels_len, "crc32": _PLACEHOLDER_CRC}}
    out["sections"] = sections
    # The manifest holds the section offsets, which depend on the manifest's length.
    # That length grows monotonically with the offsets, so iterating from 0 converges.
    weights_off = 0
    while True:
        sections["weights"]["offset"] = weights_off
        sections["kernels"]["offset"] = _align(weights_off + weights_len, SECTION_ALIGN)
        reserved = _dump(out)
        needed = _align(HEADER_SIZE + len(reserved), SECTION_ALIGN)
        if needed == weights_off:
            break
        weights_off = needed
    manifest_len = len(reserved)
    total_len = sections["kernels"]["offset"] + kernels_len

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.seek(weights_off)  # header and manifest are written last, once the crcs are known
            crc = 0
            for name, t in weights.items():
                crc = _pad_to(f, weights_off + weight_index[name]["offset"], crc)
                data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(memoryview(data))
                crc = zlib.crc32(data, crc)
            sections["weights"]["crc32"] = crc
            f.write(bytes(sections["kernels"]["offset"] - f.tell()))  # gap between sections
            kernels_off, crc = sections["kernels"]["offset"], 0
            for key, (blob, _meta) in kernels.items():
                crc = _pad_to(f, kernels_off + kernel_index[key]["offset"], crc)
                f.write(blob)
                crc = zlib.crc32(blob, crc)
            sections["kernels"]["crc32"] = crc
            if f.tell() != total_len:
                raise AssertionError(f"engine layout error: wrote {f.tell()} bytes, expected {total_len}")

            # Real crcs are never wider than the placeholder, so pad back to the reserved size.
            manifest_bytes = _dump(out).ljust(manifest_len, b" ")
            header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, HEADER_SIZE, manifest_len, total_len,
                                  zlib.crc32(manifest_bytes)).ljust(HEADER_SIZE, b"\0")
            f.seek(0)
            f.write(header + manifest_bytes)
            f.write(bytes(weights_off - f.tell()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _pad_to(f, target: int, crc: int) -> int:
    """Write zeros up to absolute offset `target`, folding them into the running crc."""
    gap = target - f.tell()
    if gap:
        zeros = bytes(gap)
        f.write(zeros)
        crc = zlib.crc32(zeros, crc)
    return crc


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform lets you open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        if version == 0 or version > FORMAT_VERSION:
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
        return _load(path, mm, m_off, m_len, m_crc, total, rank, world_size, verify, rebuild)
    except BaseException:
        try:
            mm.close()
        except BufferError:
            pass  # tensors already built keep it alive; it is freed with them
        raise


def _load(path: Path, mm: mmap.mmap, m_off: int, m_len: int, m_crc: int, total: int,
          rank: int | None, world_size: int | None, verify: bool, rebuild: str) -> EngineFile:
    raw = mm[m_off:m_off + m_len]
    if zlib.crc32(raw) != m_crc:
        raise ChecksumError(f"{path}: checksum mismatch in the manifest section "
                            f"(the file is corrupted); {rebuild}", "manifest")
    try:
        manifest = json.loads(raw.decode("utf-8"))
        sections = {name: manifest["sections"][name] for name in _SECTIONS}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CorruptEngineError(f"{path}: manifest is unreadable ({e}); {rebuild}") from None

    # Before the section checksums: no point hashing gigabytes of the wrong rank.
    f_rank, f_world = manifest.get("rank"), manifest.get("world_size")
    want_rank = f_rank if rank is None else rank
    want_world = f_world if world_size is None else world_size
    if (want_rank, want_world) != (f_rank, f_world):
        hint = (f"load rank{want_rank}.engine for each rank" if want_world == f_world else
                f"launch {f_world} ranks, or rebuild the engine for {want_world} ranks")
        raise RankMismatchError(f"{path}: engine file is rank {f_rank} of {f_world} but was loaded "
                                f"as rank {want_rank} of {want_world}: {hint}")

    view = memoryview(mm)
    try:
        for name, sec in sections.items():
            start, length = sec["offset"], sec["length"]
            if start % SECTION_ALIGN or start + length > total:
                raise CorruptEngineError(f"{path}: {name} section lies outside the file; {rebuild}")
            if verify and _crc_of(view[start:start + length]) != sec["crc32"]:
                raise ChecksumError(f"{path}: checksum mismatch in the {name} section "
                                    f"(the file is corrupted); {rebuild}", name)
    finally:
        view.release()

    w_off, w_len = sections["weights"]["offset"], sections["weights"]["length"]
    specs = []
    for name, e in manifest["weights"].items():
        dtype = getattr(torch, str(e["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptEngineError(f"{path}: weight {name!r} has unknown dtype {e['dtype']!r}")
        numel = 1
        for d in e["shape"]:
            numel *= d
        if numel * dtype.itemsize != e["nbytes"] or e["offset"] + e["nbytes"] > w_len:
            raise CorruptEngineError(f"{path}: weight {name!r} index entry is inconsistent; {rebuild}")
        specs.append((name, dtype, e["shape"], numel, w_off + e["offset"]))
    k_off, k_len = sections["kernels"]["offset"], sections["kernels"]["length"]
    kernels = {}
    for key, e in manifest["kernels"].items():
        if e["offset"] + e["nbytes"] > k_len:
            raise CorruptEngineError(f"{path}: kernel {key!r} lies outside its section; {rebuild}")
        kernels[key] = mm[k_off + e["offset"]:k_off + e["offset"] + e["nbytes"]]

    # ACCESS_COPY makes the mapping writable (so frombuffer does not warn) without
    # any write ever reaching the file. frombuffer rejects empty ranges, hence empty().
    weights = {name: (torch.frombuffer(mm, dtype=dtype, count=numel, offset=off).reshape(shape)
                      if numel else torch.empty(shape, dtype=dtype))
               for name, dtype, shape, numel, off in specs}
    return EngineFile(path=path, manifest=manifest, weights=weights, kernels=kernels)
