"""The FP8 (W8A8) GEMM kernels against `plugins.fp8`'s numerics, in Triton's interpreter: the
quantize pre-pass gives the reference's e4m3 values and scales bit for bit, the e4m3 rounding
that sm_89 and the interpreter do in float32 is torch's cast, and every GEMM plugin's FP8
kernels (`kernels.run`, which takes the bucket the engine takes for T rows) match the plugin's
reference (its W8A8 path, called on the same inputs in the spec's order), in every bucket (each reads the
pre-pass's rows), with T and N not multiples of the tiles, and so
do the persistent TMA kernels that sm_90 and later run instead in the TMA buckets."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kiln.plugins.linear.kernels as linear_kernels  # noqa: E402
import kiln.plugins.linear.tiles as linear_tiles  # noqa: E402
from kiln.plugins.attention import kernels as attention_kernels  # noqa: E402
from kiln.plugins.attention_o_proj import kernels as attention_o_proj_kernels  # noqa: E402
from kiln.plugins.fp8 import FP8, quantize_rows, row_scales, to_e4m3  # noqa: E402
from kiln.plugins.linear import fp8, tma  # noqa: E402
from kiln.plugins.linear.reference import normed_input_scales  # noqa: E402
from kiln.plugins.linear_residual import kernels as linear_residual_kernels  # noqa: E402
from kiln.plugins.norm_qkv_rope import kernels as norm_qkv_rope_kernels  # noqa: E402
from kiln.plugins.norm_swiglu import kernels as norm_swiglu_kernels  # noqa: E402
from kiln.plugins.registry import get_plugin  # noqa: E402
from kiln.plugins.rms_norm.reference import rms_norm  # noqa: E402
from interpreted_launch import interpreted_only  # noqa: E402

pytestmark = interpreted_only()
EPS = 1e-5
LINEAR_ATTRS = {"parallel": "none", "heads": 0, "all_reduce": False}
# One T per bucket: decode, small, medium, large, prefill.
BUCKET_ROWS = {"decode": 3, "small": 40, "medium": 100, "large": 200, "xlarge": 300, "prefill": 600}


def rand(*shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def reference(plugin: str, inputs: list, attrs: dict) -> torch.Tensor:
    """The plugin's own reference on `inputs` in its spec's order (what the CPU executor runs)."""
    return get_plugin(plugin).call_reference(inputs, attrs)


def fp8_weight(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight [rows, k] with its per-row scales, rows of different magnitudes."""
    return quantize_rows(torch.randn(rows, k) * k ** -0.5 * (0.5 + torch.rand(rows, 1)))


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: the kernel's sums differ from torch's only in order, and quantizing x any other
    way (or not at all) moves results by about 1e-2. bf16: the reference rounds after the GEMM,
    the bias and the residual, the kernel once, so results are two roundings apart, of the value
    or (where terms cancel) of the largest output."""
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        err = (out.float() - expected.float()).abs()
        bound = 2 ** -7 * (expected.float().abs() + expected.float().abs().max())
        assert (err <= bound).all(), f"{(err > bound).sum().item()} elements off, worst {err.max().item()}"


@triton.jit
def _cast_kernel(v_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    ones = tl.full((1,), 1.0, tl.float32)
    q = fp8.to_e4m3(tl.reshape(tl.load(v_ptr + offs), (1, N)), ones, True)
    tl.store(out_ptr + offs, tl.reshape(q, (N,)))


def test_float32_rounding_to_e4m3_is_torchs_cast():
    """What sm_89 and the interpreter run (ROUND_E4M3): every e4m3 value, the midpoints between
    neighbours (ties go to the even one), values a float32 ulp either side of them, subnormals,
    values past 448 (saturated) and random values over every binade."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                        torch.tensor([460.0, 1e4, -500.0, 2.0 ** -10, -(2.0 ** -8) * 1.5]),
                        torch.randn(2048) * torch.exp2(torch.randint(-12, 9, (2048,)).float())])
    n = triton.next_power_of_2(values.numel())
    values = torch.cat([values, torch.zeros(n - values.numel())])
    out = torch.empty(n, dtype=FP8)
    _cast_kernel[(1,)](values, out, N=n)
    expected = values.clamp(-448, 448).to(FP8)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm", ["none", "folded", "unfolded"])
@pytest.mark.parametrize("k", [100, 512, 5000])
def test_quantize_rows_gives_the_reference_rows(k, norm, dtype):
    """The pre-pass's e4m3 rows and scales are the reference's for the GEMM input (x, or the
    RMSNorm'd row in x's dtype, with `linear.reference.normed_input_scales`), exactly, whether a row is read once
    (k up to fp8.ONE_READ_MAX_K) or walked in blocks twice (k = 5000 with that limit lowered);
    a zero row gets the smallest scale, and a row with one huge value saturates nothing. A
    float32 RMSNorm'd row is not rounded to a coarser dtype, so there the order of the kernel's
    sum of squares shows: scales within float32 rounding, and an e4m3 value a step away where it
    sat on a rounding tie."""
    torch.manual_seed(k)
    x = rand(7, k, dtype=dtype, scale=3.0)
    x[2] = 0
    x[4, 5] = 200.0
    g = (1 + 0.5 * torch.randn(k)).to(dtype) if norm == "unfolded" else None
    with mock.patch.object(fp8, "ONE_READ_MAX_K", 4096 if k > 4096 else fp8.ONE_READ_MAX_K):
        assert (fp8.quantize_block_k(k) >= k) == (k <= 4096)
        xq, scales = linear_kernels.quantize_rows(x, g, norm != "none", EPS)
    gemm_input = x if norm == "none" else rms_norm(x, g, EPS)
    expected_scales = row_scales(x) if norm == "none" else normed_input_scales(x, g, EPS)
    expected_q = to_e4m3(gemm_input, expected_scales[:, None])
    if dtype == torch.float32 and norm != "none":
        torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
        off = xq.float() != expected_q.float()
        assert off.sum() <= 2 and torch.allclose(xq.float(), expected_q.float(), rtol=2 ** -3, atol=2 ** -9)
        return
    assert torch.equal(scales, expected_scales)
    assert torch.equal(xq.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("norm", ["none", "folded", "unfolded"])
@pytest.mark.parametrize("k", [100, 5000])
def test_quantize_rows_with_a_static_scale_gives_the_reference_rows(k, norm):
    """With a static activation scale the pre-pass divides every row by it (values past 448 times
    it saturate) and writes it as each row's scale, bit for bit as `plugins.fp8.to_e4m3` does, in
    one read and in the two-pass walk (whose first pass then reads no norm weight)."""
    torch.manual_seed(k + len(norm))
    x = rand(5, k, dtype=torch.bfloat16, scale=3.0)
    x[1] = 0
    g = (1 + 0.5 * torch.randn(k)).bfloat16() if norm == "unfolded" else None
    gemm_input = x if norm == "none" else rms_norm(x, g, EPS)
    static = torch.tensor([gemm_input.float().abs().max().item() / 448 / 2])
    with mock.patch.object(fp8, "ONE_READ_MAX_K", 4096 if k > 4096 else fp8.ONE_READ_MAX_K):
        xq, scales = linear_kernels.quantize_rows(x, g, norm != "none", EPS, static)
    expected = to_e4m3(gemm_input, static)
    assert (expected.float().abs() == 448).sum() > 0   # some values saturate
    assert torch.equal(scales, static.expand(5))
    assert torch.equal(xq.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket", list(BUCKET_ROWS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", ["linear", "linear_residual"])
def test_parity_fp8_linear(name, bias, bucket, dtype):
    torch.manual_seed(len(bucket) + bias)
    t, k, n = BUCKET_ROWS[bucket], 96, 40
    assert linear_tiles.pick_tile(t, n).name == bucket
    wq, ws = fp8_weight(n, k)
    x, b = rand(t, k, dtype=dtype), rand(n, dtype=dtype) if bias else None
    out = torch.full((t, n), float("nan"), dtype=dtype)
    if name == "linear":
        inputs = [x, wq, b, ws]
        linear_kernels.run(inputs, LINEAR_ATTRS, out)
    else:
        inputs = [x, wq, b, rand(t, n, dtype=dtype), ws]
        linear_residual_kernels.run(inputs, LINEAR_ATTRS, out)
    assert_matches(out, reference(name, inputs, LINEAR_ATTRS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k", [(1, 1024), (5, 2048), (70, 1024)])
def test_parity_fp8_split_k(t, k, dtype):
    """K long enough that the decode and medium buckets split it (e4m3 K tiles are twice as wide)."""
    torch.manual_seed(t)
    tile = linear_tiles.pick_tile(t)
    assert linear_tiles.split_k(tile, k, linear_tiles.block_k(tile, 1)) > 1
    wq, ws = fp8_weight(72, k)
    x = rand(t, k, dtype=dtype)
    out = torch.full((t, 72), float("nan"), dtype=dtype)
    linear_kernels.run([x, wq, None, ws], LINEAR_ATTRS, out)
    assert_matches(out, reference("linear", [x, wq, None, ws], LINEAR_ATTRS))


@pytest.mark.parametrize("t", [1, 17])
def test_parity_fp8_wide_weight_tiles(t):
    """WIDE_TILES (gate/up, LM head) with WIDE_N lowered so that a small weight counts as wide."""
    torch.manual_seed(t)
    wq, ws = fp8_weight(80, 256)
    x = rand(t, 256)
    with mock.patch.object(linear_tiles, "WIDE_N", 32):
        assert linear_tiles.pick_tile(t, 80) in linear_tiles.WIDE_TILES
        out = torch.full((t, 80), float("nan"))
        linear_kernels.run([x, wq, None, ws], LINEAR_ATTRS, out)
    assert_matches(out, reference("linear", [x, wq, None, ws], LINEAR_ATTRS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket", ["decode", "small", "medium", "large"])
@pytest.mark.parametrize("folded", [True, False])
@pytest.mark.parametrize("block", [0, 8])
def test_parity_fp8_norm_swiglu(block, folded, bucket, dtype):
    torch.manual_seed(block + folded)
    t, k, inter = BUCKET_ROWS[bucket], 128, 24
    wq, ws = fp8_weight(2 * inter, k)
    x = rand(t, k, dtype=dtype, scale=3.0)
    g = None if folded else (1 + 0.3 * torch.randn(k)).to(dtype)
    attrs = {"eps": EPS, "block": block, "activation": "silu"}
    out = torch.full((t, inter), float("nan"), dtype=dtype)
    norm_swiglu_kernels.run([x, g, wq, ws], attrs, out)
    assert_matches(out, reference("norm_swiglu", [x, g, wq, ws], attrs))


def qkv_inputs(t: int, k: int, d: int, dtype: torch.dtype, folded: bool, bias: bool, qk_norm: bool,
               heads: int = 4, kv_heads: int = 2) -> list:
    """norm_qkv_rope's inputs in the spec's order, w_qkv in e4m3, no kv_scales, w_qkv's scales last."""
    rows = (heads + 2 * kv_heads) * d
    blocks = max(80, -(-t // 4))    # of 4 slots: every row gets its own
    wq, ws = fp8_weight(rows, k)
    angles = torch.arange(512)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    return [rand(t, k, dtype=dtype), None if folded else (1 + 0.3 * torch.randn(k)).to(dtype), wq,
            rand(rows, dtype=dtype) if bias else None, 1 + 0.2 * torch.randn(d) if qk_norm else None,
            1 + 0.2 * torch.randn(d) if qk_norm else None, torch.randint(0, 512, (t,), dtype=torch.int32),
            torch.cat([angles.cos(), angles.sin()], dim=1), rand(2, 2, blocks, 4, kv_heads, d, dtype=dtype),
            torch.randperm(4 * blocks)[:t].to(torch.int32), None, ws]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket", ["decode", "small", "prefill"])
@pytest.mark.parametrize("folded,bias,qk_norm", [(True, False, False), (False, True, True)])
def test_parity_fp8_norm_qkv_rope(folded, bias, qk_norm, bucket, dtype):
    """q to the output, k and v into the cache; head_dim 32 splits heads over programs at decode."""
    torch.manual_seed(bias + len(bucket))
    t, k, d = BUCKET_ROWS[bucket], 64, 32
    inputs = qkv_inputs(t, k, d, dtype, folded, bias, qk_norm)
    attrs = {"eps": EPS, "layer": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": d}
    expected_cache = inputs[8].clone()
    expected = reference("norm_qkv_rope", [*inputs[:8], expected_cache, *inputs[9:]], attrs)
    out = torch.full((t, 4 * d), float("nan"), dtype=dtype)
    norm_qkv_rope_kernels.run(inputs, attrs, out)
    assert_matches(out, expected)
    assert_matches(inputs[8], expected_cache)


def e4m3_cache_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """An e4m3 cache the kernel wrote against the reference's: float32 sums in another order can
    land a value on the other side of an e4m3 rounding boundary, one e4m3 step away, rarely."""
    got, want = got.float(), want.float()
    differ = got != want
    assert differ.float().mean() < 0.01
    step = want.abs().clamp(min=2 ** -6) / 8
    assert ((got - want).abs() <= step * 1.01)[differ].all()


def with_fp8_kv(inputs: list, seed: int) -> list:
    """norm_qkv_rope's inputs with an e4m3 cache and its per-head scales [layers, 2, kv heads]
    in the kv_scales slot, between slot_mapping and w_qkv's scales (the spec's order)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = inputs[8].shape[-2]
    scales = 0.004 + 0.02 * torch.rand(2, 2, kv_heads, generator=gen)
    cache = to_e4m3(inputs[8].float(), scales[:, :, None, None, :, None])
    return [*inputs[:8], cache, inputs[9], scales, *inputs[11:]]


@pytest.mark.parametrize("bucket", ["decode", "prefill"])
def test_parity_fp8_norm_qkv_rope_with_an_fp8_kv_cache(bucket):
    """e4m3 weights and an e4m3 cache in the same kernel: kv_scale_ptr and w_scale_ptr both set
    (float32: in bf16 the reference's roundings before the cache's would move e4m3 values more)."""
    torch.manual_seed(len(bucket))
    t, k, d = BUCKET_ROWS[bucket], 64, 32
    inputs = with_fp8_kv(qkv_inputs(t, k, d, torch.float32, False, True, True), t)
    attrs = {"eps": EPS, "layer": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": d}
    expected_cache = inputs[8].clone()
    expected = reference("norm_qkv_rope", [*inputs[:8], expected_cache, *inputs[9:]], attrs)
    out = torch.full((t, 4 * d), float("nan"))
    norm_qkv_rope_kernels.run(inputs, attrs, out)
    assert_matches(out, expected)
    e4m3_cache_close(inputs[8], expected_cache)


@pytest.mark.parametrize("t", [2, 150])
def test_parity_fp8_attention_o_proj(t):
    """Attention over a paged cache, then o_proj in e4m3 with the residual added (bf16)."""
    torch.manual_seed(t)
    heads, kv_heads, d, bs, hidden = 4, 2, 32, 16, 72
    lens = [1, 1] if t == 2 else [90, 60]
    cached = [30, 50] if t == 2 else [0, 20]
    kv_cache = rand(2, 2, 20, bs, kv_heads, d, dtype=torch.bfloat16)
    tables = torch.randperm(20)[:16].view(2, 8).to(torch.int32)
    wq, ws = fp8_weight(hidden, heads * d)
    inputs = [rand(t, heads * d, dtype=torch.bfloat16), None, None, kv_cache, torch.zeros(t, dtype=torch.int32),
              tables, torch.tensor(lens, dtype=torch.int32),
              torch.tensor([n + c for n, c in zip(lens, cached)], dtype=torch.int32),
              wq, None, rand(t, hidden, dtype=torch.bfloat16), None, ws]
    attrs = {"layer": 1, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "scale": d ** -0.5,
             "window": 0, "all_reduce": False}
    out = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16)
    attention_o_proj_kernels.run(inputs, attrs, out)
    # o_proj's input is the attention kernel's output (its parity is test_kernels_attention's):
    # a bf16 rounding apart from the reference's could move an e4m3 value a step.
    attn = torch.empty_like(inputs[0])
    attention_kernels.run(inputs[:8], attrs, attn)
    assert_matches(out, reference("linear_residual", [attn, wq, None, inputs[10], ws], LINEAR_ATTRS))


# The persistent TMA kernels of sm_90 and later with e4m3 operands, in the interpreter: small
# tiles, fewer programs than tiles, T not a multiple of the row tile; x from the pre-pass.
TMA_PROGRAMS = 4


@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
def test_parity_fp8_tma_linear(bias, residual):
    torch.manual_seed(7)
    t, n, k = 150, 96, 256
    wq, ws = fp8_weight(n, k)
    x = rand(t, k, dtype=torch.bfloat16)
    b = rand(n, dtype=torch.bfloat16) if bias else None
    r = rand(t, n, dtype=torch.bfloat16) if residual else None
    xq, xs = linear_kernels.quantize_rows(x, None, False, 0.0)
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16)
    tma.tma_linear_kernel[(TMA_PROGRAMS,)](xq, xs, wq, ws, b, r, out, t, N=n, K=k, BLOCK_M=64, BLOCK_N=32, BLOCK_K=64,
                                           GROUP_M=2, UPCAST_DOT=True)
    expected = reference("linear", [x, wq, b, ws], LINEAR_ATTRS) if r is None else \
        reference("linear_residual", [x, wq, b, r, ws], LINEAR_ATTRS)
    assert_matches(out, expected)


def test_parity_fp8_tma_norm_swiglu():
    """Tiles of 32 weight rows over W_gu interleaved in blocks of 8, x RMSNorm'd by the pre-pass."""
    torch.manual_seed(8)
    t, k, inter, block = 150, 128, 48, 8
    wq, ws = fp8_weight(2 * inter, k)
    x = rand(t, k, dtype=torch.bfloat16, scale=3.0)
    xq, xs = linear_kernels.quantize_rows(x, None, True, EPS)
    out = torch.full((t, inter), float("nan"), dtype=torch.bfloat16)
    norm_swiglu_kernels.tma_norm_swiglu_kernel[(TMA_PROGRAMS,)](
        xq, xs, wq, ws, out, t, I=inter, K=k, GU_BLOCK=block, BLOCK_M=64, BLOCK_N=16, BLOCK_K=64, GROUP_M=2,
        UPCAST_DOT=True, GELU_TANH=False)
    assert_matches(out, reference("norm_swiglu", [x, None, wq, ws], {"eps": EPS, "block": block, "activation": "silu"}))


@pytest.mark.parametrize("bias,qk_norm,heads_per_tile", [(False, False, 2), (True, True, 1)])
def test_parity_fp8_tma_norm_qkv_rope(bias, qk_norm, heads_per_tile):
    torch.manual_seed(9)
    t, k, d = 70, 64, 16
    inputs = qkv_inputs(t, k, d, torch.bfloat16, True, bias, qk_norm)
    x, _, wq, b, q_norm, k_norm, positions, rope, kv_cache, slots, _, ws = inputs
    attrs = {"eps": EPS, "layer": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": d}
    expected_cache = kv_cache.clone()
    expected = reference("norm_qkv_rope", [*inputs[:8], expected_cache, *inputs[9:]], attrs)
    xq, xs = linear_kernels.quantize_rows(x, None, True, EPS)
    out = torch.full((t, 4 * d), float("nan"), dtype=torch.bfloat16)
    norm_qkv_rope_kernels.tma_norm_qkv_rope_kernel[(TMA_PROGRAMS,)](
        xq, xs, wq, ws, b, q_norm, k_norm, positions, rope, kv_cache, slots, None, out, t, 320, 1, EPS,
        K=k, H=4, KVH=2, D=d, BLOCK_M=64, BLOCK_K=64, GROUP_M=2, HEADS=heads_per_tile, UPCAST_DOT=True,
        BLOCK_SIZE=1)
    assert_matches(out, expected)
    assert_matches(kv_cache, expected_cache)


def test_parity_fp8_tma_norm_qkv_rope_with_an_fp8_kv_cache():
    torch.manual_seed(10)
    t, k, d = 70, 64, 16
    inputs = with_fp8_kv(qkv_inputs(t, k, d, torch.float32, True, True, True), 10)
    x, _, wq, b, q_norm, k_norm, positions, rope, kv_cache, slots, kv_scales, ws = inputs
    attrs = {"eps": EPS, "layer": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": d}
    expected_cache = kv_cache.clone()
    expected = reference("norm_qkv_rope", [*inputs[:8], expected_cache, *inputs[9:]], attrs)
    xq, xs = linear_kernels.quantize_rows(x, None, True, EPS)
    out = torch.full((t, 4 * d), float("nan"))
    norm_qkv_rope_kernels.tma_norm_qkv_rope_kernel[(TMA_PROGRAMS,)](
        xq, xs, wq, ws, b, q_norm, k_norm, positions, rope, kv_cache, slots, kv_scales, out, t, 320, 1, EPS,
        K=k, H=4, KVH=2, D=d, BLOCK_M=64, BLOCK_K=64, GROUP_M=2, HEADS=1, UPCAST_DOT=True,
        BLOCK_SIZE=kv_cache.shape[3])
    assert_matches(out, expected)
    e4m3_cache_close(kv_cache, expected_cache)
