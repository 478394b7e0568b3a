"""One rank of tests/test_all_reduce_gpu.py, run as `python tests/all_reduce_rank.py RANK
WORLD PORT OUT_JSON` on GPU RANK (a plain script, not a test file: each rank is its own
process, as the workers of a Session are).

The rank joins NCCL (and a gloo group for the buffer exchange), compiles the custom
all-reduce for this GPU with `build-engine`'s compiler, sets it up as an engine's rank does
(`runtime.all_reduce`, `runtime.peer_buffers`) and checks it three ways, writing what it
found to OUT_JSON:
- eager: every size and dtype summed by the custom kernel equals NCCL's sum of the same data,
  bit for bit (two ranks add two numbers: one rounding, whoever adds);
- graph: a CUDA graph of three custom all-reduces, captured once and replayed REPLAYS times
  with new data each time, gives the sum of every rank's data each time (every rank makes
  every rank's data from shared seeds);
- timing: microseconds per all-reduce of a few decode sizes, custom against NCCL, each in a
  CUDA graph of 50.
"""
from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from kiln.dtypes import dtype_name
from kiln.plugins.aot import compile_cubin
from kiln.plugins.all_reduce.kernels import aot_kernels
from kiln.plugins.all_reduce.launch import CAPACITY_BYTES, BufferLayout
from kiln.runtime.all_reduce import AllReduce, CustomAllReduce, gloo_gather
from kiln.runtime.cuda_driver import device_arch, load_kernel
from kiln.runtime.peer_buffers import PeerBuffers, open_peer_buffers

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REPLAYS = 200
HIDDEN = 4096


def _sizes(dtype: torch.dtype) -> list[int]:
    """Elements: odd multiples of 16, decode batches of 1 and 8 rows of HIDDEN, and up to the
    capacity (64 rows in bf16)."""
    most = CAPACITY_BYTES // dtype.itemsize
    return [16, 48, 1008, HIDDEN, 8 * HIDDEN, most - 16, most]


def _custom(dtype: torch.dtype, buffers: PeerBuffers) -> CustomAllReduce:
    (kernel,) = aot_kernels(dtype_name(dtype), dist.get_world_size())
    cubin = compile_cubin(kernel, device_arch())
    loaded = load_kernel(cubin.binary, cubin.name, [t for t in kernel.signature.values() if t != "constexpr"],
                         cubin.num_warps, cubin.shared_bytes)
    return CustomAllReduce(loaded, kernel.meta, dtype, buffers)


def _data(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, generator=gen, device="cuda").to(dtype)


def _eager(custom: CustomAllReduce, dtype: torch.dtype, rank: int) -> list[str]:
    wrong = []
    for n in _sizes(dtype):
        x = _data(1000 * rank + n, n, dtype)
        ours, nccl = x.clone(), x.clone()
        custom(ours)
        dist.all_reduce(nccl)
        if not torch.equal(ours, nccl):
            wrong.append(f"{dtype_name(dtype)} n={n}: {(ours != nccl).sum().item()} elements differ from NCCL's")
    return wrong


def _graph(custom: CustomAllReduce, dtype: torch.dtype, world: int) -> list[str]:
    sizes = (HIDDEN, 16 * HIDDEN, CAPACITY_BYTES // dtype.itemsize)
    work = [torch.empty(n, dtype=dtype, device="cuda") for n in sizes]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # an eager call first, as CUDA graph capture advises
        for w in work:
            custom(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in work:
            custom(w)
    wrong = []
    rank = dist.get_rank()
    # Every replay runs on every rank whatever it finds: a rank that stopped early would leave
    # its peers waiting for its data.
    for replay in range(REPLAYS):
        for i, w in enumerate(work):
            w.copy_(_data(replay * 100 + i * 10 + rank, w.numel(), dtype))
        graph.replay()
        for i, w in enumerate(work):
            parts = [_data(replay * 100 + i * 10 + r, w.numel(), dtype).float() for r in range(world)]
            expected = sum(parts[1:], parts[0]).to(dtype)
            if not torch.equal(w, expected):
                wrong.append(f"{dtype_name(dtype)} replay {replay} message {i}: {(w != expected).sum().item()} "
                             "elements differ from the sum")
    torch.cuda.synchronize()
    return wrong[:5]


def _timed_us(summing, n: int, dtype: torch.dtype, repeats: int = 50) -> float:
    x = torch.zeros(n, dtype=dtype, device="cuda")
    summing(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            summing(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * repeats)


def main(rank: int, world: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    gather = gloo_gather(dist.new_group(backend="gloo"))
    buffers = open_peer_buffers(BufferLayout(world, CAPACITY_BYTES).nbytes, rank, gather)
    if isinstance(buffers, str):
        raise RuntimeError(f"the ranks could not share buffers: {buffers}")
    result = {"eager": [], "graph": [], "timing_us": {}}
    started = time.monotonic()
    for dtype in DTYPES:
        custom = _custom(dtype, buffers)
        result["eager"] += _eager(custom, dtype, rank)
        result["graph"] += _graph(custom, dtype, world)
    bf16 = _custom(torch.bfloat16, buffers)
    for rows in (1, 8, 64):
        n = rows * HIDDEN
        result["timing_us"][f"bf16 {rows}x{HIDDEN}"] = {"custom": _timed_us(AllReduce(bf16), n, torch.bfloat16),
                                                        "nccl": _timed_us(AllReduce(), n, torch.bfloat16)}
    result["seconds"] = time.monotonic() - started
    torch.cuda.synchronize()
    AllReduce(bf16).close()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
