"""The wide weights' GEMM buckets (gate/up, `linear.tiles.WIDE_TILES`) on the GPU: norm_swiglu's
kernels, compiled for this GPU and launched by its driver launcher, match the plugin's reference
at a row count of each bucket above the decode ones: 128-row TMA tiles up to 128 rows, 64-row
ones from 129 to 192, the prefill bucket's 128-row tiles beyond (GPU only: `pytest -m gpu`).
The test models' MLPs are too narrow for these buckets, so the engine tests never reach them."""
from __future__ import annotations

import pytest
import torch

from kiln.builder.passes.fold import interleave
from kiln.plugins import get_plugin
from kiln.plugins.aot import compile_cubin
from kiln.plugins.norm_swiglu import kernels, launch
from kiln.runtime.cuda_executor import kernel_scratch

pytestmark = pytest.mark.gpu

K, INTER, BLOCK = 256, 6144, 64   # W_gu has 12,288 rows: wide (`linear.tiles.WIDE_N`)
MAX_ROWS = 320
ATTRS = {"eps": 1e-5, "block": BLOCK, "activation": "silu"}


@pytest.fixture(scope="module")
def loaded() -> tuple[list, list[dict], dict[str, torch.Tensor]]:
    """(this GPU's loaded kernels, their metas, the scratch buffers the launcher takes)."""
    from kiln.plugins.driver_launch import sm_count
    from kiln.runtime.cuda_driver import device_arch, load_kernel

    arch = device_arch()
    aot = [k for k in kernels.aot_kernels("bfloat16", {"K": K, "I": INTER, "block": BLOCK})
           if k.targets is None or arch in k.targets]
    limits = {"T": MAX_ROWS, "S": 1, "B": 1, "block_size": 16, "element_bytes": 2}
    needs = [launch.scratch_bytes(ATTRS, limits)] + [kernel_scratch(k.meta, limits) for k in aot]
    # Zeroed, as the CUDA executor's arena is: the split-K arrival counts start at zero.
    scratch = {name: torch.zeros(max(need.get(name, 0) for need in needs), dtype=torch.uint8, device="cuda")
               for name in {name for need in needs for name in need}}
    cubins = [compile_cubin(k, arch) for k in aot]
    scratch["global"] = torch.zeros(sm_count() * max(c.global_scratch for c in cubins), dtype=torch.uint8,
                                    device="cuda")
    fns = []
    for k, cubin in zip(aot, cubins):
        fn = load_kernel(cubin.binary, cubin.name, [t for t in k.signature.values() if t != "constexpr"],
                         cubin.num_warps, cubin.shared_bytes, cubin.global_scratch)
        if cubin.global_scratch:
            fn.scratch = (scratch["global"].data_ptr(), scratch["global"].numel() // cubin.global_scratch)
        fns.append(fn)
    return fns, [k.meta for k in aot], scratch


@pytest.mark.parametrize("rows", [100, 130, 192, 300])
def test_wide_norm_swiglu_buckets_match_the_reference(loaded, rows):
    fns, metas, scratch = loaded
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=g) * 3
    w_gu = interleave(torch.randn(2 * INTER, K, generator=g) / 16, BLOCK)
    inputs = [x.to("cuda", torch.bfloat16), None, w_gu.to("cuda", torch.bfloat16)]
    out = torch.full((rows, INTER), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch.launch(fns, metas, inputs, ATTRS, out, {"T": rows}, torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    want = get_plugin("norm_swiglu").call_reference([t.float().cpu() if t is not None else None for t in inputs],
                                                    ATTRS)
    got = out.float().cpu()
    assert torch.isfinite(got).all()
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2
