"""Triton kernel for `all_reduce`: a one-shot all-reduce over buffers that every rank maps.

Each rank owns one buffer, mapped by its peers (`runtime.all_reduce` sets it up; `launch.py`
gives its layout): per-program epoch counters only the owner touches, a flag table
[rank, program] its peers write, and two halves of message data. The kernel runs a fixed
number of programs; program p always handles the same blocks of a message (p, p + PROGRAMS,
...), whatever its size, and synchronises only with program p of every peer:

1. epoch = its counter + 1, stored back: the kernel counts its own calls, so a captured CUDA
   graph that replays the same arguments still gets a new epoch each time. Every rank makes
   the same calls in the same order, so the epochs agree across ranks.
2. Copy this rank's partial into half `epoch % 2` of its own buffer.
3. Barrier (every thread's copy is done), then write `epoch` into slot [rank, p] of every
   rank's flag table with release semantics at system scope.
4. Wait until every slot [q, p] of its own table holds at least `epoch` (acquire, system
   scope); a peer may already be one call ahead and have written epoch + 1 there.
5. Sum the halves `epoch % 2` of every rank's buffer in rank order, in float32, and store the
   sum: every rank adds the same numbers in the same order, so all get the same bits.

Two halves keep a fast rank from overwriting what a slow one still reads: writing half h
again takes call epoch + 2, which waits in call epoch + 1 for every peer's flag, and a peer
writes that only after its program p has finished reading call epoch's data. Spinning in
step 4 never ends if a peer never comes: the Session's step deadline names that rank.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.dtypes import element_bytes
from kiln.plugins.aot import AotKernel, pointer_params
from kiln.plugins.all_reduce.launch import CAPACITY_BYTES, MAX_WORLD, PROGRAMS, BufferLayout, takes

POINTER_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}
BLOCK = 2048
NUM_WARPS = 8


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
def all_reduce_kernel(inp_ptr, out_ptr, counter_ptr, own_data_ptr, own_flags_ptr,
                      data0, data1, data2, data3, data4, data5, data6, data7,
                      flags0, flags1, flags2, flags3, flags4, flags5, flags6, flags7,
                      n, rank,
                      WORLD: tl.constexpr, CAPACITY: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    # One thread counts; the old value reaches every thread of the program.
    epoch = tl.atomic_add(counter_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    half = (epoch % 2) * CAPACITY
    cols = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        idx = start + cols
        ok = idx < n
        tl.store(own_data_ptr + half + idx, tl.load(inp_ptr + idx, mask=ok), mask=ok)
    tl.debug_barrier()
    for q in tl.static_range(WORLD):
        flags = _pick(q, flags0, flags1, flags2, flags3, flags4, flags5, flags6, flags7)
        tl.atomic_xchg(flags + rank * PROGRAMS + pid, epoch, sem="release", scope="sys")
    for q in tl.static_range(WORLD):
        seen = tl.atomic_add(own_flags_ptr + q * PROGRAMS + pid, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(own_flags_ptr + q * PROGRAMS + pid, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        idx = start + cols
        ok = idx < n
        # .cg: read through L2 only; a peer's data must never come from a stale L1 line.
        total = tl.load(data0 + half + idx, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        for q in tl.static_range(1, WORLD):
            data = _pick(q, data0, data1, data2, data3, data4, data5, data6, data7)
            total += tl.load(data + half + idx, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + idx, total.to(out_ptr.dtype.element_ty), mask=ok)


def aot_kernels(dtype: str, world_size: int) -> list[AotKernel]:
    """The kernel for `world_size` ranks exchanging `dtype` messages."""
    if not 2 <= world_size <= MAX_WORLD:
        raise ValueError(f"the custom all-reduce serves 2 to {MAX_WORLD} ranks, not {world_size}")
    ptr = POINTER_TYPES[dtype]
    signature = {"inp_ptr": ptr, "out_ptr": ptr, "counter_ptr": "*i64", "own_data_ptr": ptr, "own_flags_ptr": "*i64",
                 **{f"data{q}": ptr for q in range(MAX_WORLD)}, **{f"flags{q}": "*i64" for q in range(MAX_WORLD)},
                 "n": "i32", "rank": "i32",
                 "WORLD": "constexpr", "CAPACITY": "constexpr", "PROGRAMS": "constexpr", "BLOCK": "constexpr"}
    constexprs = {"WORLD": world_size, "CAPACITY": CAPACITY_BYTES // element_bytes(dtype), "PROGRAMS": PROGRAMS,
                  "BLOCK": BLOCK}
    return [AotKernel(all_reduce_kernel, signature, constexprs, num_warps=NUM_WARPS, num_stages=1,
                      aligned=(*pointer_params(signature), "n"),
                      meta={"grid": f"({PROGRAMS}, 1, 1)", "world_size": world_size, "capacity_bytes": CAPACITY_BYTES,
                            "pointer_alignment": 16})]


def run(tensor: torch.Tensor, buffers: list[torch.Tensor], rank: int, layout: BufferLayout) -> None:
    """What `launch.py` does, through Triton's JIT: sum `tensor` over the ranks in place, with
    `buffers[q]` rank q's shared buffer (uint8, `layout.nbytes`) as this process sees it."""
    if not takes(tensor, layout.capacity_bytes):
        raise ValueError(f"the custom all-reduce does not take {tuple(tensor.shape)} ({tensor.nbytes} bytes)")
    counters, flags, data = zip(*(_regions(b, layout, tensor.dtype) for b in buffers))
    unused = [None] * (MAX_WORLD - len(buffers))
    all_reduce_kernel[(PROGRAMS,)](
        tensor, tensor, counters[rank], data[rank], flags[rank], *data, *unused, *flags, *unused, tensor.numel(), rank,
        WORLD=len(buffers), CAPACITY=layout.capacity_bytes // tensor.element_size(), PROGRAMS=PROGRAMS, BLOCK=BLOCK,
        num_warps=NUM_WARPS, num_stages=1)


def _regions(buffer: torch.Tensor, layout: BufferLayout, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One rank's buffer as its counters, flag table and data (typed views)."""
    return (buffer[:layout.flags_offset].view(torch.int64),
            buffer[layout.flags_offset:layout.data_offset].view(torch.int64),
            buffer[layout.data_offset:].view(dtype))
