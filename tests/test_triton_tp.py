"""A real tritonserver serving a tensor-parallel (TP 2) engine with no extra flags: the model's
Session starts one worker process per rank inside the server's Python backend, streamed tokens
equal those of the same model at TP 1 in this process, and stopping the server reaps the
workers."""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session
from triton_harness import SERVER_BUILD, Stream, run_server, token_request


@pytest.fixture(scope="module")
def engines(factory):
    checkpoint = factory.checkpoint("llama3")
    return factory.engine(checkpoint, **SERVER_BUILD), factory.engine(checkpoint, **SERVER_BUILD, tp_size=2)


def test_tp2_engine_streams_what_tp1_generates_and_its_workers_are_reaped(factory, engines, tmp_path):
    tp1, tp2 = engines
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(2, 12))] for _ in range(8)]
    lengths = [rng.randint(4, 16) for _ in range(8)]
    with Session(tp1) as session:
        expected = session.generate(prompt_token_ids=prompts, sampling_params=[
            SamplingParams(temperature=0, max_tokens=n) for n in lengths])

    servers = run_server(factory, tmp_path, tp2)
    server = next(servers)
    workers = descendants(server.process.pid)
    try:
        ids = [f"tp-{i}" for i in range(8)]
        with Stream(server.grpc_url) as stream:
            for i, rid in enumerate(ids):
                stream.send(rid, token_request(prompts[i], lengths[i], streaming=True))
            stream.wait_finished(ids, timeout=120)
        assert not stream.errors
        for i, rid in enumerate(ids):
            assert stream.tokens(rid) == expected[i].outputs[0].token_ids, f"request {i}"
    finally:
        next(servers, None)  # stops the server and checks it exited cleanly
    # The backend's stub plus one worker per rank were running; none outlives the server.
    assert len(workers) >= 3, workers
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if running(pid)]


def _stat(pid: int) -> list[str] | None:
    try:
        # The command name (field 2) may hold spaces; the fields after its ")" do not.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc (state, then parent pid, after the name)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))):
            parents[int(entry.name)] = int(stat[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"
