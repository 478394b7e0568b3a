"""Running the OpenAI-compatible app for tests: a real uvicorn server on a free port of
127.0.0.1, in a thread of the test process, so tests can compare it with its own Session."""
from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import uvicorn

from kiln.runtime.openai.app import ServerState, create_app
from kiln.runtime.session import Session

MODEL = "tiny"


@dataclass
class RunningServer:
    host: str
    port: int
    state: ServerState

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def session(self) -> Session:
        return self.state.session


@contextlib.contextmanager
def serve(load: Callable[[], Session], wait_loaded: bool = True, **app_options) -> Iterator[RunningServer]:
    """Serve the app until the block ends; the app closes its Session then."""
    app = create_app(load, MODEL, **app_options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    running = RunningServer("127.0.0.1", sock.getsockname()[1], app.state.kiln)
    try:
        deadline = time.monotonic() + 60
        while not server.started or (wait_loaded and running.session is None and running.state.failed is None):
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        yield running
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def request(server: RunningServer, method: str, path: str, body: object = None,
            raw: bytes | None = None) -> tuple[int, dict | str]:
    """One plain HTTP request; the body back as JSON when it is JSON."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        connection.request(method, path, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


def wait_idle(session: Session, idle_used: int = 0, timeout: float = 30) -> dict:
    """The Session's stats once nothing runs or waits and its KV pool is back to `idle_used`."""
    deadline = time.monotonic() + timeout
    while True:
        stats = session.stats
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == idle_used:
            return stats
        assert time.monotonic() < deadline, f"the Session did not go idle: {stats}"
        time.sleep(0.02)
