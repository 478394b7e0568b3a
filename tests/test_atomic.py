"""kiln.atomic: a file or folder is the old one or the complete new one, never half of either."""
from __future__ import annotations

import os

import pytest

from kiln.atomic import atomic_file, atomic_folder, write_bytes


def test_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "out.bin"
    write_bytes(path, b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as f:
            f.write(b"half of the new")
            raise RuntimeError("the writer fails")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]


def test_folder_is_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "engine"
    with atomic_folder(target) as staging:
        (staging / "a").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(target) as staging:
            (staging / "b").write_text("new")
            raise RuntimeError("the build fails")
    assert sorted(p.name for p in target.iterdir()) == ["a"] and os.listdir(tmp_path) == ["engine"]
    with atomic_folder(target) as staging:
        (staging / "b").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["b"] and os.listdir(tmp_path) == ["engine"]


def test_permissions_are_those_of_a_plain_write(tmp_path):
    (tmp_path / "plain").write_bytes(b"x")
    (tmp_path / "plain_dir").mkdir()
    write_bytes(tmp_path / "atomic", b"x")
    with atomic_folder(tmp_path / "atomic_dir"):
        pass
    assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode
    assert (tmp_path / "atomic_dir").stat().st_mode == (tmp_path / "plain_dir").stat().st_mode
