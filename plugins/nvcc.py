"""CUDA C++ kernels compiled ahead of time with nvcc, beside the Triton ones (`plugins.aot`).

A plugin describes such a kernel as an `NvccKernel`: a .cu file, the macro call that defines its
`extern "C"` entry point (appended to the file, so one file serves many entries), and its
parameters in the Triton spelling the runtime's launch packs (`runtime.cuda_driver`).
`compile_cubin` runs nvcc for one target, which needs no GPU; the cubin goes into the engine and
loads and launches like a Triton one. nvcc comes from KILN_NVCC, the PATH or /usr/local/cuda; a
build without one (or with KILN_NVCC set empty) leaves these kernels out (`builder.kernels`; the
build's summary says so) and the Triton kernels serve their shapes.

A kernel written on CUTLASS's CuTe headers (wgmma, TMA, `setmaxnreg`) names `cutlass_include()` in
its `includes` and is `arch_specific`: it compiles for sm_90a, which runs on Hopper alone.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from kiln.plugins.aot import TARGET_CC, Cubin

FLAGS = ("-O3", "-std=c++17")


@dataclass(frozen=True)
class NvccKernel:
    source: Path                     # the .cu file
    entry: str                       # the extern "C" kernel `instance` defines
    instance: str                    # the macro call, appended to the source, that defines `entry`
    signature: dict[str, str]        # every parameter in order: "*bf16", "*i32", "i32", "fp32", ...
    num_warps: int
    meta: dict[str, Any] = field(default_factory=dict)
    targets: tuple[str, ...] | None = None   # None: every GPU target
    shared_bytes: int = 0            # dynamic shared memory each launch passes
    includes: tuple[str, ...] = ()   # folders nvcc searches for headers (`cutlass_include`)
    arch_specific: bool = False      # built for sm_90a, not sm_90: Hopper's own instructions

    def options(self, target: str) -> list[str]:
        """nvcc's options for `target` (e.g. "sm_90"), the -arch first."""
        arch = f"{target}a" if self.arch_specific else target
        return [f"-arch={arch}", *FLAGS, *(f"-I{folder}" for folder in self.includes)]


def cutlass_include() -> str:
    """The folder holding CUTLASS's `cute/` and `cutlass/` headers, from the `nvidia-cutlass`
    package (`make install` puts it in the venv)."""
    spec = importlib.util.find_spec("cutlass_library")
    folder = Path(spec.origin).parent / "source" / "include" if spec and spec.origin else None
    if folder is None or not (folder / "cute").is_dir():
        raise RuntimeError("CUTLASS's headers are not installed: pip install --no-deps nvidia-cutlass==4.2.0.0")
    return str(folder)


@cache
def cutlass_available() -> bool:
    """Whether CUTLASS's headers are installed (`cutlass_include` finds them); asked once per process."""
    try:
        cutlass_include()
    except RuntimeError:
        return False
    return True


def nvcc_path() -> str | None:
    """The nvcc this build uses, or None when there is none. KILN_NVCC names it; set empty, it
    says to build without (the Triton kernels alone)."""
    given = os.environ.get("KILN_NVCC")
    if given is not None:
        return given or None
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)


@cache
def nvcc_version() -> str:
    """nvcc's own version line (part of every NvccKernel's cache key)."""
    out = subprocess.run([_nvcc(), "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def _nvcc() -> str:
    path = nvcc_path()
    if path is None:
        raise RuntimeError("nvcc not found: install the CUDA toolkit, or set KILN_NVCC to its nvcc")
    return path


def source_text(kernel: NvccKernel) -> str:
    """What nvcc compiles for `kernel`: its file with its instance appended."""
    return Path(kernel.source).read_text() + f"\n{kernel.instance}\n"


def compile_cubin(kernel: NvccKernel, target: str) -> Cubin:
    """`kernel` compiled by nvcc for `target` (e.g. "sm_90")."""
    if target not in TARGET_CC:
        raise ValueError(f"no GPU target {target!r}; choose one of {', '.join(TARGET_CC)}")
    with tempfile.TemporaryDirectory(prefix="kiln-nvcc-") as tmp:
        src, out = Path(tmp) / f"{kernel.entry}.cu", Path(tmp) / f"{kernel.entry}.cubin"
        src.write_text(source_text(kernel))
        result = subprocess.run([_nvcc(), "-cubin", *kernel.options(target), "-o", str(out), str(src)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc could not compile {kernel.entry} from {kernel.source} for {target}:\n"
                               f"{result.stderr.strip()}")
        return Cubin(kernel.entry, out.read_bytes(), kernel.shared_bytes, kernel.num_warps)
