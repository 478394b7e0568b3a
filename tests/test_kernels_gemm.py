"""The GEMM-family Triton kernels (linear, linear_residual, norm_swiglu, norm_qkv_rope) against
their plugins' PyTorch references on the CPU, and their AOT compilation to cubins.

Parity runs under Triton's interpreter and AOT compilation needs compiled-mode kernels; the
mode is fixed when the kernel modules are imported. This module asks for the interpreter
before anything imports triton; a test whose mode this process does not have (another module
imported the kernels first, or the AOT tests here) runs in one child pytest process per mode
with TRITON_INTERPRET set accordingly, and reports the child's outcome for the same test.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import kiln.plugins.linear.kernels as linear_kernels  # noqa: E402
import kiln.plugins.linear.tiles as linear_tiles  # noqa: E402
from kiln.plugins.aot import MAX_SHARED_BYTES  # noqa: E402
import kiln.plugins.linear.tma as tma  # noqa: E402
import kiln.plugins.linear_residual.kernels as linear_residual_kernels  # noqa: E402
import kiln.plugins.norm_qkv_rope.kernels as norm_qkv_rope_kernels  # noqa: E402
import kiln.plugins.norm_swiglu.kernels as norm_swiglu_kernels  # noqa: E402
from kiln.plugins import get_plugin  # noqa: E402
from kiln.plugins.aot import compile_cubin, kernel_name  # noqa: E402
from kiln.plugins.linear import cute_gemm  # noqa: E402
from kiln.plugins.nvcc import NvccKernel, cutlass_available  # noqa: E402

KERNELS = {"linear": linear_kernels, "linear_residual": linear_residual_kernels,
           "norm_swiglu": norm_swiglu_kernels, "norm_qkv_rope": norm_qkv_rope_kernels}
# True: every kernel was imported in interpreter mode; False: none was; None: a mix.
_MODES = {isinstance(f, InterpretedFunction) for f in (
    linear_kernels.gemm_tile, linear_kernels.linear_kernel, norm_swiglu_kernels.norm_swiglu_kernel,
    norm_qkv_rope_kernels.norm_qkv_rope_kernel, tma.tma_linear_kernel)}
INTERPRETED = _MODES.pop() if len(_MODES) == 1 else None
CHILD = "KILN_GEMM_TEST_CHILD"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5

# Llama-3-8B-like shapes, one projection of each kind.
LLAMA = {"linear": {"K": 4096, "N": 4096},
         "linear_residual": {"K": 14336, "N": 4096},
         "norm_swiglu": {"K": 4096, "I": 14336, "block": 64},
         "norm_qkv_rope": {"K": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}}
# Every optional input present (Qwen2/Qwen3-like, unfolded norms), on one target.
ALL_OPTIONAL = {"linear": {"K": 4096, "N": 1024, "bias": True},
                "norm_swiglu": {"K": 4096, "I": 1536, "block": 0, "norm_weight": True},
                "norm_qkv_rope": {"K": 2048, "num_heads": 16, "num_kv_heads": 2, "head_dim": 128, "bias": True,
                                  "qk_norm": True, "norm_weight": True}}
# Shared memory per block on each target (sm_89's 99 KiB is the tightest).


@functools.cache
def child_outcomes(interpret: bool) -> tuple[dict[str, str], str]:
    """Run this module's tests that need the other Triton mode in a fresh process; returns
    {test name: "passed" or the failure text} and the child's output."""
    if os.environ.get(CHILD):
        pytest.fail(f"the kernels were imported with TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} "
                    "in a child process that set it: something imported them before this module")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0", CHILD: "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
             "-k", "parity" if interpret else "aot", f"--junitxml={report}"],
            env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
        outcomes = {}
        if report.exists():
            for case in ET.parse(report).iter("testcase"):
                problems = [f"{p.tag}: {p.get('message')}" for p in case]
                outcomes[case.get("name")] = "; ".join(problems) or "passed"
    return outcomes, proc.stdout[-4000:] + proc.stderr[-2000:]


def in_mode(request, interpret: bool, body) -> None:
    """Run `body` here when this process has the wanted Triton mode, else take this test's
    outcome from a child process that has it."""
    if INTERPRETED is interpret:
        body()
        return
    outcomes, log = child_outcomes(interpret)
    outcome = outcomes.get(request.node.name, "not run")
    assert outcome == "passed", f"in a TRITON_INTERPRET={int(interpret)} child: {outcome}\n{log}"


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= 2e-2 * ref.float().abs().max().item(), f"max error {err}"


def rand(*shape, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def check(name: str, inputs: list, attrs: dict, out_shape: tuple, ref_inputs: list | None = None) -> None:
    """Run the kernel on `inputs` and the reference on `ref_inputs` (default: the same)."""
    ref = get_plugin(name).call_reference(inputs if ref_inputs is None else ref_inputs, attrs)
    out = torch.full(out_shape, float("nan"), dtype=ref.dtype)
    KERNELS[name].run(inputs, attrs, out)
    assert_matches(out, ref)


def with_norm(w: torch.Tensor, folded: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(norm_weight, projection): the RMSNorm weight given, or multiplied into W as fold does."""
    g = 1 + 0.2 * torch.randn(w.shape[1])
    if folded:
        return None, (w.float() * g).to(w.dtype)
    return g.to(w.dtype), w


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


def check_cubins(name: str, shapes: dict, targets) -> None:
    """Every target gets one kernel per bucket (the TMA ones on sm_90 and later, which need
    global scratch for their descriptors) and, with TMA norm GEMMs or a bucket that reads row
    scales, the row-scale pre-pass."""
    kernels = KERNELS[name].aot_kernels("bfloat16", shapes)
    for target in targets:
        mine = [k for k in kernels if k.targets is None or target in k.targets]
        buckets = [k for k in mine if "bucket" in k.meta]
        # The CUDA GEMVs lead: for one and two rows in the plain GEMMs, one row in the fused qkv
        # (without q/k norm, which needs whole heads) and in gate/up (`linear.gemv`).
        gemv = {"linear": ["gemv1", "gemv2"], "linear_residual": ["gemv1", "gemv2"],
                "norm_qkv_rope": [] if shapes.get("qk_norm") else ["gemv1"], "norm_swiglu": ["gemv1"]}[name]
        # A wide weight (gate/up) has no xlarge bucket: its 128-row tiles fill the GPU from 257 rows.
        weight_rows = 2 * shapes["I"] if name == "norm_swiglu" else shapes.get("N", 0)
        # On sm_90 the plain GEMMs of narrow weights, and qkv with a folded norm weight and no q/k norm,
        # take a CuTe GEMM ahead of the 129-256-row bucket's pointer kernel, where CUTLASS's headers are
        # installed (`linear.cute_gemm`).
        served = (name in ("linear", "linear_residual") and weight_rows < linear_tiles.WIDE_N
                  or name == "norm_qkv_rope" and not shapes.get("qk_norm") and not shapes.get("norm_weight"))
        cute = [cute_gemm.BUCKET] if target == "sm_90" and served and cutlass_available() else []
        assert [k.meta["bucket"] for k in buckets if k.meta.get("cute")] == cute
        assert [k.meta["bucket"] for k in buckets] == gemv + [b for t in linear_tiles.tiles_for(weight_rows)
                                                              for b in [t.name] * (1 + (t.name in cute))]
        uses_tma = any(k.meta.get("tma") for k in buckets)
        # The TMA norm GEMMs need the norm weight folded, and norm_swiglu an interleaved W_gu.
        assert uses_tma == (target in tma.TMA_TARGETS and not shapes.get("norm_weight")
                            and shapes.get("block", 1) > 0), target
        # The fused norm GEMMs' small bucket reads the row-scale pre-pass's scales on every target.
        prescaled = any(k.meta.get("row_scale_input") for k in buckets)
        assert prescaled == name.startswith("norm_"), target
        assert len(mine) == len(buckets) + ((uses_tma and name.startswith("norm_")) or prescaled)
        for kernel in mine:
            # (the CUDA kernels' parameters are checked against their source by test_gemv.py)
            assert isinstance(kernel, NvccKernel) or set(kernel.signature) == set(kernel.fn.arg_names)
            if "bucket" in kernel.meta and not kernel.meta.get("tma") and not kernel.meta.get("cute"):
                assert len(kernel.meta["grid"]) == 3 and kernel.meta["grid"][2] == str(kernel.meta["split_k"])
            cubin = compile_cubin(kernel, target)
            assert cubin.binary.startswith(b"\x7fELF") and cubin.name == kernel_name(kernel)
            assert cubin.shared_bytes <= MAX_SHARED_BYTES[target], (kernel.meta, target, cubin.shared_bytes)
            # Device-made TMA descriptors live in global scratch; nothing else asks for any.
            assert (cubin.global_scratch > 0) == bool(kernel.meta.get("tma")), (kernel.meta, target)


@pytest.mark.parametrize("name", list(LLAMA))
def test_aot_llama_shapes(request, name):
    in_mode(request, False, lambda: check_cubins(name, LLAMA[name], list(MAX_SHARED_BYTES)))


def test_aot_tp2_gate_up_gets_the_deep_pipeline_on_sm_90(request):
    """TP 2's gate/up (7,168 intermediate rows a rank) up to 64 rows: 128-deep K tiles of 128
    weight rows, 48 KiB a stage, get 2 stages on sm_80/sm_89 and 4 on sm_90/sm_100
    (`linear.tiles.pipelined`), 8 warps and the pre-pass's row scales, and every cubin fits its
    target's shared memory."""
    shapes = {"K": 4096, "I": 7168, "block": 64}

    def body():
        check_cubins("norm_swiglu", shapes, list(MAX_SHARED_BYTES))
        small = [k for k in norm_swiglu_kernels.aot_kernels("bfloat16", shapes) if k.meta.get("bucket") == "small"]
        assert [(k.targets, k.num_stages) for k in small] == [(("sm_80", "sm_89"), 2), (("sm_90", "sm_100"), 4)]
        assert all(k.num_warps == 8 and k.meta["row_scale_input"] for k in small)
    in_mode(request, False, body)


def test_pipelined_splits_a_kernel_only_where_the_depths_differ():
    kernel = next(k for k in norm_swiglu_kernels.aot_kernels("bfloat16", LLAMA["norm_swiglu"])
                  if not k.meta.get("gemv"))
    (one,) = linear_tiles.pipelined(kernel, 16, 64, 128, 2, cap=3)      # 20 KiB a stage: 3 everywhere
    assert one.targets == kernel.targets and one.num_stages == 3
    ada_only = dataclasses.replace(kernel, targets=("sm_89",))
    (shallow,) = linear_tiles.pipelined(ada_only, 64, 128, 128, 2, cap=3)
    assert shallow.targets == ("sm_89",) and shallow.num_stages == 2


@pytest.mark.parametrize("name", list(ALL_OPTIONAL))
def test_aot_all_optional_inputs(request, name):
    in_mode(request, False, lambda: check_cubins(name, ALL_OPTIONAL[name], ["sm_90"]))


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
