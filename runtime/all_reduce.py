"""How a tensor-parallel rank on a GPU sums a row-parallel op's output over the ranks.

Messages that the custom all-reduce takes (`plugins/all_reduce`: up to 512 KiB, a decode
step's hidden states) go through it: one kernel that pushes this rank's partial into every
peer's buffer over NVLink and sums what the peers pushed into its own.
Larger ones (prefill chunks) go to NCCL, whose bandwidth wins there. The choice is made per
launch from the tensor's size and dtype, which are the same on every rank, so the ranks never
disagree; both run on torch's current stream, so a CUDA graph captures either.

`open_all_reduce` sets the custom path up when a rank's executor is built: the engine's
kernel for this GPU and every rank's buffer (`runtime.peer_buffers`). It is off when the
Session's process has KILN_ALL_REDUCE=nccl in its environment (`all_reduce_mode`, passed to
every worker) and when some rank cannot take part: then rank 0 logs why and every rank uses
NCCL alone.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from kiln.dtypes import torch_dtype
from kiln.plugins.all_reduce import launch as custom
from kiln.runtime.cuda_driver import CudaError, CudaKernel, device_arch, load_kernel
from kiln.runtime.engine import Engine
from kiln.runtime.peer_buffers import Gather, PeerBuffers, open_peer_buffers

log = logging.getLogger(__name__)

ENV_VAR = "KILN_ALL_REDUCE"
MODES = ("auto", "nccl")


def all_reduce_mode(environ: Mapping[str, str] = os.environ) -> str:
    """The all-reduce mode the environment asks for: "auto" (the custom kernel where it takes
    the message, NCCL otherwise; the default) or "nccl" (NCCL only)."""
    mode = environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={environ[ENV_VAR]!r} is not an all-reduce mode: use 'auto' (the custom "
                         "all-reduce for decode-sized messages, NCCL for the rest) or 'nccl' (NCCL only)")
    return mode


class CustomAllReduce:
    """The one-shot kernel over every rank's mapped buffer, for the messages it takes."""

    def __init__(self, kernel: CudaKernel, meta: dict, dtype: torch.dtype, buffers: PeerBuffers):
        self.kernel, self.meta, self.dtype, self.buffers = kernel, meta, dtype, buffers
        self.layout = custom.BufferLayout(len(buffers.bases), meta["capacity_bytes"])

    def takes(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == self.dtype and custom.takes(tensor, self.layout.capacity_bytes)

    def __call__(self, tensor: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        custom.launch(self.kernel, self.meta, tensor, self.buffers.bases, self.buffers.rank, self.layout, stream)

    def close(self) -> None:
        torch.cuda.synchronize()  # this rank's last reads of its peers' buffers are done
        self.buffers.close()


class AllReduce:
    """Sums a tensor over the ranks in place: with `custom` where it takes the tensor, with
    NCCL otherwise (always, without `custom`)."""

    def __init__(self, custom_all_reduce: CustomAllReduce | None = None):
        self.custom = custom_all_reduce

    def uses_custom(self, tensor: torch.Tensor) -> bool:
        return self.custom is not None and self.custom.takes(tensor)

    def __call__(self, tensor: torch.Tensor) -> None:
        if self.uses_custom(tensor):
            self.custom(tensor)
        else:
            dist.all_reduce(tensor)

    def close(self) -> None:
        """Release the custom path's buffers; every rank calls it together, with its own GPU
        work finished."""
        if self.custom is not None:
            self.custom.close()
            self.custom = None


def gloo_gather(group: dist.ProcessGroup) -> Gather:
    """A `Gather` over a gloo group: every rank's object, in rank order."""
    def gather(obj: object) -> list:
        objects = [None] * dist.get_world_size(group)
        dist.all_gather_object(objects, obj, group=group)
        return objects
    return gather


def open_all_reduce(engine: Engine, mode: str, gather: Gather) -> AllReduce:
    """The all-reduce for this rank of `engine`, whose ranks all call this together (see the
    module's docstring); `gather` is their control channel."""
    if mode == "nccl":
        return AllReduce()
    m = engine.manifest
    arch = device_arch()
    keys = m.all_reduce_kernels.get(arch, ())
    info = m.kernels[keys[0]] if keys else None
    kernel = problem = None
    if info is None:
        problem = (f"the engine holds no custom all-reduce kernel for {arch} (built with an older Kiln, or for "
                   f"more than {custom.MAX_WORLD} ranks)")
    elif info.launch.get("protocol") != custom.PROTOCOL:
        problem = ("the engine's custom all-reduce kernel is an older one that this Kiln does not launch: "
                   "rebuild the engine to use it")
    else:
        try:
            kernel = load_kernel(engine.kernels[keys[0]], info.entry, list(info.signature), info.num_warps,
                                 info.shared_bytes)
        except CudaError as e:
            problem = str(e)
    capacity = info.launch["capacity_bytes"] if info is not None else custom.CAPACITY_BYTES
    buffers = open_peer_buffers(custom.BufferLayout(m.world_size, capacity).nbytes, m.rank, gather, problem)
    if isinstance(buffers, str):
        if m.rank == 0:
            log.warning("the custom all-reduce is off (%s): every all-reduce goes through NCCL", buffers)
        return AllReduce()
    return AllReduce(CustomAllReduce(kernel, info.launch, torch_dtype(m.dtype), buffers))
