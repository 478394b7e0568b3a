"""The GEMM-family Triton kernels (linear, linear_residual, norm_swiglu, norm_qkv_rope), the
TMA ones of sm_90 and later included, against their plugins' PyTorch references on the CPU,
under Triton's interpreter (`gemm_modes` runs a test in a child process where this one's
kernels were built for a GPU). Their AOT compilation is test_kernels_gemm_aot.py.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import kiln.plugins.linear.kernels as linear_kernels  # noqa: E402
import kiln.plugins.linear.tiles as linear_tiles  # noqa: E402
import kiln.plugins.linear.tma as tma  # noqa: E402
import kiln.plugins.norm_qkv_rope.kernels as norm_qkv_rope_kernels  # noqa: E402
import kiln.plugins.norm_swiglu.kernels as norm_swiglu_kernels  # noqa: E402
from kiln.plugins import get_plugin  # noqa: E402
from gemm_modes import DTYPES, EPS, assert_matches, check, in_mode, rand, with_norm  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k", [(1, 32), (3, 64), (17, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", ["linear", "linear_residual"])
def test_parity_linear(request, name, bias, t, k, dtype):
    def body():
        torch.manual_seed(t * k)
        n = 40
        inputs = [rand(t, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k ** -0.5),
                  rand(n, dtype=dtype) if bias else None]
        if name == "linear_residual":
            inputs.append(rand(t, n, dtype=dtype))
        check(name, inputs, {"parallel": "none", "heads": 0, "all_reduce": False}, (t, n))
    in_mode(request, True, body)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k", [(1, 64), (3, 32), (17, 64)])
@pytest.mark.parametrize("folded", [True, False])
@pytest.mark.parametrize("block", [0, 8])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_parity_norm_swiglu(request, activation, block, folded, t, k, dtype):
    def body():
        torch.manual_seed(t * k + block)
        inter = 24
        norm_weight, w_gu = with_norm(rand(2 * inter, k, dtype=dtype, scale=k ** -0.5), folded)
        check("norm_swiglu", [rand(t, k, dtype=dtype, scale=3.0), norm_weight, w_gu],
              {"eps": EPS, "block": block, "activation": activation}, (t, inter))
    in_mode(request, True, body)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k", [(1, 512), (5, 1024), (70, 512)])
@pytest.mark.parametrize("name", ["linear", "linear_residual", "norm_swiglu"])
def test_parity_split_k(request, name, t, k, dtype):
    """K long enough that the decode and medium buckets split it (into 4 parts each)."""
    def body():
        torch.manual_seed(t + k)
        tile = linear_tiles.pick_tile(t)
        assert linear_tiles.split_k(tile, k, linear_tiles.block_k(tile, dtype.itemsize)) > 1
        x = rand(t, k, dtype=dtype, scale=3.0 if name == "norm_swiglu" else 1.0)
        if name == "norm_swiglu":
            _, w_gu = with_norm(rand(2 * 48, k, dtype=dtype, scale=k ** -0.5), True)
            check(name, [x, None, w_gu], {"eps": EPS, "block": 16, "activation": "silu"}, (t, 48))
        else:
            inputs = [x, rand(80, k, dtype=dtype, scale=k ** -0.5), rand(80, dtype=dtype)]
            inputs += [rand(t, 80, dtype=dtype)] if name == "linear_residual" else []
            check(name, inputs, {"parallel": "none", "heads": 0, "all_reduce": False}, (t, 80))
    in_mode(request, True, body)


def test_parity_split_k_workspace_is_reusable(request):
    """The last program of each tile leaves its arrival count at zero, so one workspace serves
    launch after launch (the engine allocates it once); a count left behind would make the
    next launch's tiles finish early, with partial sums."""
    def body():
        torch.manual_seed(0)
        t, k, n = 3, 1024, 96
        tile = linear_tiles.pick_tile(t)
        bk = linear_tiles.block_k(tile, 4)
        split, columns = linear_tiles.split_k(tile, k, bk), -(-n // tile.block_n)
        part, count = linear_kernels.split_buffers(t, tile.block_m, tile.block_n, columns, split, "cpu")
        w = rand(n, k, dtype=torch.float32, scale=k ** -0.5)
        for seed in range(3):
            x = rand(t, k, dtype=torch.float32)
            out = torch.full((t, n), float("nan"))
            linear_kernels.linear_kernel[(1, columns, split)](
                x, None, w, None, None, None, out, part, count, t, N=n, K=k, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                BLOCK_K=bk, UPCAST_DOT=False, SPLIT_K=split)
            assert_matches(out, x @ w.T)
            assert not count.any(), f"launch {seed} left arrival counts {count.tolist()}"
    in_mode(request, True, body)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["linear_residual", "norm_swiglu"])
@pytest.mark.parametrize("t,bucket", [(100, "medium"), (200, "large")])
def test_parity_medium_and_large_buckets(request, name, dtype, t, bucket):
    """65 to 128 rows take the medium bucket's tiles (K split in 4 where it divides), 129 to 256 the large one's."""
    def body():
        torch.manual_seed(3)
        k = 256
        assert linear_tiles.pick_tile(t).name == bucket
        if name == "linear_residual":
            check(name, [rand(t, k, dtype=dtype), rand(40, k, dtype=dtype, scale=k ** -0.5), None, rand(t, 40, dtype=dtype)],
                  {"parallel": "none", "heads": 0, "all_reduce": False}, (t, 40))
        else:
            _, w_gu = with_norm(rand(2 * 24, k, dtype=dtype, scale=k ** -0.5), True)
            check(name, [rand(t, k, dtype=dtype, scale=3.0), None, w_gu], {"eps": EPS, "block": 8, "activation": "silu"}, (t, 24))
    in_mode(request, True, body)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 17, 150])
@pytest.mark.parametrize("name", ["linear", "norm_swiglu"])
def test_parity_wide_weight_tiles(request, name, t, dtype):
    """WIDE_TILES (gate/up, LM head) on small shapes: WIDE_N is lowered so these weights count
    as wide, and the decode, small and 64-row medium buckets' wide tiles must match the reference."""
    def body():
        torch.manual_seed(t)
        k = 128
        with mock.patch.object(linear_tiles, "WIDE_N", 32):
            assert linear_tiles.pick_tile(t, 48) in linear_tiles.WIDE_TILES
            if name == "linear":
                check("linear", [rand(t, k, dtype=dtype), rand(80, k, dtype=dtype, scale=k ** -0.5), None],
                      {"parallel": "none", "heads": 0, "all_reduce": False}, (t, 80))
            else:
                _, w_gu = with_norm(rand(2 * 40, k, dtype=dtype, scale=k ** -0.5), True)
                check("norm_swiglu", [rand(t, k, dtype=dtype, scale=3.0), None, w_gu], {"eps": EPS, "block": 8, "activation": "silu"},
                      (t, 40))
    in_mode(request, True, body)


@pytest.mark.parametrize("dtype", DTYPES)
# head_dim 64 at decode sizes splits each head over two programs when there is no q/k norm.
# K = 512 at T=1 and 256 at T=20 split K (4 and 2 parts) in every dtype.
@pytest.mark.parametrize("t,k,d", [(1, 32, 16), (3, 64, 16), (17, 32, 16), (3, 32, 64), (1, 512, 16), (20, 256, 16)])
@pytest.mark.parametrize("folded", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_parity_norm_qkv_rope(request, qk_norm, bias, folded, t, k, d, dtype):
    def body():
        torch.manual_seed(t * k + d + 2 * bias + qk_norm)
        heads, kv_heads, layer = 4, 2, 1
        rows = (heads + 2 * kv_heads) * d
        norm_weight, w_qkv = with_norm(rand(rows, k, dtype=dtype, scale=k ** -0.5), folded)
        max_pos = 64
        angles = torch.arange(max_pos)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
        kv_cache = rand(2, 2, 6, 4, kv_heads, d, dtype=dtype)   # 24 slots per layer
        slots = torch.randperm(24)[:t].to(torch.int32)
        # q/k norm weights in float32, as models hold norm weights.
        inputs = [rand(t, k, dtype=dtype), norm_weight, w_qkv, rand(rows, dtype=dtype) if bias else None,
                  1 + 0.2 * rand(d, dtype=torch.float32) if qk_norm else None,
                  1 + 0.2 * rand(d, dtype=torch.float32) if qk_norm else None,
                  torch.randint(0, max_pos, (t,), dtype=torch.int32),
                  torch.cat([angles.cos(), angles.sin()], dim=1), kv_cache, slots]
        attrs = {"eps": EPS, "layer": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d}
        before = kv_cache.clone()
        ref_cache = kv_cache.clone()
        check("norm_qkv_rope", inputs, attrs, (t, heads * d), inputs[:8] + [ref_cache] + inputs[9:])
        # The kernel wrote the real cache: written slots match, everything else is untouched.
        written = torch.zeros(2, 2, 24, dtype=torch.bool)
        written[layer, :, slots.long()] = True
        written = written.view(2, 2, 6, 4)
        assert_matches(kv_cache[written], ref_cache[written])
        assert torch.equal(kv_cache[~written], before[~written])
    in_mode(request, True, body)



# The persistent TMA kernels of sm_90 and later, in the interpreter: small tiles, a grid with
# fewer programs than tiles (each program walks several), T not a multiple of the row tile.
TMA_PROGRAMS = 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
def test_parity_tma_linear(request, bias, residual, dtype):
    def body():
        torch.manual_seed(7)
        t, n, k = 150, 96, 64
        x, w = rand(t, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k ** -0.5)
        b = rand(n, dtype=dtype) if bias else None
        r = rand(t, n, dtype=dtype) if residual else None
        out = torch.full((t, n), float("nan"), dtype=dtype)
        tma.tma_linear_kernel[(TMA_PROGRAMS,)](x, None, w, None, b, r, out, t, N=n, K=k, BLOCK_M=64, BLOCK_N=32,
                                               BLOCK_K=32, GROUP_M=2, UPCAST_DOT=linear_kernels.upcast_dot(x))
        inputs = [x, w, b] + ([r] if residual else [])
        ref = get_plugin("linear_residual" if residual else "linear").call_reference(
            inputs, {"parallel": "none", "heads": 0, "all_reduce": False})
        assert_matches(out, ref)
    in_mode(request, True, body)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    scales = torch.full((x.shape[0],), float("nan"))
    tma.row_scale_kernel[(x.shape[0],)](x, scales, x.shape[0], EPS, K=x.shape[1], BLOCK_K=32)
    torch.testing.assert_close(scales, torch.rsqrt(x.float().pow(2).mean(-1) + EPS), rtol=1e-5, atol=0)
    return scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_parity_tma_norm_swiglu(request, activation, dtype):
    """Tiles of 32 weight rows over W_gu interleaved in blocks of 8: two gate/up pairs each."""
    def body():
        torch.manual_seed(8)
        t, k, inter, block = 150, 64, 48, 8
        x = rand(t, k, dtype=dtype, scale=3.0)
        _, w_gu = with_norm(rand(2 * inter, k, dtype=dtype, scale=k ** -0.5), True)
        out = torch.full((t, inter), float("nan"), dtype=dtype)
        norm_swiglu_kernels.tma_norm_swiglu_kernel[(TMA_PROGRAMS,)](
            x, row_scales(x), w_gu, None, out, t, I=inter, K=k, GU_BLOCK=block, BLOCK_M=64, BLOCK_N=16, BLOCK_K=32,
            GROUP_M=2, UPCAST_DOT=linear_kernels.upcast_dot(x), GELU_TANH=norm_swiglu_kernels.GELU_TANH[activation])
        assert_matches(out, get_plugin("norm_swiglu").call_reference(
            [x, None, w_gu], {"eps": EPS, "block": block, "activation": activation}))
    in_mode(request, True, body)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,qk_norm,heads_per_tile", [(False, False, 2), (True, True, 2), (True, True, 1)])
def test_parity_tma_norm_qkv_rope(request, bias, qk_norm, heads_per_tile, dtype):
    def body():
        torch.manual_seed(9)
        t, k, d, heads, kv_heads, layer = 70, 64, 16, 4, 2, 1
        rows = (heads + 2 * kv_heads) * d
        _, w_qkv = with_norm(rand(rows, k, dtype=dtype, scale=k ** -0.5), True)
        angles = torch.arange(128)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
        kv_cache = rand(2, 2, 20, 4, kv_heads, d, dtype=dtype)   # 80 slots per layer
        slots = torch.randperm(80)[:t].to(torch.int32)
        x = rand(t, k, dtype=dtype)
        b = rand(rows, dtype=dtype) if bias else None
        # float32, as models hold norm weights
        q_norm = 1 + 0.2 * rand(d, dtype=torch.float32) if qk_norm else None
        k_norm = 1 + 0.2 * rand(d, dtype=torch.float32) if qk_norm else None
        positions = torch.randint(0, 128, (t,), dtype=torch.int32)
        rope = torch.cat([angles.cos(), angles.sin()], dim=1)
        ref_cache = kv_cache.clone()
        ref = get_plugin("norm_qkv_rope").call_reference(
            [x, None, w_qkv, b, q_norm, k_norm, positions, rope, ref_cache, slots],
            {"eps": EPS, "layer": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d})
        out = torch.full((t, heads * d), float("nan"), dtype=dtype)
        norm_qkv_rope_kernels.tma_norm_qkv_rope_kernel[(TMA_PROGRAMS,)](
            x, row_scales(x), w_qkv, None, b, q_norm, k_norm, positions, rope, kv_cache, slots, None, out, t, 80, layer,
            EPS,
            K=k, H=heads, KVH=kv_heads, D=d, BLOCK_M=64, BLOCK_K=32, GROUP_M=2, HEADS=heads_per_tile,
            UPCAST_DOT=linear_kernels.upcast_dot(x), BLOCK_SIZE=1)
        assert_matches(out, ref)
        assert_matches(kv_cache, ref_cache)
    in_mode(request, True, body)
