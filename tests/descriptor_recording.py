"""Driving a CuTe kernel's launcher without a GPU: `Recorder` stands in for a loaded kernel and keeps each
launch's grid and arguments (and the kernel's name, where it is given one); `recorded_descriptors` stands in
for libcuda's TMA descriptor encoder (`runtime.cuda_driver.encode_tensor_map`, as `linear.launch.tensor_map`
calls it) and lists what each launcher asked for, descriptor i being 128 bytes of the value i."""
from __future__ import annotations

import contextlib
from unittest import mock

from kiln.plugins.linear import launch as linear_launch


class Recorder:
    def __init__(self, name: str | None = None, log: list | None = None):
        self.name, self.launches = name, [] if log is None else log

    def launch(self, grid, args, stream):
        self.launches.append((self.name, grid, args) if self.name is not None else (grid, args))


@contextlib.contextmanager
def recorded_descriptors():
    """The list of (address, element, shape, box) of every descriptor made in the block, in order."""
    encoded = []

    def encode(address, element, shape, box):
        encoded.append((address, element, shape, box))
        return bytes([len(encoded)]) * 128

    linear_launch.tensor_map.cache_clear()
    try:
        with mock.patch.object(linear_launch, "encode_tensor_map", encode):
            yield encoded
    finally:
        linear_launch.tensor_map.cache_clear()
