"""Cubins compiled here without a GPU load and run through the driver API, also inside a CUDA
graph (GPU only: `pytest -m gpu`)."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kiln.plugins.aot import AotKernel, compile_cubin  # noqa: E402

pytestmark = pytest.mark.gpu


@triton.jit
def _axpy(x, y, out, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, a * tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)


def _kernel():
    from kiln.runtime.cuda_driver import device_arch, load_kernel
    sig = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "a": "fp32", "n": "i32", "BLOCK": "constexpr"}
    cubin = compile_cubin(AotKernel(_axpy, sig, {"BLOCK": 256}), device_arch())
    return load_kernel(cubin.binary, cubin.name, ["*fp32", "*fp32", "*fp32", "fp32", "i32"], cubin.num_warps,
                       cubin.shared_bytes)


def test_aot_cubin_runs_through_the_driver_api():
    kernel = _kernel()
    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    kernel.launch((4, 1, 1), [x.data_ptr(), y.data_ptr(), out.data_ptr(), 2.5, 1000], stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2.5 * x + y)


def test_driver_launch_is_captured_by_a_cuda_graph():
    kernel = _kernel()
    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    out = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            kernel.launch((4, 1, 1), [x.data_ptr(), y.data_ptr(), out.data_ptr(), -1.0, 1000], side.cuda_stream)
    x.copy_(torch.arange(1000.0, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, y - x)


def test_persistent_tma_gemm_gets_its_global_scratch():
    """The TMA GEMM makes its descriptors on the device, in global scratch the launcher passes:
    loaded as the executor loads it, on a persistent grid of fewer programs than tiles, inside
    a CUDA graph too, it matches torch; a grid beyond its scratch is refused."""
    from kiln.plugins.linear.tma import tma_linear_aot
    from kiln.runtime.cuda_driver import device_arch, load_kernel
    if device_arch() not in ("sm_90", "sm_100"):
        pytest.skip("TMA kernels are built for sm_90 and sm_100")
    kernel = tma_linear_aot("bfloat16", 768, 512, bias=False, residual=True, bucket="prefill", max_rows=None)
    cubin = compile_cubin(kernel, device_arch())
    assert cubin.global_scratch > 0
    fn = load_kernel(cubin.binary, cubin.name, [t for t in kernel.signature.values() if t != "constexpr"],
                     cubin.num_warps, cubin.shared_bytes, cubin.global_scratch)
    scratch = torch.empty(4 * cubin.global_scratch, dtype=torch.uint8, device="cuda")
    fn.scratch = (scratch.data_ptr(), 4)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16) / 16
    r = torch.randn(300, 768, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(r, float("nan"))
    args = [x.data_ptr(), w.data_ptr(), r.data_ptr(), out.data_ptr(), 300]
    stream = torch.cuda.current_stream().cuda_stream
    fn.launch((4, 1, 1), args, stream)
    ref = (x.float() @ w.float().T + r.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=5e-2)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn.launch((4, 1, 1), args, torch.cuda.current_stream().cuda_stream)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=5e-2)
    with pytest.raises(ValueError, match="global scratch"):
        fn.launch((5, 1, 1), args, stream)
