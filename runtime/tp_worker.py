"""One tensor-parallel rank in its own process: an executor driven over a pipe.

Started by `kiln.runtime.tp_executor` as `python -m kiln.runtime.tp_worker ENGINE_DIR RANK
WORLD_SIZE PORT NUM_KV_BLOCKS DEVICE ALL_REDUCE CONN_FD PING_FD SHARED_FD`: how GPU ranks sum
(`runtime.all_reduce.MODES`), two inherited socket ends and the shared buffer that carries each
step's inputs.

The worker joins the process group (gloo with the CPU executor, or NCCL with the CUDA executor
on GPU `rank`, plus a gloo group over which the ranks set up the custom all-reduce), loads its
rank's engine file, answers with where its arena holds the step inputs and whether it sums
with the custom all-reduce, and then serves calls from the Session's process: `step` (the
slot of the shared buffer holding the step's inputs, its sizes, the copy-on-write copies, the
rows to feed from the previous step's sampled ids and the `Picks`), `settle` (answer for the
step launched last), `collective_seconds` (bench-engine's estimate of a step's collective time,
`runtime.collectives`) and `stop`. Every rank runs every step; row-parallel ops all-reduce
(inside their reference implementations on the CPU, after their kernels on the GPU:
`runtime.all_reduce`) and the vocabulary-parallel LM head gathers its slices of the logits
the same way (`plugins.linear.reference.all_gather_columns`), so every rank ends with the same
full logits and picks the same tokens from them on its device (same sampler state, same
seeds), which it feeds to its next step. A rank answers for step N once it has launched step N+1 (or is told to settle): rank 0 with the
ids and logprobs entries, the others with None.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kiln.runtime.all_reduce import AllReduce, gloo_gather, open_all_reduce
from kiln.runtime.collector import freeze_loaded
from kiln.runtime.collectives import step_collective_seconds
from kiln.runtime.executor import ArenaExecutor
from kiln.runtime.step import Feed, SampledIds
from kiln.runtime.tp_executor import input_slots

# How long a rank waits in a collective for a peer before failing; the Session's own deadline
# is shorter, so a dead peer is reported by the Session, not by a gloo timeout.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _answer_pings(conn: Connection) -> None:
    """Runs beside the step: a rank blocked in a collective still answers, a hung process not."""
    try:
        while True:
            conn.recv()
            conn.send("pong")
    except (EOFError, OSError):
        pass


def _open_executor(engine_dir: str, rank: int, world_size: int, num_kv_blocks: int, device: str,
                   all_reduce: str) -> tuple[ArenaExecutor, AllReduce]:
    """Join the process group and load this rank's engine: gloo and the CPU executor, or NCCL
    and the CUDA executor on GPU `rank`. Returns the executor and how it sums over the ranks."""
    from kiln.runtime.engine import load_engine

    if device == "cuda":
        from kiln.runtime.cuda_driver import device_arch
        from kiln.runtime.cuda_executor import CudaExecutor

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=torch.device("cuda", rank))
        control = dist.new_group(backend="gloo")
        engine = load_engine(engine_dir, rank=rank, target=device_arch())
        summing = open_all_reduce(engine, all_reduce, gloo_gather(control))
        return CudaExecutor(engine, num_kv_blocks, all_reduce=summing), summing
    from kiln.runtime.executor import CpuExecutor

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    return CpuExecutor(load_engine(engine_dir, rank=rank), num_kv_blocks), AllReduce()


def worker_main(engine_dir: str, rank: int, world_size: int, port: int, num_kv_blocks: int,
                conn: Connection, ping: Connection, shared: torch.Tensor, device: str = "cpu",
                all_reduce: str = "auto") -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    threading.Thread(target=_answer_pings, args=(ping,), daemon=True).start()
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        executor, summing = _open_executor(engine_dir, rank, world_size, num_kv_blocks, device, all_reduce)
        conn.send(("ready", (executor.inputs.slots, summing.custom is not None)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    freeze_loaded()
    slots = input_slots(shared, executor.inputs.nbytes)
    pending: SampledIds | None = None  # the step launched last, not answered yet
    try:
        while True:
            call, args = conn.recv()
            if call == "stop":
                summing.close()
                break
            if call == "step":
                # Launch this step, then answer for the one before it: its tokens are ready by
                # the time this one is queued behind it.
                try:
                    slot, sizes, copies, fed, picks = args
                    feed = None if fed is None else Feed(*fed, pending.ids)
                    launched = executor.execute(executor.inputs.unpack(slots[slot], sizes), copies, feed, picks)
                except Exception:
                    _answer(conn, rank, pending)
                    pending = None
                    conn.send(("error", traceback.format_exc()))
                    continue
                _answer(conn, rank, pending)
                pending = launched or _NO_PICKS
            elif call == "settle":
                _answer(conn, rank, pending)
                pending = None
            elif call == "collective_seconds":
                try:
                    conn.send(("ok", step_collective_seconds(executor.engine, args, executor.kv_cache.device, summing)))
                except Exception:
                    conn.send(("error", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt):
        pass  # the Session's process is gone or stopping: nothing left to serve
    finally:
        dist.destroy_process_group()


class _NoPicks:
    """A launched step that picks no tokens (prefill chunks only): its answer carries none."""

    ids = None

    def wait(self) -> None:
        return None


_NO_PICKS = _NoPicks()


def _answer(conn: Connection, rank: int, launched: SampledIds | _NoPicks | None) -> None:
    """Reply for the launched step: rank 0 with its token ids and logprobs entries (reading them
    waits for the step), the other ranks with None once it has run (an error here is the step's)."""
    if launched is None:
        return
    try:
        sampled = launched.wait()
        conn.send(("ok", sampled if rank == 0 else None))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _map_shared(fd: int) -> torch.Tensor:
    """The shared step-inputs buffer, as uint8 (the mapping keeps it; the descriptor can go)."""
    buffer = mmap.mmap(fd, 0)
    os.close(fd)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def main(argv: list[str]) -> None:
    engine_dir, rank, world_size, port, num_kv_blocks, device, all_reduce, conn_fd, ping_fd, shared_fd = argv
    worker_main(engine_dir, int(rank), int(world_size), int(port), int(num_kv_blocks), Connection(int(conn_fd)),
                Connection(int(ping_fd)), _map_shared(int(shared_fd)), device, all_reduce)


if __name__ == "__main__":
    main(sys.argv[1:])
