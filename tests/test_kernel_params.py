"""A driver launch's parameter array (`runtime.cuda_driver.CudaKernel.params`), on the CPU: each
kernel keeps one array and refills it for every launch, so each launch must find exactly its own
arguments there, typed as the kernel's signature says, with the two trailing scratch pointers; a TMA
descriptor ("tensormap") whole, in a 128-byte slot on a 128-byte boundary."""
from __future__ import annotations

import ctypes

import pytest

from kiln.runtime.cuda_driver import CudaKernel

SIGNATURE = ["*fp32", "i32", "fp32", "*i32"]
CTYPES = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]


def _read(array: ctypes.Array) -> list:
    return [ctypes.cast(array[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(CTYPES)]


def test_every_launch_finds_its_own_arguments_in_the_kernels_array():
    kernel = CudaKernel(None, "k", SIGNATURE, num_warps=4, shared_bytes=0)
    first = kernel.params([0x1000, 7, 0.5, 0x2000], global_scratch=0x3000)
    assert _read(first) == [0x1000, 7, 0.5, 0x2000, 0x3000, 0]
    second = kernel.params([0x1100, -3, 2.0, 0x2100])
    assert second is first  # the same array, refilled
    assert _read(second) == [0x1100, -3, 2.0, 0x2100, 0, 0]


def test_a_launch_with_the_wrong_number_of_arguments_is_refused():
    kernel = CudaKernel(None, "k", SIGNATURE, num_warps=4, shared_bytes=0)
    with pytest.raises(ValueError, match="takes 4 arguments, got 2"):
        kernel.params([1, 2])


def test_a_tensor_map_travels_whole_in_an_aligned_slot_between_the_others():
    kernel = CudaKernel(None, "k", ["i32", "tensormap", "tensormap", "*bf16", "i32"], num_warps=12, shared_bytes=0)
    maps = [bytes(range(128)), bytes(range(255, 127, -1))]
    pointers = kernel.params([5, *maps, 0x4000, 9])
    assert ctypes.c_int32.from_address(pointers[0]).value == 5
    for i, expected in ((1, maps[0]), (2, maps[1])):
        assert pointers[i] % 128 == 0
        assert ctypes.string_at(pointers[i], 128) == expected
    assert ctypes.c_uint64.from_address(pointers[3]).value == 0x4000
    assert ctypes.c_int32.from_address(pointers[4]).value == 9
    assert pointers[3] >= pointers[2] + 128   # the second map is not overwritten by what follows
    assert ctypes.c_uint64.from_address(pointers[5]).value == 0   # no global scratch
