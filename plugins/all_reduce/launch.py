"""Driver launch of `all_reduce`'s AOT kernel, and the layout of the buffer each rank shares.

One buffer per rank, `BufferLayout.nbytes` long, zeroed before first use (zero bits mean "not
arrived", see `kernels.py`); every rank maps every other rank's (`runtime.all_reduce`). In it,
from its start: the call counter of each program (int64, touched by its owner only), then,
256-byte aligned, two copies of `world_size` slots of `capacity_bytes` for message data, slot q
written by rank q.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.plugins.driver_launch import check_aligned, grid

MAX_WORLD = 8      # pointer slots in the kernel's signature: one per rank
# The kernel's fixed grid; each program has its own counter. 128 programs of 1,024 elements put
# a 64-row decode message on most of an H200's SMs in two rounds.
PROGRAMS = 128
# The largest message: a decode step's hidden states up to batch 64 at hidden size 4096 in
# bf16. Larger messages go to NCCL, whose bandwidth wins there.
CAPACITY_BYTES = 512 * 1024
# What the kernel's meta says it speaks; an engine whose kernel says otherwise (or nothing: the
# flag-and-read kernel of engines built before it) sums with NCCL (`runtime.all_reduce`).
PROTOCOL = "push"
_INT64 = 8
_ALIGN = 256


@dataclass(frozen=True)
class BufferLayout:
    world_size: int
    capacity_bytes: int  # the largest message, one slot

    @property
    def data_offset(self) -> int:
        return -(-PROGRAMS * _INT64 // _ALIGN) * _ALIGN

    @property
    def nbytes(self) -> int:
        return self.data_offset + 2 * self.world_size * self.capacity_bytes


def takes(tensor: torch.Tensor, capacity_bytes: int) -> bool:
    """Whether the kernel can sum `tensor`: contiguous, at most `capacity_bytes`, and a multiple
    of 16 elements (the cubin is compiled knowing it, so its loads are 16 bytes wide)."""
    return tensor.is_contiguous() and tensor.nbytes <= capacity_bytes and tensor.numel() % 16 == 0


def launch(kernel, meta: dict, tensor: torch.Tensor, bases: list[int], rank: int, layout: BufferLayout,
           stream: int) -> None:
    """Sum `tensor` over the ranks, in place (`takes` must hold). `bases` are the device
    addresses of every rank's buffer as mapped in this process."""
    if not takes(tensor, layout.capacity_bytes):
        raise ValueError(f"the custom all-reduce does not take {tuple(tensor.shape)} ({tensor.nbytes} bytes): "
                         f"it needs a contiguous tensor of at most {layout.capacity_bytes} bytes and a multiple "
                         "of 16 elements")
    check_aligned(meta, tensor)
    unused = [0] * (MAX_WORLD - len(bases))
    own = bases[rank]
    kernel.launch(grid(meta["grid"], {}),
                  [tensor.data_ptr(), tensor.data_ptr(), own, own + layout.data_offset,
                   *[b + layout.data_offset for b in bases], *unused, tensor.numel(), rank], stream)
