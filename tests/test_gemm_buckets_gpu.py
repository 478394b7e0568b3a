"""The GEMM buckets above the decode ones on the GPU: kernels compiled for this GPU and launched by
their plugin's driver launcher match the plugin's reference at a row count of each bucket (GPU
only: `pytest -m gpu`). The test models' weights are too small for some of these tiles (gate/up's
wide buckets), and their steps never reach others (65 to 256 rows), so the engine tests miss them.
- norm_swiglu on a wide W_gu (`linear.tiles.WIDE_TILES`): 128-row TMA tiles up to 128 rows,
  64-row ones from 129 to 192, the prefill bucket's 128-row tiles beyond;
- linear_residual on a narrow weight (`linear.tiles.TILES`): 64x128 tiles with K split in 4 up to
  128 rows, 128x128 tiles split in 2 to 256, the TMA GEMM's 64-row tiles to 512 and its 128-row
  ones beyond."""
from __future__ import annotations

import pytest
import torch

from gpu_kernels import load_plugin_kernels
from kiln.builder.passes.fold import interleave
from kiln.plugins import get_plugin

pytestmark = pytest.mark.gpu

MAX_ROWS = 640
BLOCK = 64
# plugin -> (compile shapes, attrs); W_gu of 12,288 rows is wide (`linear.tiles.WIDE_N`).
CASES = {"norm_swiglu": ({"K": 256, "I": 6144, "block": BLOCK}, {"eps": 1e-5, "block": BLOCK, "activation": "silu"}),
         "linear_residual": ({"K": 1024, "N": 512}, {"parallel": "none", "heads": 0, "all_reduce": False})}


@pytest.fixture(scope="module")
def loaded():
    """loaded(plugin): `gpu_kernels.load_plugin_kernels` for the plugin's case, once per plugin."""
    cache = {}

    def get(plugin: str):
        if plugin not in cache:
            cache[plugin] = load_plugin_kernels(plugin, *CASES[plugin], MAX_ROWS)
        return cache[plugin]
    return get


def inputs_for(plugin: str, rows: int, g: torch.Generator) -> list[torch.Tensor | None]:
    shapes, _ = CASES[plugin]
    k = shapes["K"]
    if plugin == "norm_swiglu":
        return [torch.randn(rows, k, generator=g) * 3, None,
                interleave(torch.randn(2 * shapes["I"], k, generator=g) / 16, BLOCK)]
    n = shapes["N"]
    return [torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / 32, None,
            torch.randn(rows, n, generator=g)]


@pytest.mark.parametrize("plugin,rows", [("norm_swiglu", 100), ("norm_swiglu", 130), ("norm_swiglu", 192),
                                         ("norm_swiglu", 300), ("linear_residual", 100),
                                         ("linear_residual", 200), ("linear_residual", 300),
                                         ("linear_residual", 600)])
def test_bucket_matches_the_reference(loaded, plugin, rows):
    launcher, fns, metas, scratch = loaded(plugin)
    attrs = CASES[plugin][1]
    inputs = inputs_for(plugin, rows, torch.Generator().manual_seed(rows))
    on_gpu = [t.to("cuda", torch.bfloat16) if t is not None else None for t in inputs]
    want = get_plugin(plugin).call_reference([t.float().cpu() if t is not None else None for t in on_gpu], attrs)
    out = torch.full(tuple(want.shape), float("nan"), dtype=torch.bfloat16, device="cuda")
    launcher.launch(fns, metas, on_gpu, attrs, out, {"T": rows}, torch.cuda.current_stream().cuda_stream, scratch)
    torch.cuda.synchronize()
    got = out.float().cpu()
    assert torch.isfinite(got).all()
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2
