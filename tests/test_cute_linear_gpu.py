"""linear and linear_residual's CuTe GEMM bucket on an H200 (GPU only: `pytest -m gpu`): built by nvcc,
loaded and launched by the plugins' driver launchers as an engine does, for steps of 129 to 256 rows it
matches x W^T (+ bias) (+ residual) in fp32, for narrow weights of one wave of tiles and for one of more
tiles than SMs (the persistent loop), K from one to many K tiles, with the residual read from the output
buffer itself (as the engine sums in place), with x's rows past T read from its buffer (NaN there
stays out of the rows that count) or filled with zeros past the buffer, and it writes no row past T; at
the engine's tiling and with K in two parts (split-K, the last part adding the other's sums from linear's
workspace; with one K tile, one part has none)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from gpu_kernels import load_plugin_kernels
from kiln.plugins.linear import cute_gemm
from kiln.plugins.linear.launch import pick_bucket

pytestmark = pytest.mark.gpu

# (plugin, rows, N, K, bias, x in a longer buffer whose rows past T hold NaN, as an engine's buffers may
# hold anything there: the launcher's descriptor then covers whole 128-row tiles)
CASES = [("linear_residual", 129, 4096, 4096, False, True), ("linear_residual", 256, 4096, 14336, False, False),
         ("linear", 200, 6144, 4096, True, False), ("linear", 256, 1024, 64, True, False),
         ("linear_residual", 160, 2048, 512, True, True), ("linear_residual", 200, 4096, 4096, False, False)]


@pytest.mark.parametrize("tiling", [cute_gemm.LINEAR_TILING, (128, 128, 6, 8, 2)])
@pytest.mark.parametrize("plugin, rows, n, k, bias, padded", CASES)
def test_cute_bucket_matches_fp32(plugin, rows, n, k, bias, padded, tiling):
    attrs = {"parallel": "none", "heads": 0, "all_reduce": False}
    with mock.patch.object(cute_gemm, "LINEAR_TILING", tiling):
        launcher, fns, metas, scratch = load_plugin_kernels(plugin, {"K": k, "N": n, "bias": bias}, attrs, rows)
    assert metas[pick_bucket(metas, rows)].get("cute"), "an sm_90 build with nvcc should take the CuTe GEMM here"
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    if padded:
        x = torch.cat([x, torch.full((300, k), float("nan"), dtype=torch.bfloat16, device="cuda")])[:rows]
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).cuda()
    b = torch.randn(n, generator=gen).to(torch.bfloat16).cuda() if bias else None
    # Three rows past T that the kernel must leave alone: the output is a view of a longer buffer.
    buffer = torch.full((rows + 3, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buffer[:rows]
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    inputs = [x, w, b]
    if plugin == "linear_residual":
        out.copy_(torch.randn(rows, n, generator=gen).to(torch.bfloat16))
        ref += out.float()
        inputs.append(out)   # summed in place
    launcher.launch(fns, metas, inputs, attrs, out, {"T": rows}, torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"
    assert torch.isnan(buffer[rows:]).all(), "rows past T were written"
