"""Engines for GPU targets build on this CPU-only machine: every kernel of the plan is compiled
ahead of time for every target into the engine file, and the runtime refuses an engine whose
targets do not include this machine."""
from __future__ import annotations

import json
import re

import onnx
import pytest
from click.testing import CliRunner

from kiln.builder.build import build_from_model
from kiln.builder.cli import inspect_engine
from kiln.builder.config import BuildConfig
from kiln.builder.kernels import KernelError
from kiln.builder.onnx_export import export_onnx
from gpu_build import build_cli, compiled_json
from kiln.runtime.engine import EngineLoadError, load_engine
from kiln.engines.format import read_engine_file
from kiln.plugins.aot import MAX_SHARED_BYTES
from test_gelu_model import gelu_model

GPU_TARGETS = ["sm_80", "sm_89", "sm_90", "sm_100"]


@pytest.fixture(scope="module")
def all_targets(factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-targets")
    ckpt = factory.checkpoint("qwen3")
    result = build_cli(ckpt, root / "engine", ["cpu", *GPU_TARGETS], root / "cache")
    assert result.returncode == 0, result.stderr + result.stdout
    return ckpt, root, result


def test_every_plan_kernel_is_compiled_for_every_target(all_targets):
    _, root, result = all_targets
    m = read_engine_file(root / "engine" / "rank0.engine").manifest
    assert m.targets == ("cpu", *GPU_TARGETS)
    for op in m.plan:
        assert set(op.kernel_keys) == set(GPU_TARGETS), op.op
        for target, keys in op.kernel_keys.items():
            assert keys and all(m.kernels[k].target == target for k in keys)
            assert all(m.kernels[k].shared_bytes <= MAX_SHARED_BYTES[target] for k in keys), op.op
    blobs = read_engine_file(root / "engine" / "rank0.engine").kernels
    assert all(blob[:4] == b"\x7fELF" for blob in blobs.values())
    assert {e.plugin for e in m.kernels.values()} == {op.op for op in m.plan}
    assert f"kernels     {len(blobs)} cubins per rank" in result.stdout
    shown = CliRunner().invoke(inspect_engine, [str(root / "engine")]).output
    assert all(f"cubins for {t}" in shown for t in GPU_TARGETS)


def test_engine_with_cpu_among_its_targets_runs_here(all_targets):
    _, root, _ = all_targets
    engine = load_engine(root / "engine")
    assert engine.manifest.dtype == "bfloat16"


def test_gpu_only_engine_is_refused_on_the_cpu(all_targets):
    ckpt, root, _ = all_targets
    # Same kernels as before: they come from the content-hashed cache.
    result = build_cli(ckpt, root / "sm89", ["sm_89"], root / "cache")
    assert result.returncode == 0, result.stderr
    with pytest.raises(EngineLoadError, match="engine built for sm_89; this machine needs cpu: rebuild with --target cpu"):
        load_engine(root / "sm89")


def test_onnx_export_lists_each_ops_kernels_per_target(all_targets, tmp_path):
    _, root, _ = all_targets
    (export,) = export_onnx(root / "engine", tmp_path / "gpu.onnx")
    onnx.checker.check_model(str(export.path), full_check=True)  # a bfloat16 graph
    model = onnx.load(export.path)
    m = read_engine_file(root / "engine" / "rank0.engine").manifest
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["kiln.kernels"]).keys() == m.kernels.keys()
    writers = {n.name: {p.key: p.value for p in n.metadata_props} for n in model.graph.node if n.metadata_props}
    for op in m.plan:
        for target, keys in op.kernel_keys.items():
            listed = writers[op.output][f"kiln.kernels.{target}"]
            assert listed == ", ".join(f"{m.kernels[k].entry} {k}" for k in keys)


OVERSIZED = """
import json
from kiln.builder.kernels import KernelError, check_shared_memory
from kiln.plugins.aot import AotKernel, absent_as_none, compile_cubin, pointer_params
from kiln.plugins.linear.kernels import linear_kernel
signature = {"x_ptr": "*bf16", "x_scale_ptr": "constexpr", "w_ptr": "*bf16", "w_scale_ptr": "constexpr",
             "bias_ptr": "constexpr", "residual_ptr": "constexpr", "out_ptr": "*bf16", "part_ptr": "constexpr",
             "count_ptr": "constexpr", "T": "i32", "N": "constexpr", "K": "constexpr", "BLOCK_M": "constexpr",
             "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "UPCAST_DOT": "constexpr", "SPLIT_K": "constexpr"}
constexprs = {"N": 4096, "K": 4096, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "UPCAST_DOT": False, "SPLIT_K": 1}
kernel = AotKernel(linear_kernel, signature, absent_as_none(signature, constexprs), num_warps=8, num_stages=3,
                   aligned=pointer_params(signature))
verdicts = {}
for target in ("sm_90", "sm_89"):
    cubin = compile_cubin(kernel, target)
    try:
        check_shared_memory(cubin, target, "linear")
        verdicts[target] = [cubin.shared_bytes, "accepted"]
    except KernelError as e:
        verdicts[target] = [cubin.shared_bytes, f"refused: {e}"]
print(json.dumps(verdicts))
"""


def test_a_cubin_that_needs_more_shared_memory_than_its_target_gives_is_refused():
    """128 x 128 bf16 tiles of x and W, 128 deep, 3 stages: sm_90 keeps 3 buffers of each (192
    KiB, within its 227 KiB), sm_89 2 (128 KiB, more than its 99 KiB). Compiled in a process
    without TRITON_INTERPRET, which would make the kernel an interpreter stand-in."""
    verdicts = compiled_json(OVERSIZED)
    (shared90, verdict90), (shared89, verdict89) = verdicts["sm_90"], verdicts["sm_89"]
    assert verdict90 == "accepted" and shared90 <= MAX_SHARED_BYTES["sm_90"]
    assert shared89 > MAX_SHARED_BYTES["sm_89"]
    assert re.match(f"refused: plugin 'linear'.*needs {shared89:,} bytes of shared memory.*sm_89 gives "
                    f"\\(101,376\\).*would not load", verdict89), verdict89


def test_op_without_gpu_kernel_is_a_build_error_naming_it(tmp_path):
    cfg = BuildConfig(max_batch_size=4, max_seq_len=32, max_num_tokens=32, kv_block_size=4, targets=("sm_90",))
    with pytest.raises(KernelError, match=r"op 'gelu' in module 'model.layers.0.mlp' has no GPU kernel"):
        build_from_model(gelu_model(), tmp_path / "gelu", cfg, {"architecture": "test-gelu"})
    assert not (tmp_path / "gelu").exists()


def test_gemma3_engine_compiles_for_sm_90_and_sm_80(factory, tmp_path):
    """Every op of Gemma 3's plan (the GeGLU norm_swiglu, the scaled embedding, the post-norms and
    their residual adds, the soft cap) has cubins for both targets, and the engine still runs here."""
    result = build_cli(factory.checkpoint("gemma3"), tmp_path / "engine", ["cpu", "sm_90", "sm_80"], tmp_path / "cache")
    assert result.returncode == 0, result.stderr + result.stdout
    m = read_engine_file(tmp_path / "engine" / "rank0.engine").manifest
    assert {"softcap", "add", "norm_swiglu", "norm_qkv_rope", "attention", "embedding"} <= {op.op for op in m.plan}
    for op in m.plan:
        assert set(op.kernel_keys) == {"sm_90", "sm_80"}, op.op
        assert all(keys for keys in op.kernel_keys.values()), op.op
    blobs = read_engine_file(tmp_path / "engine" / "rank0.engine").kernels
    assert all(blob[:4] == b"\x7fELF" for blob in blobs.values())
    assert load_engine(tmp_path / "engine").manifest.model["architecture"] == "Gemma3ForCausalLM"


@pytest.fixture(scope="module")
def fp8_cache(tmp_path_factory):
    """One cubin cache for the FP8 builds: the static build compiles only its pre-passes anew."""
    return tmp_path_factory.mktemp("fp8-cache")


@pytest.mark.parametrize("activations", ["per-token", "static"])
def test_fp8_engine_compiles_for_the_fp8_targets(activations, factory, fp8_cache, tmp_path):
    """Every FP8 op of a W8A8 plan (per token with an e4m3 KV cache, static with a bf16 one) gets its
    FP8 kernels for sm_89 and sm_90 through the builder (the plan's compile shapes are what the
    kernels take): one GEMM per bucket and the quantize pre-pass, the weights stored in e4m3. With
    static activation scales (--activation-scales static here: o_proj's and down's) the pre-pass is the one
    that takes the op's scale, and so are the FP8 GEMVs (meta "static"); and
    norm_swiglu's decode tiles and attention_o_proj's decode kernels hand the next GEMM its input in
    e4m3 (`linear.fp8`'s handoff, meta "handoff"), and at one row norm_swiglu's GEMV stages it for down's,
    which reads it so (meta "prestaged", `linear.gemv.one_row_handoff`)."""
    from kiln.plugins.fp8 import FP8
    targets = ["sm_89", "sm_90"]
    extra = ["--quantization", "fp8"]
    if activations == "static":
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("The capital of France is Paris.\nOne, two, three, four.\n")
        extra += ["--calibration-prompts", str(prompts), "--activation-scales", "static"]
    else:
        extra += ["--kv-cache-dtype", "fp8"]
    result = build_cli(factory.checkpoint("qwen3"), tmp_path / "engine", targets, fp8_cache, extra=extra,
                       timeout=1200)
    assert result.returncode == 0, result.stderr + result.stdout
    ef = read_engine_file(tmp_path / "engine" / "rank0.engine")
    m = ef.manifest
    assert m.quantization == "fp8" and m.targets == tuple(targets)
    fp8_ops = [op for op in m.plan if any(n.endswith("_scale") and t is not None for n, t in op.inputs.items())]
    assert {op.op for op in fp8_ops} == {"norm_qkv_rope", "attention_o_proj", "norm_swiglu", "linear_residual"}
    with_gemv = set()
    for op in fp8_ops:
        # Calibration gives static scales to o_proj and down only (builder.passes.quantize.PER_TOKEN_OPS).
        static = activations == "static" and op.op in ("attention_o_proj", "linear_residual")
        assert any(n.endswith("_input_scale") and t for n, t in op.inputs.items()) == static
        for target in targets:
            kernels = [m.kernels[k] for k in op.kernel_keys[target]]
            pre_pass = [k for k in kernels if k.entry == "quantize_rows_kernel"]
            assert len(pre_pass) == 1, (op.op, target, [k.entry for k in kernels])
            assert bool(pre_pass[0].launch.get("static")) == static
            # norm_swiglu's GEMV, decode and small tiles; attention_o_proj's decode kernels, unsplit and split,
            # and on sm_90 their EARLY builds for one sequence too.
            handoffs = [k for k in kernels if k.launch.get("handoff")]
            early = 2 if target == "sm_90" else 0
            handing = {"norm_swiglu": 3, "attention_o_proj": 2 + early}.get(op.op, 0) if activations == "static" else 0
            assert len(handoffs) == handing, (op.op, target, [k.entry for k in handoffs])
            gemvs = [k for k in kernels if k.launch.get("gemv")]
            assert all(bool(k.launch.get("static")) == static for k in gemvs), (op.op, target)
            # down's x staged by the SwiGLU GEMV; o_proj's on sm_90 by the EARLY decode attention.
            staged_by = {"linear_residual": targets, "attention_o_proj": ["sm_90"]}.get(op.op, [])
            prestaged = activations == "static" and target in staged_by
            assert all(bool(k.launch.get("prestaged")) == prestaged for k in gemvs), (op.op, target)
            with_gemv.update(op.op for _ in gemvs)
    assert with_gemv == {"attention_o_proj", "norm_swiglu", "linear_residual"}   # qwen3's q/k norm: no qkv GEMV
    layers = sum(op.op == "norm_qkv_rope" for op in m.plan)
    assert layers and sum(w.dtype == FP8 for w in ef.weights.values()) == 4 * layers
