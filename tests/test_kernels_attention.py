"""Triton kernels of attention, attention_o_proj, embedding, rms_norm and take_rows: each
`run` against its plugin's PyTorch reference under Triton's interpreter on the CPU, and every
kernel of `aot_kernels` compiled to a cubin for every GPU target."""
import os

# Must precede the first `import triton` anywhere: @triton.jit reads it when it decorates.
os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from gpu_build import compiled_json  # noqa: E402
from kiln.plugins.add import SPEC as ADD  # noqa: E402
from kiln.plugins.add import kernels as add_kernels  # noqa: E402
from kiln.plugins.attention import SPEC as ATTENTION  # noqa: E402
from kiln.plugins.attention import kernels as attention_kernels  # noqa: E402
from kiln.plugins.attention.reference import write_kv  # noqa: E402
from kiln.plugins.attention_o_proj import SPEC as ATTENTION_O_PROJ  # noqa: E402
from kiln.plugins.aot import MAX_SHARED_BYTES  # noqa: E402
from kiln.plugins.attention_o_proj import kernels as attention_o_proj_kernels  # noqa: E402
from kiln.plugins.embedding import SPEC as EMBEDDING  # noqa: E402
from kiln.plugins.embedding import kernels as embedding_kernels  # noqa: E402
from kiln.plugins.linear import kernels as linear_kernels  # noqa: E402
from kiln.plugins.rms_norm import SPEC as RMS_NORM  # noqa: E402
from kiln.plugins.rms_norm import kernels as rms_norm_kernels  # noqa: E402
from kiln.plugins.softcap import SPEC as SOFTCAP  # noqa: E402
from kiln.plugins.softcap import kernels as softcap_kernels  # noqa: E402
from kiln.plugins.take_rows import SPEC as TAKE_ROWS  # noqa: E402
from kiln.plugins.take_rows import kernels as take_rows_kernels  # noqa: E402
from kiln.runtime.step import SequenceChunk, pack_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# If another module imported these kernels before TRITON_INTERPRET was set, they were built for
# the GPU: then test_checks_in_fresh_process runs this file's checks in a clean interpreter.
INTERPRETED = all(isinstance(k, InterpretedFunction) for k in (
    attention_kernels.attention_kernel, rms_norm_kernels._rms_norm_kernel,
    take_rows_kernels._gather_rows_kernel, linear_kernels.linear_kernel, softcap_kernels._softcap_kernel,
    add_kernels._add_kernel))
# The interpreter passes scalar arguments as 1-element arrays and converts them with int()
# for loops with runtime bounds, which numpy deprecates; nothing in Kiln's code to change.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="kernels built before TRITON_INTERPRET was set: see test_checks_in_fresh_process")

BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM, KV_HEADS = 4, 24, 16, 2
# Small tiles so that keys span several tiles and query blocks several programs.
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
# Out-of-order, interleaved cache blocks: (tokens in the cache before the step, new tokens, blocks).
MIXED_STEP = [(0, 7, [5, 2]),                                   # prefill from scratch
              (9, 5, [7, 1, 12, 3]),                            # prefill chunk after 9 cached
              (13, 1, [0, 9, 4, 14]),                           # decode
              (30, 6, [23, 6, 17, 11, 20, 8, 15, 22, 10])]      # chunk over several key tiles
# Decode rows first, as the scheduler packs a mixed step: `run` gives them to the decode kernel and
# the rest (a one-token chunk behind a prompt among them) to the prefill kernel.
DECODE_FIRST_STEP = [(13, 1, [0, 9, 4, 14]), (20, 1, [1, 2, 3, 5, 6, 7]), (0, 7, [8, 10]),
                     (30, 6, [11, 12, 13, 15, 16, 17, 18, 19, 20]), (9, 1, [21, 22, 23])]
DECODE_STEP = [(44, 1, [23, 6, 17, 11, 20, 8, 15, 22, 10, 13, 16, 18]),
               (29, 1, [0, 9, 4, 14, 19, 21, 2, 5]), (16, 1, [7, 1, 12, 3, 11]), (2, 1, [20])]
LLAMA3_8B = {"hidden": 4096, "vocab": 128256, "heads": 32, "kv_heads": 8, "head_dim": 128,
             "block_size": 16, "bias": False, "width": 4096}


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """fp32: within 1e-4; bf16: within 2% of the reference's largest magnitude."""
    tol = 1e-4 if ref.dtype == torch.float32 else 2e-2 * ref.float().abs().max().item()
    return (out.float() - ref.float()).abs().max().item() <= tol


def make_step(spec: list, heads: int, dtype: torch.dtype, seed: int = 0, table_blocks: int = 0) -> dict:
    """Step inputs, q/k/v and a random KV cache (2 layers) for sequences `spec`, the block tables
    `table_blocks` wide (default: one more than the longest sequence's blocks)."""
    gen = torch.Generator().manual_seed(seed)
    chunks = [SequenceChunk(list(range(n)), start, blocks) for start, n, blocks in spec]
    step = pack_step(chunks, BLOCK_SIZE, table_blocks or max(len(b) for _, _, b in spec) + 1)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    t, kv = step.num_tokens, KV_HEADS * HEAD_DIM
    return {"step": step, "q": rand(t, heads * HEAD_DIM), "k": rand(t, kv), "v": rand(t, kv),
            "cache": rand(2, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)}


def attention_attrs(heads: int, window: int) -> dict:
    return {"layer": 1, "num_heads": heads, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "scale": HEAD_DIM ** -0.5, "window": window}


def attention_inputs(data: dict, cache: torch.Tensor, with_kv: bool) -> list:
    s = data["step"]
    k, v = (data["k"], data["v"]) if with_kv else (None, None)
    return [data["q"], k, v, cache, s.slot_mapping, s.block_tables, s.query_lens, s.context_lens]


def prepared_cache(data: dict, attrs: dict, with_kv: bool) -> torch.Tensor:
    """A copy of the cache; when the op gets no k/v, they are in it beforehand, as a fused
    norm_qkv_rope leaves them."""
    cache = data["cache"].clone()
    if not with_kv:
        write_kv(cache, attrs["layer"], data["k"], data["v"], data["step"].slot_mapping)
    return cache


def reference_attention(data: dict, attrs: dict, with_kv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cache = prepared_cache(data, attrs, with_kv)
    return ATTENTION.call_reference(attention_inputs(data, cache, with_kv), attrs), cache


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("with_kv", [True, False])
@pytest.mark.parametrize("spec", [MIXED_STEP, DECODE_FIRST_STEP], ids=["mixed", "decode first"])
def test_attention_matches_reference(dtype, window, with_kv, spec):
    data = make_step(spec, 4, dtype)
    attrs = attention_attrs(4, window)
    ref, ref_cache = reference_attention(data, attrs, with_kv)

    cache = prepared_cache(data, attrs, with_kv)
    out = torch.empty_like(ref)
    attention_kernels.run(attention_inputs(data, cache, with_kv), attrs, out)
    assert close(out, ref)
    assert torch.equal(cache, ref_cache)

    s = data["step"]
    for splits in (1, 3):  # direct and split-KV, over several key tiles per program
        out = torch.empty_like(ref)
        attention_kernels.paged_attention(data["q"], cache, s.block_tables, s.query_lens, s.context_lens,
                                          out, attrs, splits, SMALL_TILES)
        assert close(out, ref), f"num_splits={splits}"


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("spec,heads,window,seed", [
    # 6 heads over 2 kv heads: a group of 3 rows per token, so 16-row query blocks end in the
    # middle of a token's heads.
    (MIXED_STEP, 6, 5, 1),
    # 20 query heads per kv head: a decode step gives each sequence two 16-row programs per kv
    # head, the second with 4 rows, found without the prefix sum over query lengths.
    (DECODE_STEP, 20 * KV_HEADS, 0, 5)], ids=["mixed-group-of-3", "decode-group-of-20"])
def test_attention_query_blocks_that_do_not_match_the_groups(splits, spec, heads, window, seed):
    data = make_step(spec, heads, torch.float32, seed=seed)
    attrs = attention_attrs(heads, window)
    ref, _ = reference_attention(data, attrs, with_kv=False)
    cache = prepared_cache(data, attrs, with_kv=False)
    s = data["step"]
    out = torch.empty_like(ref)
    attention_kernels.paged_attention(data["q"], cache, s.block_tables, s.query_lens, s.context_lens,
                                      out, attrs, splits, SMALL_TILES)
    assert close(out, ref)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_decode_step_split_kv(dtype):
    data = make_step(DECODE_STEP, 4, dtype, seed=2)
    attrs = attention_attrs(4, 0)
    ref, ref_cache = reference_attention(data, attrs, with_kv=True)
    cache = prepared_cache(data, attrs, with_kv=True)
    out = torch.empty_like(ref)
    attention_kernels.run(attention_inputs(data, cache, True), attrs, out)
    assert close(out, ref) and torch.equal(cache, ref_cache)
    s = data["step"]
    for splits in (3, 16):  # 3: each split of the longest context has keys; 16: most are empty
        out = torch.empty_like(ref)
        attention_kernels.paged_attention(data["q"], cache, s.block_tables, s.query_lens, s.context_lens,
                                          out, attrs, splits, SMALL_TILES)
        assert close(out, ref), f"num_splits={splits}"


@needs_interpreter
def test_split_decode_merges_its_parts_and_leaves_its_arrivals_at_zero():
    """The engine's split-KV decode kernel through its launcher (interpreted stand-ins for the cubins): the
    last part of each program row and kv head to finish merges them, then sets their arrival count back to
    0, so that the next launch on the same scratch (a graph replay, another layer) merges again."""
    from interpreted_launch import Running, targeted
    from kiln.plugins.attention import launch as attention_launch
    from kiln.runtime.cuda_executor import op_scratch

    # Tables of 70 blocks (280 keys) split the keys in 2 parts of 64-key tiles: the first sequence's 81 keys
    # fill both, the others' only the first.
    spec = [(80, 1, list(range(21))), *DECODE_STEP[1:]]
    data = make_step(spec, 4, torch.float32, seed=5, table_blocks=70)
    attrs = attention_attrs(4, 0)
    ref, _ = reference_attention(data, attrs, with_kv=False)
    cache = prepared_cache(data, attrs, with_kv=False)
    shapes = {"heads": 4, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE}
    kernels = targeted(attention_kernels.aot_kernels("float32", shapes), "sm_89")
    limits = {"T": 8, "S": 8, "B": 70, "block_size": BLOCK_SIZE, "element_bytes": 4}
    scratch = {name: torch.zeros(nbytes, dtype=torch.uint8)
               for name, nbytes in op_scratch(attention_launch, attrs, [k.meta for k in kernels], limits).items()}
    inputs = attention_inputs(data, cache, with_kv=False)
    for _ in range(2):
        out, log = torch.full_like(ref, float("nan")), []
        tensors = [t for t in [*inputs, out, cache[1, 0], cache[1, 1], *scratch.values()] if t is not None]
        attention_launch.launch([Running(k, tensors, log) for k in kernels], [k.meta for k in kernels], inputs,
                                attrs, out, {"T": 4}, 0, scratch)
        assert log == [("attention_kernel", (4, KV_HEADS, 2))]
        assert close(out, ref)
        assert not scratch["attention_arrivals"].any()


def test_num_splits_only_for_decode_steps_that_leave_the_gpu_idle():
    assert attention_kernels.choose_num_splits(40, 4, 8, 8192) == 1       # prefill in the step
    assert attention_kernels.choose_num_splits(1, 1, 8, 8192) == attention_kernels.MAX_SPLITS
    assert attention_kernels.choose_num_splits(4, 4, 8, 512) == 2           # short contexts
    assert attention_kernels.choose_num_splits(64, 64, 8, 8192) == 1       # programs enough
    data = make_step(DECODE_STEP, 4, torch.float32)
    s = data["step"]
    with pytest.raises(ValueError, match="num_splits"):
        attention_kernels.paged_attention(data["q"], data["cache"], s.block_tables, s.query_lens,
                                          s.context_lens, data["q"].clone(), attention_attrs(4, 0),
                                          attention_kernels.MAX_SPLITS + 1)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_kv", [True, False])
def test_attention_o_proj_matches_reference(dtype, with_kv):
    data = make_step(MIXED_STEP, 4, dtype, seed=3)
    attrs = {**attention_attrs(4, 0), "all_reduce": False}
    hidden = 48
    gen = torch.Generator().manual_seed(4)
    w_o = (torch.randn(hidden, 4 * HEAD_DIM, generator=gen) / 8).to(dtype)
    b_o = torch.randn(hidden, generator=gen).to(dtype)
    residual = torch.randn(data["q"].shape[0], hidden, generator=gen).to(dtype)
    ref_cache, cache = prepared_cache(data, attrs, with_kv), prepared_cache(data, attrs, with_kv)
    o_proj = [w_o, b_o, residual]
    ref = ATTENTION_O_PROJ.call_reference(attention_inputs(data, ref_cache, with_kv) + o_proj, attrs)
    out = torch.empty_like(ref)
    attention_o_proj_kernels.run(attention_inputs(data, cache, with_kv) + o_proj, attrs, out)
    assert close(out, ref)
    assert torch.equal(cache, ref_cache)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 5000])  # one column block; several (> MAX_BLOCK)
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_reference(dtype, width, with_weight):
    gen = torch.Generator().manual_seed(width)
    x = (3 * torch.randn(5, width, generator=gen)).to(dtype)
    weight = torch.randn(width, generator=gen) if with_weight else None  # float32, as models hold norm weights
    ref = RMS_NORM.call_reference([x, weight], {"eps": 1e-6})
    out = torch.empty_like(x)
    rms_norm_kernels.run([x, weight], {"eps": 1e-6}, out)
    assert close(out, ref)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 48.0 ** 0.5])  # Llama's; Gemma's sqrt(hidden), not exact in bf16
def test_embedding_and_take_rows_match_reference(dtype, scale):
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(50, 1500, generator=gen).to(dtype)  # two column blocks
    ids = torch.tensor([3, 49, 0, 3, 17], dtype=torch.int32)
    out = torch.empty(5, 1500, dtype=dtype)
    # The model passes the scale rounded to the table's dtype, as Gemma's embedding multiplies by.
    attrs = {"scale": float(torch.tensor(scale, dtype=dtype))}
    embedding_kernels.run([ids, table], attrs, out)
    ref = EMBEDDING.call_reference([ids, table], attrs)
    # A scaled bf16 row is rounded, which Triton's interpreter does by truncation (the GPU to nearest).
    assert torch.equal(out, ref) if dtype == torch.float32 or scale == 1.0 else close(out, ref)
    rows = torch.tensor([4, 0], dtype=torch.int32)
    taken = torch.empty(2, 1500, dtype=dtype)
    take_rows_kernels.run([out, rows], {}, taken)
    assert torch.equal(taken, TAKE_ROWS.call_reference([out, rows], {}))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 5000])  # one column block; several (> MAX_BLOCK)
def test_softcap_matches_reference(dtype, width):
    gen = torch.Generator().manual_seed(width)
    # Rows of a wider buffer, as the logits of a step sit in the arena; values well past the cap.
    buffer = (20 * torch.randn(4, width + 8, generator=gen)).to(dtype)
    x = buffer[:, :width]
    ref = SOFTCAP.call_reference([x], {"cap": 5.0})
    out = torch.empty(4, width, dtype=dtype)
    softcap_kernels.run([x], {"cap": 5.0}, out)
    assert close(out, ref) and out.abs().max() <= 5.0
    assert not torch.equal(ref, x)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_matches_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randn(6, 1500, generator=gen).to(dtype) for _ in range(2))
    out = torch.empty_like(a)
    add_kernels.run([a, b], {}, out)
    ref = ADD.call_reference([a, b], {})
    # bf16 sums are rounded, which Triton's interpreter does by truncation (the GPU to nearest).
    assert torch.equal(out, ref) if dtype == torch.float32 else close(out, ref)


COMPILE_SCRIPT = """
import importlib, json, sys
from kiln.plugins.aot import TARGET_CC, compile_cubin, kernel_name
shapes, result = json.loads(sys.argv[1]), {}
for plugin in sys.argv[2:]:
    result[plugin] = []
    for kernel in importlib.import_module(f"kiln.plugins.{plugin}.kernels").aot_kernels("bfloat16", shapes):
        for target in kernel.targets or TARGET_CC:
            try:
                cubin = compile_cubin(kernel, target)
                size, shared = len(cubin.binary), cubin.shared_bytes
            except Exception as exc:
                size, shared = repr(exc), 0
            result[plugin].append([kernel_name(kernel), kernel.meta.get("role", ""), target, size, shared])
sys.stdout.write(json.dumps(result))
"""
PLUGINS = ["add", "attention", "attention_o_proj", "embedding", "rms_norm", "softcap", "take_rows"]


@pytest.fixture(scope="module")
def cubins() -> dict:
    """Compiled in a child without TRITON_INTERPRET: compilation needs @triton.jit kernels
    built for the GPU, which the interpreter's stand-ins in this process are not."""
    return compiled_json(COMPILE_SCRIPT, json.dumps(LLAMA3_8B), *PLUGINS)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_every_kernel_compiles_for_every_target(cubins, plugin):
    results = cubins[plugin]
    assert results, f"{plugin} has no AOT kernels"
    failed = [r for r in results if not isinstance(r[3], int) or r[3] == 0]
    assert not failed, failed
    # Each kernel fits the shared memory of the targets it is built for (sm_89's 99 KiB the least).
    too_big = [r for r in results if r[4] > MAX_SHARED_BYTES[r[2]]]
    assert not too_big, too_big
    # Every target gets one kernel per attention role.
    for target in MAX_SHARED_BYTES:
        roles = [r[1] for r in results if r[2] == target and r[1]]
        assert len(roles) == len(set(roles)), (target, roles)


def test_checks_in_fresh_process():
    if INTERPRETED:
        pytest.skip("the interpreter applies in this process; the checks ran here")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", "not fresh_process and not compiles"],
                          cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
