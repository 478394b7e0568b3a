"""The CUTLASS route of the attention plugin's prefill: causal paged attention on Hopper's wgmma and TMA
(`prefill_sm90.cu`, CuTe's building blocks, built by nvcc for sm_90a with `nvidia-cutlass`'s headers),
for bf16 caches of 16-token blocks, heads of 128 and no sliding window (`serves`).

On sm_90 it is the attention plugin's prefill where it serves (`engine_kernels`); scripts/tune_attention.py
times it beside the Triton prefill tilings and SDPA's flash attention, and tests/test_cute_prefill_gpu.py
checks it against the plugin reference on an H200. Its
descriptors are parameters the host makes (`runtime.cuda_driver.encode_tensor_map`, `descriptors`): q as
[rows, q's row pitch] in boxes of 128 rows x 64 dims, the layer's K and V caches each as [slots, kv heads,
head_dim] in boxes of one cache block x one head x 64 dims.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kiln.plugins.linear import cute_gemm
from kiln.plugins.linear.launch import tensor_map
from kiln.plugins.nvcc import NvccKernel, cutlass_available, cutlass_include

if TYPE_CHECKING:
    from kiln.runtime.cuda_driver import CudaKernel

SOURCE = Path(__file__).with_name("prefill_sm90.cu")
SIGNATURE = {"q_map": "tensormap", "k_map": "tensormap", "v_map": "tensormap", "out": "*bf16",
             "block_tables": "*i32", "query_lens": "*i32", "context_lens": "*i32", "num_seqs": "i32",
             "first_seq": "i32", "tiles": "i32", "heads": "i32", "out_stride": "i32", "table_stride": "i32",
             "num_slots": "i32", "kv_heads": "i32", "scale": "fp32"}
BLOCK_M = 128      # query tokens a block
HEAD_DIM = 128
BLOCK_SIZE = 16    # the cache's tokens a block
WARPS = 12         # a producer warpgroup and two consumer warpgroups
# What overlaps a warpgroup's softmax (prefill_sm90.cu's Schedule): nothing planned, the other warpgroup's
# GEMMs (the two take turns), or its own next GEMMs (FlashAttention-3's pipelining within a warpgroup).
SCHEDULES = {"plain": "PLAIN", "pingpong": "PINGPONG", "overlap": "OVERLAP"}


def kernel(block_n: int, stages: int, schedule: str = "plain") -> NvccKernel:
    """The prefill kernel at key tiles of `block_n` keys, `stages` key and value tiles in flight, its softmax
    overlapped as `schedule` (a key of SCHEDULES) says. Launch: `launch`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"no prefill schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    entry = f"kiln_cute_prefill_n{block_n}_s{stages}{'' if schedule == 'plain' else '_' + schedule}"
    # K and V tiles a stage and two query tiles, in rows of one 128-byte K tile (half a head)
    shared = cute_gemm.shared_bytes(2 * 2 * block_n, stages) + 2 * 2 * BLOCK_M * cute_gemm.K_TILE_BYTES
    call = f"KILN_CUTE_PREFILL({entry}, {block_n}, {stages}, kiln_cute::{SCHEDULES[schedule]}, {shared})"
    return NvccKernel(cute_gemm.SOURCE, entry, f"{SOURCE.read_text()}\n{call}", SIGNATURE, WARPS,
                      targets=cute_gemm.TARGETS, shared_bytes=shared, includes=(cutlass_include(),),
                      arch_specific=True)


# The engine's tiling (keys a tile, stages).
ENGINE_TILING = (128, 2)


def engine_kernels(dtype: str, shapes: dict) -> list[NvccKernel]:
    """The kernel as the sm_90 prefill of the attention plugin's compile `shapes` (role "prefill_cute", which
    the launcher takes for ops without a sliding window) where it serves and CUTLASS's headers are
    installed; none elsewhere, where Triton's prefill serves."""
    cache = "float8_e4m3fn" if shapes.get("fp8_kv", False) else dtype
    if not serves(dtype, cache, shapes["head_dim"], shapes["block_size"], 0) or not cutlass_available():
        return []
    return [dataclasses.replace(kernel(*ENGINE_TILING), meta={"role": "prefill_cute", "pointer_alignment": 16})]


def serves(dtype: str, cache_dtype: str, head_dim: int, block_size: int, window: int) -> bool:
    """Whether the kernel serves an attention op of these kinds."""
    return (dtype == cache_dtype == "bfloat16" and head_dim == HEAD_DIM and block_size == BLOCK_SIZE
            and window <= 0)


def tiles(tokens: int, seqs: int) -> int:
    """Tile ids a head for a prefill of `tokens` query rows in `seqs` sequences (from first_seq on): as many
    as the worst packing needs."""
    return tokens // BLOCK_M + seqs


def grid(work: int, sms: int | None) -> tuple[int, int, int]:
    """The grid for `work` items (tile ids x heads): one block an item, or with `sms` one per SM, each walking
    the items (persistent)."""
    return (work if sms is None else min(work, sms)), 1, 1


@dataclasses.dataclass(frozen=True)
class Descriptors:
    q: bytes
    k: bytes
    v: bytes


def descriptors(q_address: int, q_rows: int, q_pitch: int, k_address: int, v_address: int, slots: int,
                kv_heads: int) -> Descriptors:
    """The kernel's TMA descriptors (made once per buffer: `linear.launch.tensor_map`): q over `q_rows` rows
    of `q_pitch` elements (rows past them read as zeros), the layer's K and V caches over their `slots`
    token slots."""
    half = cute_gemm.k_tile()   # head dims a box: one 128-byte swizzle row
    cache, box = (slots, kv_heads, HEAD_DIM), (BLOCK_SIZE, 1, half)
    return Descriptors(tensor_map(q_address, "bf16", (q_rows, q_pitch), (BLOCK_M, half)),
                       tensor_map(k_address, "bf16", cache, box), tensor_map(v_address, "bf16", cache, box))


def launch(fn: CudaKernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           block_tables: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor, first_seq: int,
           heads: int, scale: float, stream: int, sms: int | None) -> None:
    """Run the loaded kernel `fn` over the step's prefill rows as the attention launcher's prefill role does:
    q [T, heads x 128] and out with contiguous rows, the layer's caches [blocks, 16, kv heads, 128], the
    sequences from `first_seq` on (those before it have one query row each); persistent on a GPU of `sms`
    SMs, or one block a tile with None."""
    slots, kv_heads = k_cache.shape[0] * k_cache.shape[1], k_cache.shape[2]
    maps = descriptors(q.data_ptr(), q.shape[0], q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), slots,
                       kv_heads)
    seqs = query_lens.shape[0]
    count = tiles(q.shape[0] - first_seq, seqs - first_seq)
    fn.launch(grid(count * heads, sms),
              [maps.q, maps.k, maps.v, out.data_ptr(), block_tables.data_ptr(), query_lens.data_ptr(),
               context_lens.data_ptr(), seqs, first_seq, count, heads, out.stride(0), block_tables.stride(0), slots,
               kv_heads, scale], stream)
