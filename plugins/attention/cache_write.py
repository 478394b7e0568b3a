"""The KV-cache write of `attention` (and of the fused QKV epilogues): each token's k and v rows
into its paged slot, rounded to e4m3 for an e4m3 cache.

The KV cache is [layers, 2, num_slots / block_size, block_size, kv_heads, head_dim] and
contiguous, so a token's k row of a layer starts at (slot * kv_heads) * head_dim in that
layer's k part. An e4m3 cache keeps its v part's blocks transposed, [block_size] innermost
([num_blocks, kv_heads, head_dim, block_size], `v_offset`): the decode attention's p.v dot
reduces over keys, and the tensor cores take 8-bit operands only with the reduction axis
contiguous; with keys 1 KiB apart each thread gathered its keys' bytes one by one (on an H200
the e4m3 decode ran 17-35% faster transposed, BENCHMARKS.md session 28). bf16 keeps one
layout: ldmatrix transposes 16-bit tiles for free.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.plugins.aot import AotKernel

E4M3_MAX = tl.constexpr(448.0)  # plugins/fp8.py's


@triton.jit
def to_e4m3(x, scale):
    """x / scale saturated to +-448 and rounded to the nearest e4m3 value (ties to even), in
    float32: plugins/fp8.py's `to_e4m3`, whose cast to float8e4nv is then exact. The rounding is
    done here rather than left to the cast because Triton's interpreter truncates e4m3
    subnormals (and sm_80 has no e4m3 conversion instruction): adding and subtracting
    1.5 * 2**23 units of the value's e4m3 spacing rounds it there with float32's own rounding."""
    y = tl.clamp(x.to(tl.float32) / scale, -E4M3_MAX, E4M3_MAX)
    exponent = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: -6
    # 2**(exponent - 3) is the spacing of e4m3's 3-bit mantissa; the biased exponent of that times 2**23.
    magic = ((exponent + 147) << 23).to(tl.float32, bitcast=True) * 1.5
    return (y + magic) - magic


@triton.jit
def v_offset(slot, col, ROW: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Where an e4m3 cache's v part holds column `col` (kv head * head_dim + dim) of slot `slot`
    (int64): its blocks are [kv_heads * head_dim, block_size]."""
    return ((slot // BLOCK_SIZE) * ROW + col) * BLOCK_SIZE + slot % BLOCK_SIZE


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, scale_ptr, k_stride, v_stride,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """scale_ptr: this layer's [2, kv heads] scales of an e4m3 cache (v transposed), or None."""
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < ROW
    # int64: a large cache pool has more than 2**31 elements.
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    dst = slot * ROW + cols
    k = tl.load(k_ptr + tok * k_stride + cols, mask=ok)
    v = tl.load(v_ptr + tok * v_stride + cols, mask=ok)
    v_dst = dst
    if scale_ptr is not None:
        head = cols // HEAD_DIM
        k = to_e4m3(k, tl.load(scale_ptr + head, mask=ok, other=1.0))
        v = to_e4m3(v, tl.load(scale_ptr + ROW // HEAD_DIM + head, mask=ok, other=1.0))
        v_dst = v_offset(slot, cols, ROW, BLOCK_SIZE)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def check_layout(kv_cache: torch.Tensor, *rows: torch.Tensor) -> None:
    # The kernels compute cache offsets from its shape and step along rows by one element.
    if not kv_cache.is_contiguous() or any(t.stride(-1) != 1 for t in rows):
        raise ValueError("attention needs a contiguous kv_cache and q, k, v, out rows with "
                         "contiguous columns")


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """Copy each token's k and v rows [T, kv_heads*head_dim] into its cache slot (in e4m3,
    value / scale, with `kv_scales` [layers, 2, kv_heads])."""
    check_layout(kv_cache, k, v)
    row = kv_cache.shape[-2] * kv_cache.shape[-1]
    block = _row_block(row)
    _write_kv_kernel[(k.shape[0], triton.cdiv(row, block))](
        k, v, kv_cache[layer, 0], kv_cache[layer, 1], slot_mapping, layer_scales(kv_scales, layer),
        k.stride(0), v.stride(0), ROW=row, BLOCK=block, HEAD_DIM=kv_cache.shape[-1],
        BLOCK_SIZE=kv_cache.shape[3] if kv_scales is not None else 1)


def layer_scales(kv_scales: torch.Tensor | None, layer: int) -> torch.Tensor | None:
    return None if kv_scales is None else kv_scales[layer].contiguous()


def _row_block(width: int) -> int:
    return min(triton.next_power_of_2(width), 1024)


def write_kv_aot(ptr: str, cache: str, fp8_kv: bool, row: int, head_dim: int, block_size: int) -> AotKernel:
    """The write kernel of an engine: `ptr` the type of k and v, `cache` the cache's, `row`
    kv_heads * head_dim; with `fp8_kv` it takes the layer's scales after the slot mapping. Only an
    e4m3 cache's transposed v blocks need the block size: bf16 engines of any block size share one
    kernel (BLOCK_SIZE 1), as norm_qkv_rope's do."""
    scales = {"scale_ptr": "*fp32" if fp8_kv else "constexpr"}
    signature = {"k_ptr": ptr, "v_ptr": ptr, "k_cache_ptr": cache, "v_cache_ptr": cache, "slot_mapping_ptr": "*i32",
                 **scales, "k_stride": "i32", "v_stride": "i32", "ROW": "constexpr", "BLOCK": "constexpr",
                 "HEAD_DIM": "constexpr", "BLOCK_SIZE": "constexpr"}
    return AotKernel(
        _write_kv_kernel, signature,
        {"ROW": row, "BLOCK": _row_block(row), "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size if fp8_kv else 1,
         **({} if fp8_kv else {"scale_ptr": None})},
        aligned=("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"),
        meta={"role": "write_kv", "grid": f"(T, {triton.cdiv(row, _row_block(row))}, 1)", "pointer_alignment": 16,
              "when": "k and v are given; before the attention kernel"})
