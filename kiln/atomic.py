"""Writing a file or a folder so that readers see the old one or the complete new one, never a
half-written one: everything is staged beside the target and renamed over it at the end.

Staging copies are named `.<name>.tmp-<pid>-<random>`, so concurrent writers never share one;
a failed write deletes its staging copy and leaves the target as it was.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """Yields a binary file open for writing; on a clean exit it is flushed, fsynced and renamed
    to `path` (replacing what was there), and the rename itself is made durable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _staging(path)
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yields an empty staging folder beside `path`; on a clean exit it replaces `path` (a
    folder there is removed first). The caller checks beforehand that replacing is allowed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging(path)
    staging.mkdir()
    try:
        yield staging
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def _staging(path: Path) -> Path:
    # Made with the process's usual permissions (not tempfile's owner-only ones), as the target would be.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


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
