"""What the sweep scripts (tune_gemm, tune_prefill_gemm, tune_attention) share: compiling one
configuration without letting a configuration that does not fit stop the sweep."""
from __future__ import annotations

from kiln.plugins.aot import AotKernel, Cubin, compile_cubin


def try_compile(kernel: AotKernel, target: str = "sm_90") -> Cubin | str:
    """The kernel's cubin, or why it did not compile (reported in the sweep, not fatal)."""
    try:
        return compile_cubin(kernel, target)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
