"""One allocation per engine, carved into named regions.

An executor asks for every buffer it will ever use when it is built: the activations of the
memory plan, the KV-cache pool, and on a GPU the weights, the kernels' scratch buffers and the
logits handed back each step. `Arena` lays the regions out one after another (each aligned),
allocates them as one block of bytes on the device, and hands out typed views; nothing is
allocated afterwards, so a step never touches the allocator.
"""
from __future__ import annotations

import math

import torch

ALIGN = 256  # bytes: every region starts where any dtype's vector loads may begin


class Arena:
    def __init__(self, regions: dict[str, int], device: torch.device | str = "cpu"):
        """`regions` maps each name to its size in bytes, in layout order."""
        self.offsets: dict[str, tuple[int, int]] = {}
        end = 0
        for name, nbytes in regions.items():
            if nbytes < 0:
                raise ValueError(f"region {name!r} has a negative size ({nbytes} bytes)")
            self.offsets[name] = (end, nbytes)
            end += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = end
        self.buffer = torch.zeros(end, dtype=torch.uint8, device=device)

    def bytes(self, name: str) -> torch.Tensor:
        """The region as uint8."""
        start, nbytes = self.offsets[name]
        return self.buffer[start:start + nbytes]

    def view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """The region as a contiguous `dtype` tensor of `shape`, which must fill it exactly."""
        size = math.prod(shape) * dtype.itemsize
        if size != self.offsets[name][1]:
            raise ValueError(f"region {name!r} holds {self.offsets[name][1]} bytes, not {size} for {tuple(shape)}")
        return self.bytes(name).view(dtype).view(shape)
