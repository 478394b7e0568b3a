"""Kiln: an ahead-of-time LLM engine compiler and its runtime, under one import namespace.

`from kiln import Session, SamplingParams` is the public API. The subpackages (`kiln.models`,
`kiln.builder`, `kiln.plugins`, `kiln.runtime`, `kiln.engines`, `kiln.bench`) live in the
repository's top-level folders; an install maps them under `kiln`, and a source checkout run
with `PYTHONPATH=.` finds them through this package's search path below.
"""
from __future__ import annotations

import os as _os

# Kiln's CPU steps are thousands of small torch ops, each an OpenMP parallel region. Between regions
# libgomp's threads spin-wait, unless the process has more OpenMP threads than cores: whether a
# Session's engine loop spins therefore depended on other threads' pools, and one made on a thread
# that then exited (its pool gone) spun, and under CPU contention ran its steps 15-50x slower.
# Passive waiting makes the loop's speed its own. libgomp reads this once, when torch loads it:
# it takes effect when kiln is imported before torch, and an explicit setting is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
# In a source checkout the subpackages sit beside this folder, not inside it. An installed copy
# holds them inside, and the folder above it (site-packages) must never be searched.
if not _os.path.isdir(_os.path.join(_here, "runtime")) and _os.path.isfile(_os.path.join(_root, "pyproject.toml")):
    __path__.append(_root)  # noqa: F821  (a package's __path__ is defined by the import system)

__all__ = ["Session", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Lazy, so `import kiln.plugins` (the builder's side) does not load the runtime.
    if name == "Session":
        from kiln.runtime.session import Session
        return Session
    if name == "SamplingParams":
        from kiln.runtime.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from kiln.runtime import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
