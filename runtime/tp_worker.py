"""One tensor-parallel rank in its own process: the same CPU executor, driven over a pipe.

The worker joins the gloo process group, loads its rank's engine file and then serves calls
from the Session's process: `run` (copy-on-write copies, then one step) and `stop`. Every rank
runs every step; the row-parallel ops all-reduce inside their reference implementations, so
every rank ends with the full logits and only rank 0 sends them back.
"""
from __future__ import annotations

import os
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

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


def worker_main(engine_dir: str, rank: int, world_size: int, port: int, num_kv_blocks: int,
                conn: Connection, ping: Connection) -> None:
    from runtime.engine import load_engine
    from runtime.executor import CpuExecutor

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    threading.Thread(target=_answer_pings, args=(ping,), daemon=True).start()
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        executor = CpuExecutor(load_engine(engine_dir, rank=rank), num_kv_blocks)
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            call, args = conn.recv()
            if call == "stop":
                break
            try:
                logits = executor.run(*args)
                conn.send(("ok", logits if rank == 0 else None))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt):
        pass  # the Session's process is gone or stopping: nothing left to serve
    finally:
        dist.destroy_process_group()
