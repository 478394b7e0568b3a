"""What the sweep and probe scripts share: compiling one configuration without letting a configuration that
does not fit stop the sweep (tune_gemm, tune_prefill_gemm, tune_attention), and a kernel compiled for sm_90 with
what loading it through the driver takes (the decode GEMV probes)."""
from __future__ import annotations

from kiln.plugins.aot import AotKernel, Cubin, compile_cubin


def try_compile(kernel: AotKernel, target: str = "sm_90") -> Cubin | str:
    """The kernel's cubin, or why it did not compile (reported in the sweep, not fatal)."""
    try:
        return compile_cubin(kernel, target)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def kernel_entry(kernel) -> tuple:
    """(cubin, runtime parameter types, launch meta) of one kernel (an AotKernel or NvccKernel) compiled for sm_90."""
    return compile_cubin(kernel, "sm_90"), [t for t in kernel.signature.values() if t != "constexpr"], kernel.meta


def load(entry: tuple):
    """A `kernel_entry` loaded through the driver as the CUDA executor loads it, programmatic where its meta says,
    and its meta."""
    from kiln.runtime.cuda_driver import load_kernel, programmatic_launch

    cubin, params, meta = entry
    kernel = load_kernel(cubin.binary, cubin.name, params, cubin.num_warps, cubin.shared_bytes, cubin.global_scratch)
    kernel.programmatic = programmatic_launch(meta)
    return kernel, meta
