"""A driver launch's parameter array (`runtime.cuda_driver.CudaKernel.params`), on the CPU: each
kernel keeps one array and refills it for every launch, so each launch must find exactly its own
arguments there, typed as the kernel's signature says, with the two trailing scratch pointers."""
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
