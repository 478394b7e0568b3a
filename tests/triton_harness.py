"""Helpers for the tests that run a real tritonserver: one server per test module on a small
engine, a gRPC stream that collects responses by request id, request builders and Kiln's
metrics as the server reports them."""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

# The GPU machine has no tritonclient: there `pytest -m gpu` must still collect these modules.
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import np_to_triton_dtype  # noqa: E402

from kiln.runtime.triton.protocol import INPUTS, NUMPY_DTYPES
from kiln.runtime.triton.repo import write_repo
from kiln.runtime.triton.server import TritonServer, free_ports

MODEL = "kiln"
# 16 sequences and 64 tokens a step, sequences of up to 64 tokens in 4-token blocks.
SERVER_BUILD = dict(dtype="float32", max_batch_size=16, max_num_tokens=64)
_SPECS = {s.name: s for s in INPUTS}


def server_engine(factory) -> Path:
    return factory.engine(factory.checkpoint("llama3"), **SERVER_BUILD)


def run_server(factory, work: Path, engine: Path | None = None) -> Iterator[TritonServer]:
    """Yield a ready server for `engine` (default `server_engine`); afterwards stop it with
    SIGINT and check that it shut down cleanly (the model's finalize ran without error)."""
    repo = write_repo(engine or server_engine(factory), work / "repo", MODEL)
    log = work / "tritonserver.log"
    server = TritonServer(repo, work / "server", ports=free_ports(), log_file=log)
    server.start()
    try:
        server.wait_ready(60)
        yield server
    finally:
        code = server.stop(15)
    assert code == 0, f"tritonserver exited with {code}; its log: {log}"


def token_request(prompt: list[int], output_len: int, **optional) -> list[grpcclient.InferInput]:
    """gRPC inputs for the token interface; scalars may be given as plain Python values."""
    values = {"input_ids": np.array([prompt], np.int32), "input_lengths": len(prompt),
              "request_output_len": output_len, **optional}
    return [_input(name, value) for name, value in values.items()]


def _input(name: str, value) -> grpcclient.InferInput:
    array = value if isinstance(value, np.ndarray) else np.array([[value]], NUMPY_DTYPES[_SPECS[name].dtype])
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def word_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's [1, 2, K] format: ids one after another, then end offsets padded with -1."""
    ids = [t for w in words for t in w]
    ends = list(np.cumsum([len(w) for w in words]))
    width = max(len(ids), len(ends))
    return np.array([[ids + [0] * (width - len(ids)), ends + [-1] * (width - len(ends))]], np.int32)


@dataclass
class Response:
    outputs: dict[str, np.ndarray]
    final: bool
    at: float  # perf_counter when it arrived

    @property
    def tokens(self) -> list[int]:
        ids = self.outputs.get("output_ids")
        return [] if ids is None else ids.reshape(-1).tolist()


class Stream:
    """One gRPC client with one open stream, collecting responses and errors by request id."""

    OUTPUTS = ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "text_output")

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: dict[str, list[Response]] = defaultdict(list)
        self.errors: dict[str, list[str]] = defaultdict(list)
        self.sent_at: dict[str, float] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.client.start_stream(callback=self._on_response)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # An open stream keeps the server from unloading the model when it is stopped.
        self.close(cancel_requests=exc_type is not None)

    def _on_response(self, result, error) -> None:
        now = time.perf_counter()
        with self.cond:
            if error is not None:
                # Stream errors carry no request id of their own; Triton and Kiln put it in the message.
                match = re.search(r"\[request id: ([^\]]+)\]", error.message())
                self.errors[match.group(1) if match else "?"].append(error.message())
            else:
                response = result.get_response()
                outputs = {n: result.as_numpy(n) for n in self.OUTPUTS if result.as_numpy(n) is not None}
                final = response.parameters["triton_final_response"].bool_param
                self.responses[response.id].append(Response(outputs, final, now))
            self.cond.notify_all()

    def send(self, request_id: str, inputs: list[grpcclient.InferInput]) -> None:
        self.sent_at[request_id] = time.perf_counter()
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def wait(self, done, timeout: float, what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(done, timeout):
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def wait_finished(self, ids: list[str], timeout: float) -> None:
        """Until each request has its final response or an error."""
        self.wait(lambda: all(self.errors.get(i) or any(r.final for r in self.responses.get(i, ())) for i in ids),
                  timeout, f"{len(ids)} requests to finish")

    def tokens(self, request_id: str) -> list[int]:
        return [t for r in self.responses[request_id] for t in r.tokens]

    def close(self, cancel_requests: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.client.stop_stream(cancel_requests=cancel_requests)
            self.client.close()


def post(server: TritonServer, endpoint: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"{server.http_url}/v2/models/{MODEL}/{endpoint}", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in body.splitlines() if line.startswith("data:")]


def metrics(server: TritonServer) -> dict[str, float]:
    """Kiln's samples, keyed by name and label: 'kv_used', 'running', 'finished_cancelled', ..."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    names = {"kiln_kv_cache_blocks": "kv_", "kiln_requests": "", "kiln_requests_finished_total": "finished_"}
    out = {}
    for name, label, value in re.findall(r'^(kiln_\w+)\{[^}]*(?:state|reason)="(\w+)"[^}]*\} (\S+)$', text, re.M):
        out[names[name] + label] = float(value)
    return out


def ended_since(before: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """How many requests the model ended between two metrics readings, by reason."""
    return {reason: now.get(f"finished_{reason}", 0) - before.get(f"finished_{reason}", 0)
            for reason in ("stop", "length", "cancelled", "error")}


def wait_for(condition, timeout: float = 10.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_until_idle(server: TritonServer, timeout: float = 15.0, **at_least: float) -> dict[str, float]:
    """Poll the metrics until no block is used and no request is running or waiting (and each
    metric named in `at_least` has reached its value); return them."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = m.get("kv_used") == 0 and m.get("running") == 0 and m.get("waiting") == 0
        if idle and all(m.get(k, 0) >= v for k, v in at_least.items()):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle within {timeout} s: {m} (wanted at least {at_least})")
        time.sleep(0.1)
