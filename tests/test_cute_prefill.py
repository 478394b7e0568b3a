"""The CuTe prefill attention (`plugins.attention.prefill_sm90`) on the CPU: nvcc builds it for sm_90a with
CUTLASS's headers; its entry point takes exactly the parameters its signature declares, as the driver
launch packs them; it is made of Hopper's own instructions (3D TMA loads of the paged cache, wgmma for Q K^T
from shared memory and for P V with P from registers and V read transposed, the producer's registers given
to the consumers) within the target's shared memory, and each schedule of its softmax is what it says (turns
on named barriers; a wait for the scores alone while P V runs); and the launch helper passes the descriptors (q in
boxes of 128 rows x 64 dims, the layer's K and V caches as [slots, kv heads, 128] in boxes of one cache
block x one head x 64 dims) and then the pointers and sizes on a grid of every head's tile ids. Its
numerics and speed are measured on an H200 (tests/test_cute_prefill_gpu.py, scripts/tune_attention.py)."""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from descriptor_recording import Recorder, recorded_descriptors
from kiln.plugins import nvcc
from kiln.plugins.aot import MAX_SHARED_BYTES, compile_cubin
from kiln.plugins.attention import prefill_sm90

needs_cutlass = pytest.mark.skipif(nvcc.nvcc_path() is None or not nvcc.cutlass_available(),
                                   reason="nvcc or CUTLASS's headers are not installed")
PTX_PARAM = {"tensormap": ".param .align 128 .b8[128]", "i32": ".param .u32", "fp32": ".param .f32"}


@pytest.fixture(scope="module")
def kernel() -> nvcc.NvccKernel:
    return prefill_sm90.kernel(128, 2)


def ptx_of(kernel: nvcc.NvccKernel) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cu").write_text(nvcc.source_text(kernel))
        subprocess.run([nvcc.nvcc_path(), "-ptx", *kernel.options("sm_90"), "-o", f"{tmp}/k.ptx", f"{tmp}/k.cu"],
                       check=True, capture_output=True)
        return (Path(tmp) / "k.ptx").read_text()


@pytest.fixture(scope="module")
def ptx(kernel) -> str:
    return ptx_of(kernel)


@needs_cutlass
def test_entry_takes_its_signature_as_the_launch_packs_it(kernel, ptx):
    params = re.search(rf"\.entry {kernel.entry}\(([^)]*)\)", ptx).group(1)
    kinds = [re.sub(rf"\s*{kernel.entry}_param_\d+", "", p).strip() for p in params.split(",")]
    assert kinds == [PTX_PARAM.get(kind, ".param .u64") for kind in kernel.signature.values()]


@needs_cutlass
def test_it_is_built_of_hoppers_own_instructions(kernel, ptx):
    assert re.search(r"^\.target sm_90a", ptx, re.M) and ".maxntid 384, 1, 1" in ptx
    assert "cp.async.bulk.tensor.3d" in ptx and "cp.async.bulk.tensor.2d" in ptx   # the cache; q
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16([^;]*);", ptx)
    from_shared = [m for m in mmas if "{%r" not in m]
    from_registers = [m for m in mmas if "{%r" in m]
    # Q K^T: both from shared memory, K-major; P V: P from registers, V transposed (its last flag).
    assert from_shared and all(m.replace(" ", "").endswith("p,1,1,0,0") for m in from_shared)
    assert from_registers and all(m.replace(" ", "").endswith("p,1,1,1") for m in from_registers)


@needs_cutlass
def test_with_pingpong_the_warpgroups_take_turns_on_two_named_barriers(ptx):
    turns = ptx_of(prefill_sm90.kernel(128, 2, "pingpong"))
    assert "bar.arrive" in turns and re.search(r"bar(rier)?\.sync(\.aligned)? %r", turns)
    assert "bar.arrive" not in ptx


@needs_cutlass
def test_with_overlap_a_warpgroup_takes_its_scores_while_its_p_v_still_runs(ptx):
    overlap = ptx_of(prefill_sm90.kernel(128, 2, "overlap"))
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", overlap)
    assert "1" in waits and "0" in waits and "bar.arrive" not in overlap
    assert re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx) == ["0"] * len(
        re.findall(r"wgmma\.wait_group", ptx))


def test_an_unknown_schedule_is_refused_by_name():
    with pytest.raises(ValueError, match="no prefill schedule 'fast'; choose one of plain, pingpong, overlap"):
        prefill_sm90.kernel(128, 2, "fast")


@needs_cutlass
def test_cubin_builds_within_the_targets_shared_memory(kernel):
    cubin = compile_cubin(kernel, "sm_90")
    assert cubin.binary.startswith(b"\x7fELF") and kernel.entry.encode() in cubin.binary
    # two stages of K and V tiles, two query tiles (the next one loads while this one runs), the barriers
    assert cubin.shared_bytes == 2 * 2 * 128 * 128 * 2 + 2 * 128 * 128 * 2 + 2048 <= MAX_SHARED_BYTES["sm_90"]


def test_it_serves_bf16_caches_of_16_token_blocks_and_heads_of_128_without_a_window():
    assert prefill_sm90.serves("bfloat16", "bfloat16", 128, 16, 0)
    for args in (("float16", "float16", 128, 16, 0), ("bfloat16", "float8_e4m3fn", 128, 16, 0),
                 ("bfloat16", "bfloat16", 64, 16, 0), ("bfloat16", "bfloat16", 128, 32, 0),
                 ("bfloat16", "bfloat16", 128, 16, 4096)):
        assert not prefill_sm90.serves(*args)


def test_launch_passes_descriptors_then_pointers_and_sizes():
    heads, kv_heads, tokens, blocks = 32, 8, 2 + 300 + 129, 64
    q, out = (torch.empty(tokens, heads * 128, dtype=torch.bfloat16) for _ in range(2))
    cache = torch.empty(2, blocks, 16, kv_heads, 128, dtype=torch.bfloat16)
    tables = torch.zeros(4, 40, dtype=torch.int32)
    qlens, clens = torch.tensor([1, 1, 300, 129], dtype=torch.int32), torch.tensor([9, 70, 300, 169], dtype=torch.int32)
    for sms, blocks_launched in ((None, (429 // 128 + 2) * heads), (132, 132)):
        fn = Recorder()
        with recorded_descriptors() as encoded:
            prefill_sm90.launch(fn, q, cache[0], cache[1], out, tables, qlens, clens, 2, heads, 0.125, 7, sms)
        assert encoded == [(q.data_ptr(), "bf16", (tokens, heads * 128), (128, 64)),
                           (cache[0].data_ptr(), "bf16", (blocks * 16, kv_heads, 128), (16, 1, 64)),
                           (cache[1].data_ptr(), "bf16", (blocks * 16, kv_heads, 128), (16, 1, 64))]
        (grid, args), = fn.launches
        # the prefill rows' tiles and one more per sequence, every head: a block each, or one per SM
        assert grid == (blocks_launched, 1, 1)
        assert args == [bytes([1]) * 128, bytes([2]) * 128, bytes([3]) * 128, out.data_ptr(), tables.data_ptr(),
                        qlens.data_ptr(), clens.data_ptr(), 4, 2, 429 // 128 + 2, heads, out.stride(0), 40,
                        blocks * 16, kv_heads, 0.125]
        assert len(args) == len(prefill_sm90.SIGNATURE)


LLAMA = {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16}


@pytest.mark.parametrize("dtype, shapes, served", [
    ("bfloat16", LLAMA, True), ("bfloat16", {**LLAMA, "fp8_kv": True}, False), ("float16", LLAMA, False),
    ("bfloat16", {**LLAMA, "head_dim": 64}, False), ("bfloat16", {**LLAMA, "block_size": 32}, False)])
def test_an_sm90_engine_holds_it_where_it_serves(dtype, shapes, served):
    from interpreted_launch import targeted
    from kiln.plugins.attention import kernels

    roles = [k.meta.get("role") for k in targeted(kernels.aot_kernels(dtype, shapes), "sm_90")]
    assert ("prefill_cute" in roles) == (served and nvcc.cutlass_available())
    assert "prefill_cute" not in [k.meta.get("role") for k in targeted(kernels.aot_kernels(dtype, shapes), "sm_89")]


@needs_cutlass
@pytest.mark.parametrize("window, cute", [(0, True), (-1, True), (4096, False)])
def test_the_launcher_takes_it_for_prefill_rows_without_a_window(window, cute):
    from interpreted_launch import targeted
    from kiln.plugins.attention import kernels, launch as attention_launch

    aot = targeted(kernels.aot_kernels("bfloat16", LLAMA), "sm_90")
    metas = [k.meta for k in aot]
    log = []
    fns = [Recorder(m.get("role"), log) for m in metas]
    tokens, heads = 2 + 300, 32
    q, out = (torch.empty(tokens, heads * 128, dtype=torch.bfloat16) for _ in range(2))
    cache = torch.empty(1, 2, 64, 16, 8, 128, dtype=torch.bfloat16)
    inputs = [q, None, None, cache, torch.zeros(tokens, dtype=torch.int32), torch.zeros(3, 40, dtype=torch.int32),
              torch.tensor([1, 1, 300], dtype=torch.int32), torch.tensor([9, 70, 300], dtype=torch.int32)]
    attrs = {"layer": 0, "num_heads": heads, "num_kv_heads": 8, "head_dim": 128, "scale": 0.125, "window": window}
    with recorded_descriptors():
        attention_launch.launch(fns, metas, inputs, attrs, out, {"T": tokens, "S": 3, "D": 2}, 7,
                                {name: torch.empty(1 << 20, dtype=torch.uint8)
                                 for name in ("attention_part", "attention_stats", "attention_arrivals")})
    # the decode rows (split over their keys, merged by the split kernel), then the prompt: the CuTe
    # kernel a block a tile (3 tile ids x 32 heads)
    assert [role for role, _, _ in log] == ["decode_split", "prefill_cute" if cute else "prefill"]
    assert not cute or log[-1][1] == (3 * heads, 1, 1)
