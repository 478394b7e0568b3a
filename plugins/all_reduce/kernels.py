"""Triton kernel for `all_reduce`: a one-shot all-reduce that pushes each rank's partial into
every rank's buffer (`runtime.all_reduce` maps them; `launch.py` gives their layout).

Reading a peer's data after seeing its flag costs two NVLink crossings a call; pushing the data
costs one. Each rank's buffer holds two copies of WORLD slots, slot q written only by rank q,
and an element whose bits are all zero has not arrived yet. The kernel runs a fixed number of
programs; program p always handles the same blocks of a message (p, p + PROGRAMS, ...):

1. Its call count (a per-program counter only the owner touches) picks the copy, count % 2.
   Every rank makes the same calls in the same order, so the counts agree, and a captured CUDA
   graph that replays the same arguments still alternates.
2. Store this rank's partial into slot `rank` of that copy in every rank's buffer, with +0.0
   sent as -0.0 so that no value looks unarrived (x + -0.0 == x).
3. Spin on its own buffer (volatile loads: peers' stores land in this GPU's memory, never in
   its L1) until every element of every slot has arrived; then sum the slots in rank order in
   float32, so that every rank gets the same bits, and zero them for the copy's next use.

Two copies are enough: a peer writes this copy again two calls later, once it has this rank's
data of the next call, which this rank pushes only after this call has finished and zeroed the
copy. Spinning never ends if a peer never comes: the Session's step deadline names that rank.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.dtypes import dtype_name, element_bytes
from kiln.plugins.aot import AotKernel, pointer_params
from kiln.plugins.all_reduce.launch import CAPACITY_BYTES, MAX_WORLD, PROGRAMS, PROTOCOL, BufferLayout, takes

POINTER_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}
# The buffer's view: integers as wide as the message's elements, so arrival is a bit test.
BITS_TYPES = {"float32": "*i32", "float16": "*i16", "bfloat16": "*i16"}
BLOCK = 1024        # 4 warps of 16-byte loads and stores for 2-byte elements
NUM_WARPS = 4


@triton.jit
def _pick(q: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """The q-th of eight pointers, chosen while compiling (q is a constant)."""
    if q == 0:
        p = p0
    elif q == 1:
        p = p1
    elif q == 2:
        p = p2
    elif q == 3:
        p = p3
    elif q == 4:
        p = p4
    elif q == 5:
        p = p5
    elif q == 6:
        p = p6
    else:
        p = p7
    return p


@triton.jit
def all_reduce_kernel(inp_ptr, out_ptr, counter_ptr, own_data_ptr,
                      data0, data1, data2, data3, data4, data5, data6, data7,
                      n, rank,
                      WORLD: tl.constexpr, CAPACITY: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
                      SIGN: tl.constexpr):
    pid = tl.program_id(0)
    calls = tl.atomic_add(counter_ptr + pid, 1, sem="relaxed", scope="gpu")
    copy = (calls % 2) * WORLD * CAPACITY
    bits_type = own_data_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        idx = start + cols
        ok = idx < n
        bits = tl.load(inp_ptr + idx, mask=ok).to(bits_type, bitcast=True)
        bits = tl.where(bits == 0, tl.full([BLOCK], SIGN, bits_type), bits)
        for q in tl.static_range(WORLD):
            data = _pick(q, data0, data1, data2, data3, data4, data5, data6, data7)
            tl.store(data + copy + rank * CAPACITY + idx, bits, mask=ok)
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        idx = start + cols
        ok = idx < n
        total = tl.zeros([BLOCK], tl.float32)
        for q in tl.static_range(WORLD):
            slot = own_data_ptr + copy + q * CAPACITY + idx
            bits = tl.load(slot, mask=ok, other=1, volatile=True)
            while tl.max((bits == 0).to(tl.int32), axis=0) > 0:
                bits = tl.load(slot, mask=ok, other=1, volatile=True)
            total += bits.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
            tl.store(slot, tl.zeros([BLOCK], bits_type), mask=ok)
        tl.store(out_ptr + idx, total.to(out_ptr.dtype.element_ty), mask=ok)


def _sign(dtype: str) -> int:
    """-0.0's bits as a signed integer of the element's width."""
    return -(1 << (8 * element_bytes(dtype) - 1))


def aot_kernels(dtype: str, world_size: int) -> list[AotKernel]:
    """The kernel for `world_size` ranks exchanging `dtype` messages."""
    if not 2 <= world_size <= MAX_WORLD:
        raise ValueError(f"the custom all-reduce serves 2 to {MAX_WORLD} ranks, not {world_size}")
    ptr, bits = POINTER_TYPES[dtype], BITS_TYPES[dtype]
    signature = {"inp_ptr": ptr, "out_ptr": ptr, "counter_ptr": "*i64", "own_data_ptr": bits,
                 **{f"data{q}": bits for q in range(MAX_WORLD)}, "n": "i32", "rank": "i32",
                 "WORLD": "constexpr", "CAPACITY": "constexpr", "PROGRAMS": "constexpr", "BLOCK": "constexpr",
                 "SIGN": "constexpr"}
    constexprs = {"WORLD": world_size, "CAPACITY": CAPACITY_BYTES // element_bytes(dtype), "PROGRAMS": PROGRAMS,
                  "BLOCK": BLOCK, "SIGN": _sign(dtype)}
    return [AotKernel(all_reduce_kernel, signature, constexprs, num_warps=NUM_WARPS, num_stages=1,
                      aligned=(*pointer_params(signature), "n"),
                      meta={"grid": f"({PROGRAMS}, 1, 1)", "world_size": world_size, "capacity_bytes": CAPACITY_BYTES,
                            "protocol": PROTOCOL, "pointer_alignment": 16})]


def run(tensor: torch.Tensor, buffers: list[torch.Tensor], rank: int, layout: BufferLayout) -> None:
    """What `launch.py` does, through Triton's JIT: sum `tensor` over the ranks in place, with
    `buffers[q]` rank q's shared buffer (uint8, `layout.nbytes`) as this process sees it."""
    if not takes(tensor, layout.capacity_bytes):
        raise ValueError(f"the custom all-reduce does not take {tuple(tensor.shape)} ({tensor.nbytes} bytes)")
    counters, data = zip(*(regions(b, layout, tensor.dtype) for b in buffers))
    unused = [None] * (MAX_WORLD - len(buffers))
    all_reduce_kernel[(PROGRAMS,)](
        tensor, tensor, counters[rank], data[rank], *data, *unused, tensor.numel(), rank,
        WORLD=len(buffers), CAPACITY=layout.capacity_bytes // tensor.element_size(), PROGRAMS=PROGRAMS, BLOCK=BLOCK,
        SIGN=_sign(dtype_name(tensor.dtype)), num_warps=NUM_WARPS, num_stages=1)


def regions(buffer: torch.Tensor, layout: BufferLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's buffer as its counters and its data, [copy, slot, element] as integers of the
    width of `dtype`."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    data = buffer[layout.data_offset:].view(bits).view(2, layout.world_size, -1)
    return buffer[:layout.data_offset].view(torch.int64)[:PROGRAMS], data
