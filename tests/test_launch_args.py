"""Every plugin's driver launcher (`launch.py`) passes its AOT kernels what `kernels.run`
passes the same kernels through Triton's JIT: same kernels in the same order, same grids, same
arguments, and the AOT variant whose constexprs are the JIT call's.

`run()` runs under Triton's interpreter (conftest.py sets TRITON_INTERPRET on a machine without
a GPU) with every JIT launch recorded; the launcher runs on the same inputs with recording
stand-ins for the loaded kernels (`.launch(grid, args, stream)`, as `CudaKernel` has), since
the driver call itself needs a GPU. Tensor arguments are compared by address: those of the
op's inputs and output must be the same, and buffers that `run()` allocates for itself (the
split-KV workspaces, attention_o_proj's attention output) must map one-to-one onto the
executor's scratch buffers, big enough to hold them. Scalars are compared by value.

The ops come from the plans of engines built for ["cpu", "sm_89"], with the cubin compiler
replaced by a stand-in (the manifest's kernel index, signatures and launch metadata are the
real ones), driven as the CUDA executor drives them: the step's inputs and activations in the
arena, the launcher's scratch buffers sized by its `scratch_bytes`, through a prefill step
(GEMM prefill bucket), a mixed step (small bucket) and a decode step (decode bucket; split-KV
with 512 keys per sequence, plain with 128). Variants that fused plans never use (norm
weights not folded, an rms_norm without weight, biases, attention writing its own k and v, a
standalone `attention`) are checked on the same steps' tensors with the kernels of the
plugin's `aot_kernels`.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kiln.plugins.registry import BUILTIN

PLUGINS_DIR = Path(__file__).resolve().parents[1] / "plugins"
# The plan ops' launchers; the all_reduce collective's has its own test (test_custom_all_reduce.py).
LAUNCHED_OPS = sorted(p.parent.name for p in PLUGINS_DIR.glob("*/launch.py") if p.parent.name in BUILTIN)
# Every kernels module is imported here, while TRITON_INTERPRET is set (@triton.jit makes
# interpreted kernels then), so none is first imported during the builds below, which unset it.
KERNELS = {p.parent.name: importlib.import_module(f"kiln.plugins.{p.parent.name}.kernels")
           for p in sorted(PLUGINS_DIR.glob("*/kernels.py"))}
LAUNCHERS = {op: importlib.import_module(f"kiln.plugins.{op}.launch") for op in LAUNCHED_OPS}

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import kiln.builder.kernels as builder_kernels  # noqa: E402
from interpreted_launch import interpreted_only  # noqa: E402
from kiln.builder.build import build_engine  # noqa: E402
from kiln.builder.config import BuildConfig  # noqa: E402
from kiln.engines.manifest import PlanEntry  # noqa: E402
from kiln.plugins import get_plugin  # noqa: E402
from kiln.plugins.aot import AotKernel, Cubin, kernel_name  # noqa: E402
from kiln.plugins.nvcc import NvccKernel  # noqa: E402
from kiln.runtime.cuda_executor import scratch_bytes  # noqa: E402
from kiln.runtime.engine import Engine, load_engine  # noqa: E402
from kiln.runtime.executor import CpuExecutor  # noqa: E402
from kiln.runtime.step import SequenceChunk, pack_step  # noqa: E402

pytestmark = interpreted_only()

# sm_89: the targets' launchers are the same, and sm_89 runs the kernels run() does; the ones
# only sm_90 and later get (TMA GEMMs, 128-row prefill attention) are run by test_tma_launch.py.
TARGET = "sm_89"
NUM_BLOCKS = 96
# Constexprs that only say whether the kernel runs in the interpreter: run() sets them there,
# the AOT kernels never.
INTERPRETER_ONLY = {"UPCAST_DOT", "INTERPRETER"}
POINTER_DTYPES = {"*fp32": torch.float32, "*fp16": torch.float16, "*bf16": torch.bfloat16, "*i32": torch.int32,
                  "*fp8e4nv": torch.float8_e4m3fn}
# (family, dtype, max_seq_len, hidden size, KV cache dtype): 512 keys per sequence make decode steps split the
# keys, 128 do not; a 512-wide model makes the decode and mixed steps' GEMMs split K.
ENGINES = [("llama3", "bfloat16", 512, 64, "auto"), ("qwen3", "float32", 128, 64, "auto"),
           ("qwen2", "float32", 128, 64, "auto"), ("llama3", "bfloat16", 128, 512, "auto"),
           ("gemma3", "bfloat16", 512, 64, "auto"), ("llama3", "bfloat16", 512, 64, "fp8")]  # last: an e4m3 KV cache
# Ops a family's plans never hold: Gemma 3's post-norms sit between attention, its projections
# and the residual adds, so none of those fuse; only Gemma 3 soft-caps its logits.
UNUSED_OPS = {"gemma3": {"attention_o_proj", "linear_residual"}}
LLAMA_UNUSED_OPS = {"add", "softcap"}


# -- recording ---------------------------------------------------------------------------------

@dataclass
class JitLaunch:
    fn: InterpretedFunction
    grid: tuple[int, int, int]
    args: dict            # every kernel parameter by name
    options: dict         # num_warps, num_stages, ... as run() gave them


@dataclass
class DriverLaunch:
    kernel: AotKernel
    grid: tuple[int, int, int]
    args: list


def _grid3(grid) -> tuple[int, int, int]:
    grid = tuple(int(g) for g in grid)
    assert 1 <= len(grid) <= 3, grid
    return grid + (1,) * (3 - len(grid))


@contextlib.contextmanager
def recording_jit():
    """Record every interpreted kernel launch (then run it)."""
    launches: list[JitLaunch] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        signature = inspect.signature(self.fn)
        params = signature.parameters
        bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
        options = {k: v for k, v in kwargs.items() if k not in params}
        launches.append(JitLaunch(self, _grid3(grid(bound.arguments) if callable(grid) else grid),
                                  dict(bound.arguments), options))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


class RecordingKernel:
    """Stands in for a loaded `CudaKernel` (`signature`: the engine's kernel index entry):
    checks what the driver call would need, a 3-axis grid of ints and one value of the right
    kind per non-constexpr parameter, and records the launch."""

    def __init__(self, kernel: AotKernel, signature: list[str], launches: list[DriverLaunch]):
        assert signature == [t for t in kernel.signature.values() if t != "constexpr"], kernel.fn.__name__
        self.kernel, self.signature, self.launches = kernel, signature, launches

    def launch(self, grid, args, stream=0):
        name = self.kernel.fn.__name__
        assert len(grid) == 3 and all(isinstance(g, int) and g >= 1 for g in grid), (name, grid)
        assert len(args) == len(self.signature), f"{name}: {len(args)} args for {self.signature}"
        for t, a in zip(self.signature, args):
            if t.startswith(("*", "i", "u")):
                assert isinstance(a, int) and not isinstance(a, bool), (name, t, a)
            else:
                assert isinstance(a, (int, float)), (name, t, a)
        self.launches.append(DriverLaunch(self.kernel, tuple(grid), list(args)))


# -- the comparison ----------------------------------------------------------------------------

def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def compare(op: str, jit: list[JitLaunch], driver: list[DriverLaunch], external: list[torch.Tensor],
            scratch: dict[str, torch.Tensor]) -> None:
    """Assert that the launcher's launches are run()'s: see the module docstring."""
    assert [d.kernel.fn.__name__ for d in driver] == [j.fn.__name__ for j in jit], f"{op}: kernels launched"
    outside = {_storage(t) for t in external}
    regions = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in scratch.values()]
    temps: dict[int, tuple[int, int]] = {}  # run()'s buffer -> (the launcher's address, bytes)
    for i, (j, d) in enumerate(zip(jit, driver)):
        where = f"{op}: launch {i} ({j.fn.__name__})"
        assert d.kernel.fn is j.fn, where
        assert d.grid == j.grid, f"{where}: grid"
        assert set(j.args) == set(d.kernel.signature), f"{where}: parameters"
        assert j.options.get("num_warps", 4) == d.kernel.num_warps, f"{where}: num_warps"
        if "num_stages" in j.options:
            assert j.options["num_stages"] == d.kernel.num_stages, f"{where}: num_stages"
        passed = iter(d.args)
        for name, kind in d.kernel.signature.items():
            value = j.args[name]
            if kind == "constexpr":
                if name not in INTERPRETER_ONLY:
                    assert value == d.kernel.constexprs[name], f"{where}: constexpr {name}"
                continue
            got = next(passed)
            if not kind.startswith("*"):
                assert not isinstance(value, torch.Tensor) and got == value, f"{where}: {name} = {got}, run() {value}"
                continue
            if value is None:
                # An absent pointer: the JIT makes it a constexpr None, a kernel compiled with
                # the parameter gets a null pointer (and the same constexprs leave it unread).
                assert got == 0, f"{where}: {name} is None in run() but {got:#x} here"
                continue
            assert isinstance(value, torch.Tensor), f"{where}: {name} is {value!r} in run()"
            assert value.dtype == POINTER_DTYPES[kind], f"{where}: {name} is {value.dtype}, signature {kind}"
            if _storage(value) in outside:
                assert got == value.data_ptr(), f"{where}: {name} points elsewhere"
            else:
                # A buffer run() allocated (the recorded launches keep it alive, so its address
                # is its own): the launcher's must be inside a scratch buffer, the same wherever
                # run() passes the same buffer, and overlap no other.
                nbytes = value.numel() * value.element_size()
                assert temps.setdefault(value.data_ptr(), (got, nbytes))[0] == got, f"{where}: {name} is another buffer"
                assert any(lo <= got and got + nbytes <= hi for lo, hi in regions), \
                    f"{where}: {name} ({nbytes} bytes) is not inside a scratch buffer"
                assert all(a + n <= got or got + nbytes <= a for p, (a, n) in temps.items() if p != value.data_ptr()), \
                    f"{where}: {name} overlaps another of run()'s buffers"
        assert next(passed, None) is None, f"{where}: extra arguments"
    assert len(driver) == len(jit), f"{op}: {len(driver)} launches, run() made {len(jit)}"


def check_op(op: str, kernels: list[AotKernel], signatures: list[list[str]], metas: list[dict], inputs: list,
             attrs: dict, out: torch.Tensor, dims: dict[str, int], scratch: dict[str, torch.Tensor],
             external: list[torch.Tensor]) -> list[tuple[str, tuple[int, int, int]]]:
    """Run the op both ways and compare; returns the launches' kernel names and grids."""
    with recording_jit() as jit:
        KERNELS[op].run(inputs, attrs, out)
    driver: list[DriverLaunch] = []
    stand_ins = [RecordingKernel(k, s, driver) for k, s in zip(kernels, signatures)]
    LAUNCHERS[op].launch(stand_ins, metas, inputs, attrs, out, dims, 0, scratch)
    compare(op, jit, driver, [t for t in inputs if t is not None] + [out] + external, scratch)
    return [(launch.fn.fn.__name__, launch.grid) for launch in jit]


# -- engines and steps -------------------------------------------------------------------------

@dataclass
class Built:
    engine: Engine
    aot: dict[str, AotKernel]   # kernel key -> the AotKernel it was compiled from


def build_without_compiler(checkpoint: Path, output: Path, dtype: str, max_seq_len: int, kv_cache_dtype: str) -> Built:
    """Build for ["cpu", TARGET] with a stand-in for the cubin compiler (the interpreter cannot
    compile); everything else in the engine is what build-engine writes. Its own kernel cache,
    so every kernel goes through the stand-in and is recorded."""
    aot: dict[str, AotKernel] = {}

    def fake_compile(kernel: AotKernel | NvccKernel, target: str) -> Cubin:
        aot[builder_kernels.kernel_key(kernel, target)] = kernel
        return Cubin(kernel_name(kernel), b"\x7fELF stand-in", 0, kernel.num_warps)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder_kernels, "compile_cubin", fake_compile)
        mp.setenv("KILN_CACHE", str(output.with_name(output.name + "-cache")))  # never the real cache
        mp.delenv("TRITON_INTERPRET")        # build-engine refuses GPU targets in interpreter mode
        build_engine(checkpoint, output, BuildConfig(dtype=dtype, max_batch_size=32, max_seq_len=max_seq_len,
                                                     max_num_tokens=80, kv_block_size=16,
                                                     targets=("cpu", TARGET), kv_cache_dtype=kv_cache_dtype))
    return Built(load_engine(output), aot)


def scenario(block_size: int, blocks_per_seq: int) -> list[tuple[str, list[SequenceChunk]]]:
    """Three steps over 3 sequences, each in its own interleaved blocks: a prefill of 70 tokens
    with every logit of one prompt, a mixed step of 22 tokens and a pure decode step."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (40, 30, 20)]
    tables = [list(range(s, NUM_BLOCKS, 3))[::-1][:blocks_per_seq] for s in range(3)]
    return [
        ("prefill", [SequenceChunk(prompts[0], 0, tables[0]),
                     SequenceChunk(prompts[1], 0, tables[1], all_logits=True)]),
        ("mixed", [SequenceChunk([7], 40, tables[0]), SequenceChunk([8], 30, tables[1]),
                   SequenceChunk(prompts[2], 0, tables[2])]),
        ("decode", [SequenceChunk([9], 41, tables[0]), SequenceChunk([10], 31, tables[1]),
                    SequenceChunk([11], 20, tables[2])]),
    ]


def allocate_scratch(engine) -> dict[str, torch.Tensor]:
    """The CUDA executor's scratch buffers, on the CPU, sized by its own rule."""
    sizes = scratch_bytes(engine, [LAUNCHERS[op.spec.name] for op in engine.plan])
    return {name: torch.empty(nbytes, dtype=torch.uint8) for name, nbytes in sizes.items()}


def node_shapes(engine, entry: PlanEntry) -> dict:
    """The plugin's `compile_shapes` for one plan entry, from the manifest's tensors and the weights."""
    shapes = {name: t.shape for name, t in engine.manifest.tensors.items()}
    shapes.update((name, tuple(w.shape)) for name, w in engine.weights.items())
    inputs = {name: None if t is None else shapes[t] for name, t in entry.inputs.items()}
    return get_plugin(entry.op).compile_shapes(inputs, entry.attrs, engine.manifest.kv.block_size)


def _json(meta: dict) -> dict:
    return json.loads(json.dumps(meta))  # as the engine file gives it to the executor (tuples become lists)


def check_variant(op: str, dtype: str, shapes: dict, inputs: list, attrs: dict, out: torch.Tensor, dims: dict,
                  scratch: dict, external: list) -> list[tuple[str, tuple[int, int, int]]]:
    kernels = [k for k in KERNELS[op].aot_kernels(dtype, shapes) if k.targets is None or TARGET in k.targets]
    signatures = [[t for t in k.signature.values() if t != "constexpr"] for k in kernels]
    return check_op(op, kernels, signatures, [_json(k.meta) for k in kernels], inputs, attrs, out, dims, scratch,
                    external)


def variants(op: str, engine, entry: dict, args: list, attrs: dict, out: torch.Tensor):
    """(plugin, shapes, inputs, attrs, out) for what fused plans leave out, from one plan op's
    tensors: optional inputs given, and attention on its own."""
    g = torch.Generator().manual_seed(1)
    dtype = out.dtype
    randn = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    # Norm weights that stay norm weights (not folded into a projection) are float32 in models.
    norm_randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    shapes = node_shapes(engine, entry)
    if op == "rms_norm":
        # The final norm keeps its weight; the ones folded away would have none.
        yield op, shapes, [args[0], norm_randn(args[0].shape[1]) if args[1] is None else None], attrs, out
    elif op == "linear":
        yield op, {**shapes, "bias": True}, [args[0], args[1], randn(args[1].shape[0])], attrs, out
    elif op == "linear_residual":
        yield op, {**shapes, "bias": True}, [args[0], args[1], randn(args[1].shape[0]), args[3]], attrs, out
    elif op == "norm_swiglu":
        yield op, {**shapes, "norm_weight": True}, [args[0], randn(args[0].shape[1]), args[2]], attrs, out
    elif op == "norm_qkv_rope":
        x, _, w_qkv, _, _, _, *rest = args
        d = attrs["head_dim"]
        yield op, {**shapes, "norm_weight": True, "bias": True, "qk_norm": True}, \
            [x, randn(x.shape[1]), w_qkv, randn(w_qkv.shape[0]), norm_randn(d), norm_randn(d), *rest], attrs, out
    elif op == "attention_o_proj":
        q, _, _, *cache, w_o, _, residual, kv_scales = args[:12]  # the FP8 scale inputs (None here) follow
        kv = attrs["num_kv_heads"] * attrs["head_dim"]
        k, v = randn(q.shape[0], kv), randn(q.shape[0], kv)
        yield op, {**shapes, "bias": True}, [q, k, v, *cache, w_o, randn(w_o.shape[0]), residual, kv_scales], \
            attrs, out
        attention_shapes = {name: shapes[name] for name in ("heads", "kv_heads", "head_dim", "block_size", "fp8_kv")}
        attention_attrs = {name: attrs[name] for name in ("layer", "num_heads", "num_kv_heads", "head_dim", "scale",
                                                          "window")}
        yield "attention", attention_shapes, [q, k, v, *cache, kv_scales], attention_attrs, torch.empty_like(q)
        yield "attention", attention_shapes, [q, None, None, *cache, kv_scales], attention_attrs, torch.empty_like(q)


@pytest.fixture(scope="module")
def engines(factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("launch-args")
    return {(family, dtype, seq, hidden, kv): build_without_compiler(
        factory.checkpoint(family, hidden_size=hidden, intermediate_size=2 * hidden),
        root / f"{family}-{dtype}-{seq}-{hidden}-{kv}", dtype, seq, kv) for family, dtype, seq, hidden, kv in ENGINES}


@pytest.mark.parametrize("family,dtype,max_seq_len,hidden,kv_cache_dtype", ENGINES)
def test_launchers_pass_what_run_passes(engines, family, dtype, max_seq_len, hidden, kv_cache_dtype):
    built = engines[family, dtype, max_seq_len, hidden, kv_cache_dtype]
    engine, manifest = built.engine, built.engine.manifest
    executor = CpuExecutor(engine, NUM_BLOCKS)
    scratch = allocate_scratch(engine)
    checked: dict[str, set] = {}
    attention_paths = set()
    for step_name, chunks in scenario(engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence):
        dims, values = executor._begin(pack_step(chunks, engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence), ())
        external = [executor.arena, executor.kv_cache, *engine.weights.values()]
        for op, entry in zip(engine.plan, manifest.plan):
            name = op.spec.name
            keys = entry.kernel_keys[TARGET]
            assert all(manifest.kernels[k].target == TARGET for k in keys)
            args = [None if t is None else values[t] if t in values else engine.weights[t] for t in op.inputs.values()]
            out = executor._view(op.output, dims)
            launches = check_op(name, [built.aot[k] for k in keys], [list(manifest.kernels[k].signature) for k in keys],
                                [manifest.kernels[k].launch for k in keys], args, op.attrs, out, dims, scratch,
                                external)
            checked.setdefault(name, set()).add(step_name)
            if name in ("attention_o_proj", "attention"):
                # (launches, whether attention split its keys)
                attention_paths.add((len(launches), any(fn == "attention_kernel" and grid[2] > 1
                                                        for fn, grid in launches)))
            for v_op, shapes, v_inputs, v_attrs, v_out in variants(name, engine, entry, args, op.attrs, out):
                check_variant(v_op, dtype, shapes, v_inputs, v_attrs, v_out, dims, scratch,
                              external + [t for t in v_inputs if t is not None])
                checked.setdefault(f"{v_op} variant", set()).add(step_name)
            values[op.output] = out
    executor.close()
    # Every plugin with a launcher that the family's plans use was checked, in every step.
    unused = UNUSED_OPS.get(family, LLAMA_UNUSED_OPS)
    assert {name.removesuffix(" variant") for name in checked} == set(LAUNCHED_OPS) - unused
    assert all(steps == {"prefill", "mixed", "decode"} for steps in checked.values()), checked
    # attention (then the GEMM, fused); the mixed step's two leading decode rows add the decode kernel
    # before the prefill one. Tables of 512 keys split a decode step's keys (the mixed step's decode rows
    # too), each split kernel merging its parts.
    kernels = 1 if "attention_o_proj" in unused else 2
    split = max_seq_len > 256
    assert attention_paths == {(kernels, False), (kernels + 1, split), (kernels, split)}
    split_buckets = {k.launch["bucket"] for k in manifest.kernels.values() if k.launch.get("split_k", 1) > 1}
    if hidden >= 512:
        assert split_buckets == {"decode", "medium", "large"}   # "small" runs K unsplit, 6 stages deep


def test_grid_expressions_take_min_and_the_gpus_sm_count():
    """A persistent kernel's grid is min(tiles, SMS): one program per SM at most."""
    from kiln.plugins.driver_launch import grid
    assert grid("min(cdiv(T, 128) * 16, SMS)", {"T": 4096, "SMS": 132}) == (132, 1, 1)
    assert grid("min(cdiv(T, 128) * 16, SMS)", {"T": 300, "SMS": 132}) == (48, 1, 1)
    assert grid(["cdiv(T, 16)", "8", "1"], {"T": 17}) == (2, 8, 1)
    with pytest.raises(ValueError, match="not supported"):
        grid("max(T, 2)", {"T": 1})
