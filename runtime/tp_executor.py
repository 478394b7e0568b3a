"""The executor for a tensor-parallel engine: one worker process per rank.

The Session's process schedules; each step it writes the step inputs, laid out like the
arena's input region (`runtime.executor.InputRegion`), into one of two slots of a shared-memory
buffer that every worker maps at start-up, and sends each rank the same small header (the slot,
the step's sizes, block copies, the `Feed` rows and the `Picks`). Every rank runs the step and
picks its tokens from the full logits with the same `SequenceSampler` state and seeds (an
unseeded sequence gets a seed here), so every rank holds the same sampled ids on its device and
feeds them to its next step itself: the overlapped engine loop (runtime/overlap.py) works as on
one GPU. Only rank 0 sends its ids back (and logprobs entries when asked).

Replies are pipelined: a rank answers for step N after it has launched step N+1, or when told
to settle, so the host work of both processes overlaps the GPUs. `execute` returns a
`RankTokens` whose `wait` collects step N's replies, in step order, with a deadline. A rank that
dies, hangs or fails is named in the error, the step fails (so the Session fails the requests in
flight) and `close()` reaps every worker.

Workers are fresh interpreters (`python -m kiln.runtime.tp_worker`), not multiprocessing
children: multiprocessing's spawn re-imports the caller's `__main__`, which fails for a script
without an `if __name__ == "__main__":` guard, one fed on standard input, or a notebook. Each
worker inherits the two ends of its socket pairs (steps, pings) and the shared buffer (an
anonymous memory file: nothing to unlink, gone with its last process) as file descriptors.

Slot N % 2 is written again only for step N + 2, after every rank has answered for step N,
which a rank does only after it has copied step N's inputs out (when it launched N + 1).
"""
from __future__ import annotations

import dataclasses
import mmap
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

import kiln
from kiln.runtime.executor import InputRegion
from kiln.runtime.sampler import Picks
from kiln.runtime.step import Feed, StepInputs

STARTUP_TIMEOUT = 120.0
STEP_TIMEOUT = 60.0
# Step-input slots in the shared buffer: the step being written and the one a rank may still be reading.
SLOTS = 2
# How long a rank's error waits for another rank's death to show: a rank whose collective failed
# because a peer died answers within milliseconds of that peer's exit.
PEER_DEATH_GRACE = 0.5


class WorkerError(RuntimeError):
    """A tensor-parallel rank died, hung or failed; the message names it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    """The caller's environment, with the folder Kiln was imported from first on the path, so a
    worker imports this same Kiln (a source checkout run with PYTHONPATH=. included)."""
    home = str(Path(kiln.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": home if not path else f"{home}{os.pathsep}{path}"}


def slot_bytes(nbytes: int) -> int:
    """A slot's size in the shared buffer: `nbytes` rounded up so every slot's int64 views align."""
    return -(-nbytes // 64) * 64


def input_slots(buffer: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
    """The SLOTS views of `nbytes` each into the shared buffer, the same in every process."""
    stride = slot_bytes(nbytes)
    return [buffer[i * stride:i * stride + nbytes] for i in range(SLOTS)]


def _shared_buffer(nbytes: int) -> tuple[int, torch.Tensor]:
    """An anonymous shared-memory file of `nbytes` and this process's uint8 view of it."""
    fd = os.memfd_create("kiln-step-inputs")
    os.ftruncate(fd, nbytes)
    return fd, torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)


def _start_worker(engine_dir: str | Path, rank: int, world_size: int, port: int, num_kv_blocks: int,
                  device: str, all_reduce: str, shared_fd: int) -> tuple[subprocess.Popen, Connection, Connection]:
    """Start rank `rank`'s worker; returns it with this side's step and ping connections."""
    conn, child_conn = mp.Pipe()
    ping, child_ping = mp.Pipe()
    fds = (child_conn.fileno(), child_ping.fileno(), shared_fd)
    proc = subprocess.Popen([sys.executable, "-m", "kiln.runtime.tp_worker", str(engine_dir), str(rank),
                             str(world_size), str(port), str(num_kv_blocks), device, all_reduce, *map(str, fds)],
                            pass_fds=fds, env=_worker_env())
    # Only the worker holds its ends now, so its death reads as end-of-file here.
    child_conn.close()
    child_ping.close()
    return proc, conn, ping


class TensorParallelExecutor:
    def __init__(self, engine_dir: str | Path, world_size: int, num_kv_blocks: int, inputs: InputRegion,
                 step_timeout: float = STEP_TIMEOUT, device: str = "cpu", all_reduce: str = "auto"):
        """`inputs`: rank 0's input region, which every rank must share; `all_reduce`: how GPU
        ranks sum (`runtime.all_reduce.MODES`)."""
        port = _free_port()
        self.step_timeout = step_timeout
        self.inputs = inputs
        shared_fd, shared = _shared_buffer(SLOTS * slot_bytes(inputs.nbytes))
        self.slots = input_slots(shared, inputs.nbytes)
        self.sent = self.answered = 0          # steps sent to the ranks, and answered by all of them
        self.replies: dict[int, tuple] = {}    # step -> rank 0's reply, kept until its RankTokens waits
        self.conns, self.pings, self.procs = [], [], []
        try:
            for rank in range(world_size):
                proc, conn, ping = _start_worker(engine_dir, rank, world_size, port, num_kv_blocks, device, all_reduce,
                                                 shared_fd)
                self.procs.append(proc)
                self.conns.append(conn)
                self.pings.append(ping)
        finally:
            os.close(shared_fd)  # the workers hold their own; the mapping here keeps the memory
        try:
            ready = self._gather(STARTUP_TIMEOUT, "starting")
            for rank, (slots, _) in enumerate(ready):
                if slots != inputs.slots:
                    raise WorkerError(f"tensor-parallel rank {rank} places its step inputs elsewhere in its arena "
                                      "than rank 0: the engine folder mixes builds; rebuild it into an empty folder")
        except WorkerError:
            self.close()
            raise
        # Whether decode-sized all-reduces take the custom kernel (`runtime.all_reduce`): the
        # ranks agree on it when they set it up.
        self.custom_all_reduce: bool = ready[0][1]

    def _gather(self, timeout: float, doing: str) -> list:
        """Wait for one reply from every rank; raise naming the first rank that failed."""
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(self.conns):
            pending = {c: r for r, c in enumerate(self.conns) if r not in replies}
            ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self._timeout(sorted(pending.values()), timeout, doing)
            for rank in sorted(pending.values()):
                conn = self.conns[rank]
                if conn in ready:
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):  # the pipe closes or resets when the rank's process dies
                        status, payload = "died", None
                    if status != "ok" and status != "ready":
                        raise self._root_failure(rank, status, payload, doing)
                    replies[rank] = payload
        return [replies[r] for r in range(len(self.conns))]

    def _timeout(self, late: list[int], timeout: float, doing: str) -> WorkerError:
        """Tell a hung rank from the ranks blocked in a collective waiting for it."""
        for rank in late:
            try:
                self.pings[rank].send("ping")
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        alive = set()
        for rank in late:
            if self.pings[rank].poll(max(0.0, deadline - time.monotonic())):
                try:
                    self.pings[rank].recv()
                    alive.add(rank)
                except (EOFError, OSError):
                    pass
        hung = [r for r in late if r not in alive] or late
        names = ", ".join(str(r) for r in hung)
        waiting = sorted(alive - set(hung))
        also = f" (rank {', '.join(map(str, waiting))} waiting on it)" if waiting else ""
        return WorkerError(f"tensor-parallel rank {names} did not answer within {timeout:.0f} s while {doing}{also}")

    def _root_failure(self, rank: int, status: str, payload, doing: str) -> WorkerError:
        """`rank`'s failure, unless another rank's process has died: then that one, the cause
        (a rank whose all-reduce lost its peer can answer before the dead peer's pipe closes)."""
        if status == "error":
            deadline = time.monotonic() + PEER_DEATH_GRACE
            while True:
                dead = [r for r, proc in enumerate(self.procs) if r != rank and proc.poll() is not None]
                if dead:
                    failure = self._failure(dead[0], "died", None, doing)
                    last = (str(payload).strip().splitlines() or [""])[-1]
                    return WorkerError(f"{failure} (then rank {rank} failed: {last})")
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
        return self._failure(rank, status, payload, doing)

    def _failure(self, rank: int, status: str, payload, doing: str) -> WorkerError:
        if status == "error":
            return WorkerError(f"tensor-parallel rank {rank} failed while {doing}:\n{payload}")
        try:
            code = self.procs[rank].wait(1)
        except subprocess.TimeoutExpired:
            code = None
        return WorkerError(f"tensor-parallel rank {rank} died while {doing} (exit code {code})")

    def _send_all(self, call: str, args: list, doing: str) -> None:
        """Send rank r the call with `args[r]`."""
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((call, args[rank]))
            except (BrokenPipeError, OSError):
                raise self._failure(rank, "died", None, doing) from None

    def execute(self, step: StepInputs, copies: list[tuple[int, int]] = (), feed: Feed | None = None,
                picks: Picks | None = None) -> RankTokens | None:
        """Send one step to every rank, which runs it, picks its tokens and feeds `feed`'s rows
        from its own previous sampled ids (`ArenaExecutor.execute`); returns at once, with what
        collects rank 0's ids, or None without picks."""
        number = self.sent + 1
        self._collect(number - SLOTS)  # then every rank has copied that step's inputs out of the slot
        slot = number % SLOTS
        self.inputs.pack(step, self.slots[slot])
        fed = None if feed is None else (feed.rows, feed.picks)
        self._send_all("step", [(slot, step.sizes, list(copies), fed, _seeded(picks))] * len(self.conns),
                       "receiving a step")
        self.sent = number
        return None if picks is None else RankTokens(self, number)

    def _collect(self, number: int) -> None:
        """Gather every rank's replies up to step `number`, in order, telling the ranks to answer
        for the last step sent when nothing after it will; keep rank 0's picks."""
        while self.answered < number:
            step = self.answered + 1
            if step == self.sent:  # nothing sent after it will make the ranks answer
                self._send_all("settle", [None] * len(self.conns), "settling a step")
            reply = self._gather(self.step_timeout, "running a step")[0]
            if reply is not None:
                self.replies[step] = reply
            self.answered = step

    def tokens(self, number: int) -> tuple[list[int], list[dict | None]]:
        """Rank 0's sampled ids and logprobs entries of step `number`."""
        self._collect(number)
        return self.replies.pop(number)

    def collective_seconds(self, tokens: int) -> float:
        """Rank 0's estimate of the seconds a decode step of `tokens` tokens spends in
        collectives, timed apart from any step (`runtime.collectives`)."""
        self._collect(self.sent)
        self._send_all("collective_seconds", [tokens] * len(self.conns), "timing collectives")
        return self._gather(self.step_timeout, "timing collectives")[0]

    def close(self) -> None:
        """Stop every worker: the other ranks first, then rank 0, which hosts the process group's
        store (a rank that outlives the store has NCCL's monitor log its loss every second until
        it exits). Ones stuck in a collective with a dead peer are killed."""
        workers = list(zip(self.conns, self.procs))
        for group in (workers[1:], workers[:1]):
            for conn, _ in group:
                try:
                    conn.send(("stop", None))
                except (BrokenPipeError, OSError):
                    pass
            for _, proc in group:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for conn in self.conns + self.pings:
            conn.close()
        self.conns, self.pings, self.procs = [], [], []
        self.slots = None  # the mapping goes with its last view


class RankTokens:
    """Step `number`'s sampled ids, on every rank's device and on their way from rank 0."""

    ids = None  # each rank feeds its own copy to the next step

    def __init__(self, executor: TensorParallelExecutor, number: int):
        self.executor = executor
        self.number = number

    def wait(self) -> tuple[list[int], list[dict | None]]:
        return self.executor.tokens(self.number)

    def running(self) -> bool:
        return False  # rank 0's progress is another process's to know: a TP Session does not pace


def _seeded(picks: Picks | None) -> Picks | None:
    """`picks` with a seed for every new sequence: each rank draws from its own generators, and
    unseeded ones (torch's global RNG) would differ between ranks."""
    if picks is None or all(seed is not None for _, seed in picks.new.values()):
        return picks
    return dataclasses.replace(picks, new={s: (params, random.getrandbits(63) if seed is None else seed)
                                           for s, (params, seed) in picks.new.items()})
