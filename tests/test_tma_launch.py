"""The sm_90 launchers drive the kernels only sm_90 and later get: each GEMM plugin's
`launch.py`, given its sm_90 kernels from `aot_kernels` and a step in the prefill bucket,
launches the persistent TMA kernels (the row-scale pre-pass, then the GEMM on a grid of
min(tiles, SMS) programs), and attention's its 128-row prefill kernel, with arguments that
make them compute the plugin's reference.

The driver call needs a GPU, so each loaded kernel is a stand-in that runs the AOT kernel's
own Triton function in the interpreter (`interpreted_launch`). Where `test_launch_args.py`
compares launchers with `kernels.run` (whose JIT launches take the pointer-load tiles), this
runs what sm_90 runs.
"""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from interpreted_launch import Running, interpreted_only, targeted  # noqa: E402
from kiln.builder.passes.fold import interleave  # noqa: E402
from kiln.plugins.linear import tiles as linear_tiles  # noqa: E402
from kiln.plugins import get_plugin  # noqa: E402
from kiln.runtime.cuda_executor import op_scratch  # noqa: E402

GEMM_PLUGINS = ("linear", "linear_residual", "norm_swiglu", "norm_qkv_rope", "attention")
KERNELS = {name: importlib.import_module(f"kiln.plugins.{name}.kernels") for name in GEMM_PLUGINS}
LAUNCHERS = {name: importlib.import_module(f"kiln.plugins.{name}.launch") for name in GEMM_PLUGINS}

pytestmark = interpreted_only()
SMS = 3          # fewer programs than tiles: each program walks several
T = 300          # the prefill bucket (more than 256 rows), not a multiple of the 128-row tile
EPS = 1e-5


def launch(plugin: str, shapes: dict, inputs: list, attrs: dict, out: torch.Tensor,
           views: list[torch.Tensor] = (), rows: int = T, sms: int = SMS,
           dims: dict[str, int] | None = None) -> list[tuple[str, tuple]]:
    """Run the plugin's sm_90 launcher on a step of `rows` rows, on a GPU of `sms` SMs; returns its
    launches in order. `views`: tensors whose addresses the launcher passes besides its inputs';
    `dims`: the step's, as the executor gives them (default: T only)."""
    launcher = LAUNCHERS[plugin]
    kernels = targeted(KERNELS[plugin].aot_kernels("float32", shapes), "sm_90")
    limits = {"T": rows, "S": 8, "B": 64, "block_size": 16, "element_bytes": 4}
    # As the CUDA executor sizes them: the launcher's buffers and those its kernels' meta names.
    scratch = {name: torch.zeros(nbytes, dtype=torch.uint8)
               for name, nbytes in op_scratch(launcher, attrs, [k.meta for k in kernels], limits).items()}
    tensors = [t for t in [*inputs, out, *scratch.values(), *views] if t is not None]
    log: list = []
    with mock.patch("kiln.plugins.driver_launch.sm_count", lambda: sms):
        launcher.launch([Running(k, tensors, log) for k in kernels], [k.meta for k in kernels], inputs, attrs, out,
                        dims or {"T": rows}, 0, scratch)
    return log


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("plugin", ["linear", "linear_residual"])
def test_linear_launches_the_tma_gemm(plugin):
    torch.manual_seed(0)
    k, n = 64, 384   # three 128-column tiles: three row tiles x three column tiles over 3 programs
    inputs = [torch.randn(T, k), torch.randn(n, k) / 8, torch.randn(n)]
    inputs += [torch.randn(T, n)] if plugin == "linear_residual" else []
    attrs = {"parallel": "none", "heads": 0, "all_reduce": False}
    out = torch.full((T, n), float("nan"))
    assert launch(plugin, {"K": k, "N": n, "bias": True}, inputs, attrs, out) == [("tma_linear_kernel", (SMS, 1, 1))]
    close(out, get_plugin(plugin).call_reference(inputs, attrs))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_norm_swiglu_launches_row_scales_then_the_tma_gemm(activation):
    torch.manual_seed(1)
    k, inter, block = 64, 128, 32
    w_gu = torch.randn(2 * inter, k) / 8
    inputs = [torch.randn(T, k) * 3, None, interleave(w_gu, block)]
    attrs = {"eps": EPS, "block": block, "activation": activation}
    out = torch.full((T, inter), float("nan"))
    log = launch("norm_swiglu", {"K": k, "I": inter, "block": block, "activation": activation}, inputs, attrs, out)
    assert log == [("row_scale_kernel", (T, 1, 1)), ("tma_norm_swiglu_kernel", (SMS, 1, 1))]
    close(out, get_plugin("norm_swiglu").call_reference(inputs, attrs))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_norm_qkv_rope_launches_row_scales_then_the_tma_gemm(qk_norm):
    torch.manual_seed(2)
    k, heads, kv_heads, d, layer = 64, 4, 2, 32, 1
    rows = (heads + 2 * kv_heads) * d
    angles = torch.arange(512)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    kv_cache = torch.randn(2, 2, 20, 16, kv_heads, d)   # 320 slots per layer
    inputs = [torch.randn(T, k), None, torch.randn(rows, k) / 8, torch.randn(rows),
              1 + 0.2 * torch.randn(d) if qk_norm else None, 1 + 0.2 * torch.randn(d) if qk_norm else None,
              torch.randint(0, 512, (T,), dtype=torch.int32), torch.cat([angles.cos(), angles.sin()], dim=1),
              kv_cache, torch.randperm(320)[:T].to(torch.int32)]
    attrs = {"eps": EPS, "layer": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
    shapes = {"K": k, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "bias": True, "qk_norm": qk_norm}
    ref_cache = kv_cache.clone()
    ref = get_plugin("norm_qkv_rope").call_reference(inputs[:8] + [ref_cache] + inputs[9:], attrs)
    out = torch.full((T, heads * d), float("nan"))
    log = launch("norm_qkv_rope", shapes, inputs, attrs, out)
    assert log == [("row_scale_kernel", (T, 1, 1)), ("tma_norm_qkv_rope_kernel", (SMS, 1, 1))]
    close(out, ref)
    close(kv_cache, ref_cache)


@pytest.mark.parametrize("rows", [40, 200])
@pytest.mark.parametrize("norm_weight", [False, True])
def test_norm_qkv_rope_small_and_medium_buckets_take_row_scales_from_the_pre_pass(norm_weight, rows):
    """From 17 to 256 rows the pointer kernel reads x's row scales from the pre-pass instead of
    summing x^2 (`linear.tiles.prescaled`), with the norm weight folded or passed."""
    torch.manual_seed(3)
    k, heads, kv_heads, d, layer = 64, 4, 2, 32, 0
    angles = torch.arange(512)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    kv_cache = torch.randn(2, 2, 16, 16, kv_heads, d)
    inputs = [torch.randn(rows, k), 1 + 0.2 * torch.randn(k) if norm_weight else None,
              torch.randn((heads + 2 * kv_heads) * d, k) / 8, None, None, None,
              torch.randint(0, 512, (rows,), dtype=torch.int32), torch.cat([angles.cos(), angles.sin()], dim=1),
              kv_cache, torch.randperm(256)[:rows].to(torch.int32)]
    attrs = {"eps": EPS, "layer": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
    shapes = {"K": k, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "norm_weight": norm_weight}
    ref_cache = kv_cache.clone()
    ref = get_plugin("norm_qkv_rope").call_reference(inputs[:8] + [ref_cache] + inputs[9:], attrs)
    out = torch.full((rows, heads * d), float("nan"))
    log = launch("norm_qkv_rope", shapes, inputs, attrs, out, rows=rows)
    assert log == [("row_scale_kernel", (rows, 1, 1)),
                   ("norm_qkv_rope_kernel", (-(-rows // 64), heads + 2 * kv_heads, 1))]
    close(out, ref)
    close(kv_cache, ref_cache)


@pytest.mark.parametrize("rows", [40, 200])
@pytest.mark.parametrize("norm_weight", [False, True])
def test_norm_swiglu_small_and_medium_buckets_take_row_scales_from_the_pre_pass(norm_weight, rows):
    """From 17 to 256 rows norm_swiglu's pointer kernel reads x's row scales from the pre-pass,
    with the norm weight folded or passed."""
    torch.manual_seed(4)
    k, inter = 64, 96
    inputs = [torch.randn(rows, k), 1 + 0.2 * torch.randn(k) if norm_weight else None, torch.randn(2 * inter, k) / 8]
    attrs = {"eps": EPS, "block": 0, "activation": "silu"}
    shapes = {"K": k, "I": inter, "block": 0, "norm_weight": norm_weight}
    ref = get_plugin("norm_swiglu").call_reference(inputs, attrs)
    out = torch.full((rows, inter), float("nan"))
    log = launch("norm_swiglu", shapes, inputs, attrs, out, rows=rows)
    assert [name for name, _ in log] == ["row_scale_kernel", "norm_swiglu_kernel"]
    close(out, ref)


@pytest.mark.parametrize("rows,block_m", [(100, 128), (150, 64), (192, 64), (200, 128)])
def test_wide_norm_swiglu_takes_64_row_tiles_where_128_would_pad_most(rows, block_m):
    """A wide W_gu (`linear.tiles.WIDE_TILES`, WIDE_N lowered so this one counts): from 129 to 192
    rows the TMA GEMM takes 64-row tiles, elsewhere 128-row ones. On a GPU with more SMs than
    tiles the grid is one program per tile: row tiles x 2 column tiles (64 columns each)."""
    torch.manual_seed(5)
    k, inter, block = 64, 128, 32
    w_gu = torch.randn(2 * inter, k) / 8
    inputs = [torch.randn(rows, k) * 3, None, interleave(w_gu, block)]
    attrs = {"eps": EPS, "block": block, "activation": "silu"}
    out = torch.full((rows, inter), float("nan"))
    with mock.patch.object(linear_tiles, "WIDE_N", 32):
        log = launch("norm_swiglu", {"K": k, "I": inter, "block": block}, inputs, attrs, out, rows=rows, sms=1000)
    assert log == [("row_scale_kernel", (rows, 1, 1)), ("tma_norm_swiglu_kernel", (-(-rows // block_m) * 2, 1, 1))]
    close(out, get_plugin("norm_swiglu").call_reference(inputs, attrs))


ATTENTION = {"heads": 8, "kv_heads": 2, "head_dim": 32, "block_size": 16}


def run_attention(lens: list[int], cached: list[int], dims: dict[str, int] | None = None) -> list[tuple[str, tuple]]:
    """Attention over sequences of `lens` new tokens after `cached` ones (256 at most), through 16
    paged blocks each in scrambled order (layer 1 of 2), by the sm_90 launcher; checks the output against the
    reference and returns the launches."""
    heads, kv_heads, d, bs, layer = (*ATTENTION.values(), 1)
    tokens = sum(lens)
    kv_cache = torch.randn(2, 2, 16 * len(lens), bs, kv_heads, d)
    tables = torch.randperm(16 * len(lens)).view(len(lens), 16).to(torch.int32)
    inputs = [torch.randn(tokens, heads * d), None, None, kv_cache, torch.zeros(tokens, dtype=torch.int32), tables,
              torch.tensor(lens, dtype=torch.int32), torch.tensor([n + c for n, c in zip(lens, cached)],
                                                                    dtype=torch.int32)]
    attrs = {"layer": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "scale": d ** -0.5,
             "window": 0}
    out = torch.full((tokens, heads * d), float("nan"))
    log = launch("attention", ATTENTION, inputs, attrs, out, views=[kv_cache[layer, 0], kv_cache[layer, 1]],
                 rows=tokens, dims=dims)
    close(out, get_plugin("attention").call_reference(inputs, attrs))
    return log


def test_attention_launches_the_128_row_prefill_kernel():
    """Two sequences' prefill chunks, the second continuing 40 cached tokens."""
    torch.manual_seed(3)
    log = run_attention([180, 120], [0, 40])
    # Rows are (query token, head of its kv group) pairs, 128 to a program: T * 4 / 128 + S.
    assert log == [("attention_kernel", (300 * 4 // 128 + 2, 2, 1))]


def test_a_mixed_steps_decode_rows_take_the_decode_kernel():
    """Three decode rows first (D = 3, as the scheduler packs them), then a prompt chunk after 20
    cached tokens and a one-token chunk: the decode kernel over the first three sequences, the
    prefill kernel over the other two, counted from sequence 3."""
    torch.manual_seed(4)
    log = run_attention([1, 1, 1, 100, 1], [49, 69, 32, 20, 39], {"T": 104, "S": 5, "D": 3})
    # Decode: one 16-row program per sequence and kv head. Prefill: (101 * 4) // 128 + 2 programs.
    assert log == [("attention_kernel", (3, 2, 1)), ("attention_kernel", (101 * 4 // 128 + 2, 2, 1))]
