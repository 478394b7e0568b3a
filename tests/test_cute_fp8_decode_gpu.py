"""linear and linear_residual's e4m3 CuTe decode bucket in an FP8 engine on an H200 (GPU only: `pytest -m
gpu`): built by nvcc, loaded and launched by the plugins' driver launchers as an engine does (the quantize
pre-pass first), for steps of 17 to 64 rows it matches the plugin's W8A8 reference, for o_proj's and down's
shapes and a small one, the residual summed in place from the output buffer, and it writes no row past T;
run twice, it gives the same result (the K parts' arrival counts are left at zero for the next launch)."""
from __future__ import annotations

import pytest
import torch

from gpu_kernels import load_plugin_kernels
from kiln.plugins import get_plugin
from kiln.plugins.fp8 import quantize_rows
from kiln.plugins.linear.launch import pick_bucket

pytestmark = pytest.mark.gpu

# (plugin, rows, N, K)
CASES = [("linear_residual", 17, 4096, 4096), ("linear_residual", 64, 4096, 14336), ("linear", 40, 4096, 14336),
         ("linear_residual", 64, 1024, 512)]


@pytest.mark.parametrize("plugin, rows, n, k", CASES)
def test_cute_fp8_decode_bucket_matches_the_w8a8_reference(plugin, rows, n, k):
    attrs = {"parallel": "none", "heads": 0, "all_reduce": False}
    launcher, fns, metas, scratch = load_plugin_kernels(plugin, {"K": k, "N": n, "fp8": True}, attrs, rows)
    assert metas[pick_bucket(metas, rows)].get("cute_decode"), "an FP8 sm_90 build with nvcc should take it here"
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    w, w_scale = quantize_rows((torch.randn(n, k, generator=gen) / k ** 0.5).cuda())
    buffer = torch.full((rows + 3, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buffer[:rows]
    if plugin == "linear_residual":
        out.copy_(torch.randn(rows, n, generator=gen).to(torch.bfloat16))
        inputs = [x, w, None, out, w_scale]   # summed in place
    else:
        inputs = [x, w, None, w_scale]
    ref = get_plugin(plugin).call_reference([t.clone() if t is out else t for t in inputs], attrs).float()
    for _ in range(2):
        if plugin == "linear_residual":
            residual = out.clone()
        launcher.launch(fns, metas, inputs, attrs, out, {"T": rows}, torch.cuda.current_stream().cuda_stream,
                        scratch)
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"relative error {err:.2e}"
        assert torch.isnan(buffer[rows:]).all(), "rows past T were written"
        if plugin == "linear_residual":
            out.copy_(residual)
