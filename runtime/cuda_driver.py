"""The runtime's calls into the CUDA driver API (`cuda.bindings`): loading cubins, launching
their kernels, and the device memory that tensor-parallel ranks share.

The runtime never compiles a kernel: `build-engine` puts cubins in the engine, and this
module loads them into the current CUDA context (torch's primary context) and launches them
on a stream. A launch is plain driver calls with no Python per thread block, so it can be
captured into a CUDA graph. A kernel built for programmatic dependent launch (its launch meta
says "pdl": it waits in the kernel for the one before it) is launched with that attribute on a
GPU that has it (sm_90 on), so it starts while the kernel before it finishes; a graph captures
the attribute as a programmatic edge. KILN_PROGRAMMATIC_LAUNCH=0 turns it off (every launch
then waits for the kernel before it to finish, as a plain launch does). Memory that other processes map (the custom all-reduce's
buffers, `runtime.peer_buffers`) is allocated here with `cuMemAlloc`: an IPC handle stands
for a whole allocation, and torch's caching allocator hands out parts of larger ones. A kernel
that takes a TMA descriptor by value (signature type "tensormap") gets one the host made with
`encode_tensor_map`.
"""
from __future__ import annotations

import ctypes
import math
import os
import struct
from dataclasses import dataclass, field
from functools import cache

# `struct` format of each Triton signature type of a kernel parameter, padded to an 8-byte slot
# (pointers are "Q").
_ARG_FORMATS = {"i1": "b7x", "i8": "b7x", "i16": "h6x", "i32": "i4x", "i64": "q", "u32": "I4x", "u64": "Q",
                "fp32": "f4x", "fp64": "d"}
# A TMA descriptor the host made (`encode_tensor_map`), taken by value as a `const __grid_constant__
# CUtensorMap`: 128 bytes, which the driver wants 64-byte aligned.
TENSOR_MAP = "tensormap"
_TENSOR_MAP_BYTES = 128
# Triton 3.6 kernels take two more pointers after their own parameters: global scratch (where
# a kernel that makes TMA descriptors on the device keeps them) and profile scratch (null).
_MAX_STATIC_SHARED = 48 * 1024
# cuTensorMapEncodeTiled's CUtensorMapDataType of each Triton element type (e4m3 as bytes), and
# the element's size.
_TENSOR_MAP_TYPES = {"bf16": (9, 2), "fp8e4nv": (0, 1)}
_SWIZZLE_128B, _L2_PROMOTION_256B = 3, 3


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


@cache
def _driver():
    from cuda.bindings import driver
    return driver


def _check(result, call: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


@dataclass
class CudaKernel:
    function: object
    name: str
    signature: list[str]   # Triton types of the non-constexpr parameters, in order
    num_warps: int
    shared_bytes: int
    global_scratch: int = 0   # bytes of global scratch each program needs
    # (address, programs it has room for) of the global scratch buffer, for a kernel that needs
    # one: its owner (the CUDA executor) sets it before the first launch.
    scratch: tuple[int, int] = (0, 0)
    # Launched with programmatic stream serialization (`programmatic_launch`): its owner sets it.
    programmatic: bool = False

    # Every parameter (and the two trailing scratch pointers) in a slot of one buffer, 8 bytes (a
    # tensor map: 128, aligned to 128), and the `void**` array pointing at the slots: made once,
    # refilled by every launch with one `struct.pack_into`. cuLaunchKernel copies the values
    # before it returns, and an executor launches from one thread, so the reuse is safe; making
    # them anew cost more host time than the launch itself on eager (prefill) steps.
    _layout: struct.Struct = field(init=False, repr=False)
    _buffer: ctypes.Array = field(init=False, repr=False)
    _start: int = field(init=False, repr=False)   # the first slot's offset in _buffer (128-byte aligned)
    _pointers: ctypes.Array = field(init=False, repr=False)
    _config: object = field(init=False, repr=False, default=None)   # cuLaunchKernelEx's, made once

    def __post_init__(self) -> None:
        formats, offsets, end = [], [], 0
        for kind in [*self.signature, "*", "*"]:
            size = _TENSOR_MAP_BYTES if kind == TENSOR_MAP else 8
            offset = -(-end // size) * size
            formats.append("x" * (offset - end) + (f"{size}s" if kind == TENSOR_MAP else
                                                   "Q" if kind.startswith("*") else _ARG_FORMATS[kind]))
            offsets.append(offset)
            end = offset + size
        self._layout = struct.Struct("<" + "".join(formats))
        self._buffer = ctypes.create_string_buffer(end + _TENSOR_MAP_BYTES)
        address = ctypes.addressof(self._buffer)
        self._start = -address % _TENSOR_MAP_BYTES
        self._pointers = (ctypes.c_void_p * len(offsets))(*[address + self._start + o for o in offsets])

    def params(self, args: list, global_scratch: int = 0) -> ctypes.Array:
        """The kernel parameter array (`void**`) for `args`, valid until the next call. Pointer
        arguments are device addresses (ints, e.g. `tensor.data_ptr()`); `global_scratch` is
        the address of the kernel's global scratch, 0 when it needs none."""
        if len(args) != len(self.signature):
            raise ValueError(f"kernel {self.name} takes {len(self.signature)} arguments, got {len(args)}")
        self._layout.pack_into(self._buffer, self._start, *args, global_scratch, 0)
        return self._pointers

    def launch(self, grid: tuple[int, int, int], args: list, stream: int = 0) -> None:
        """Launch on `stream` (a raw CUstream handle; 0 is the legacy default stream)."""
        address = 0
        if self.global_scratch:
            address, room = self.scratch
            if grid[0] * grid[1] * grid[2] > room:
                raise ValueError(f"kernel {self.name}: grid {grid} has more programs than its global scratch "
                                 f"holds ({room}); the launcher's grid must stay within the executor's bound")
        self.enqueue(grid, self.params(args, address), stream)

    def enqueue(self, grid: tuple[int, int, int], pointers: ctypes.Array, stream: int) -> None:
        """The driver call of `launch`, with the parameter array `params` made."""
        if self.programmatic:
            config = self._config or self._programmatic_config()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.hStream = stream
            _check(_driver().cuLaunchKernelEx(config, self.function, ctypes.addressof(pointers), 0),
                   f"cuLaunchKernelEx({self.name})")
            return
        _check(_driver().cuLaunchKernel(self.function, grid[0], grid[1], grid[2], 32 * self.num_warps, 1, 1,
                                        self.shared_bytes, stream, ctypes.addressof(pointers), 0),
               f"cuLaunchKernel({self.name})")

    def _programmatic_config(self) -> object:
        driver = _driver()
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = driver.CUlaunchConfig()
        config.blockDimX, config.blockDimY, config.blockDimZ = 32 * self.num_warps, 1, 1
        config.sharedMemBytes = self.shared_bytes
        config.attrs, config.numAttrs = [attribute], 1
        self._config = config
        return config


# The first driver whose stream capture turns programmatic launches into graph edges (CUDA 12.3).
_PROGRAMMATIC_CAPTURE_DRIVER = 12030


def programmatic_launch(meta: dict) -> bool:
    """Whether a kernel with launch meta `meta` is launched for programmatic dependent launch on
    this GPU: built for it, and the machine has it (`_programmatic_machine`)."""
    return bool(meta.get("pdl")) and _programmatic_machine()


@cache
def _programmatic_machine() -> bool:
    """A GPU that has programmatic dependent launch (sm_90 on), a driver that captures it into the
    decode graphs, and KILN_PROGRAMMATIC_LAUNCH not 0: asked once, not for every kernel loaded."""
    import torch
    return (torch.cuda.get_device_capability()[0] >= 9
            and _check(_driver().cuDriverGetVersion(), "cuDriverGetVersion") >= _PROGRAMMATIC_CAPTURE_DRIVER
            and os.environ.get("KILN_PROGRAMMATIC_LAUNCH", "1") != "0")


def _ensure_context() -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    import torch
    driver = _driver()
    _check(driver.cuInit(0), "cuInit")
    if int(_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
        device = _check(driver.cuDeviceGet(torch.cuda.current_device()), "cuDeviceGet")
        context = _check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def load_kernel(cubin: bytes, name: str, signature: list[str], num_warps: int, shared_bytes: int,
                global_scratch: int = 0) -> CudaKernel:
    """Load one kernel of a cubin into the current device's primary context."""
    _ensure_context()
    driver = _driver()
    module = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
    function = _check(driver.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
    if shared_bytes > _MAX_STATIC_SHARED:
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(function, attr, shared_bytes), f"cuFuncSetAttribute({name})")
    return CudaKernel(function, name, signature, num_warps, shared_bytes, global_scratch)


def encode_tensor_map(address: int, element: str, shape: tuple[int, ...], box: tuple[int, ...]) -> bytes:
    """The 128 bytes of a TMA descriptor of the contiguous row-major tensor of `element`s ("bf16" or
    "fp8e4nv") of `shape` (2 to 5 dimensions, outermost first: [rows, cols] for a matrix) at device
    `address`, copied in boxes of `box` into shared memory with the 128-byte swizzle (the innermost box
    dimension x element size must be 128 bytes or less). Elements past `shape` read as zeros. Made through
    libcuda itself: the driver wants the descriptor's memory 64-byte aligned, which cuda.bindings'
    CUtensorMap objects were not always."""
    kind, size = _TENSOR_MAP_TYPES[element]
    rank = len(shape)
    pitches = [size * math.prod(shape[d + 1:]) for d in range(rank - 1)]   # bytes a step of each outer dim
    if (not 2 <= rank == len(box) <= 5 or address % 16 or any(pitch % 16 for pitch in pitches)
            or box[-1] * size > 128):
        raise ValueError(f"no TMA descriptor for a {list(shape)} {element} tensor at {address:#x} in boxes of "
                         f"{list(box)}: the address and the row pitch must be 16-byte aligned and a "
                         "box row at most 128 bytes")
    memory = ctypes.create_string_buffer(2 * _TENSOR_MAP_BYTES)
    aligned = ctypes.addressof(memory) + (-ctypes.addressof(memory) % _TENSOR_MAP_BYTES)
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    result = _libcuda().cuTensorMapEncodeTiled(
        ctypes.c_void_p(aligned), kind, rank, ctypes.c_void_p(address), (u64 * rank)(*reversed(shape)),
        (u64 * (rank - 1))(*reversed(pitches)), (u32 * rank)(*reversed(box)), (u32 * rank)(*[1] * rank), 0,
        _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    if result != 0:
        raise CudaError(f"cuTensorMapEncodeTiled failed: CUresult {result}")
    return ctypes.string_at(aligned, _TENSOR_MAP_BYTES)


@cache
def _libcuda() -> ctypes.CDLL:
    library = ctypes.CDLL("libcuda.so.1")
    library.cuTensorMapEncodeTiled.restype = ctypes.c_int
    return library


def device_arch() -> str:
    """This machine's GPU as a build target, e.g. "sm_90"."""
    import torch
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def alloc_shared(nbytes: int) -> int:
    """A zeroed device allocation of `nbytes` that other processes can map (`ipc_handle`)."""
    _ensure_context()
    driver = _driver()
    pointer = _check(driver.cuMemAlloc(nbytes), "cuMemAlloc")
    try:
        _check(driver.cuMemsetD8(pointer, 0, nbytes), "cuMemsetD8")
    except CudaError:
        free_shared(int(pointer))
        raise
    return int(pointer)


def free_shared(pointer: int) -> None:
    _check(_driver().cuMemFree(pointer), "cuMemFree")


def ipc_handle(pointer: int) -> bytes:
    """The handle (64 bytes) another process opens `pointer`'s allocation with."""
    return bytes(_check(_driver().cuIpcGetMemHandle(pointer), "cuIpcGetMemHandle").reserved)


def open_ipc_handle(handle: bytes) -> int:
    """Map another process's allocation into this one; returns its address here. Peer access
    between the two GPUs is enabled as needed."""
    _ensure_context()
    driver = _driver()
    ipc = driver.CUipcMemHandle()
    ipc.reserved = handle
    flags = int(driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    return int(_check(driver.cuIpcOpenMemHandle(ipc, flags), "cuIpcOpenMemHandle"))


def close_ipc_handle(pointer: int) -> None:
    _check(_driver().cuIpcCloseMemHandle(pointer), "cuIpcCloseMemHandle")
