"""Runs the real `tritonserver` that the `nvidia-pytriton` wheel ships: finds it, lays out a
backend folder with the Python stub for this interpreter, sets the environment the stub needs,
and starts, waits for and stops the process.

The wheel's binaries lose their RPATHs once the backend folder is copied, so the wheel's
library folder and this Python's LIBDIR go on `LD_LIBRARY_PATH`; the stub ignores PYTHONPATH
and takes its Python from the first `python3` on PATH, so this interpreter's bin/ goes first.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

EXIT_TIMEOUT_S = 10
INSTALL_HINT = "pip install --no-deps nvidia-pytriton==0.7.0 ('make install' does this)"


class ServerError(RuntimeError):
    """tritonserver is missing, did not start, or did not become ready."""


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


class PortError(ServerError):
    """A port the server is to listen on is taken (or the same as another of its ports)."""

    def __init__(self, port_name: str, message: str) -> None:
        super().__init__(message)
        self.port_name = port_name  # "http", "grpc" or "metrics"


def check_ports(host: str, ports: Ports) -> None:
    """Refuse ports that another process listens on, before the server starts: tritonserver
    itself says so only deep in its log."""
    seen: dict[int, str] = {}
    for name, port in (("http", ports.http), ("grpc", ports.grpc), ("metrics", ports.metrics)):
        if port in seen:
            raise PortError(name, f"the {name} port {port} is also the {seen[port]} port: give each its own")
        seen[port] = name
        with socket.socket() as s:
            # SO_REUSEADDR as servers bind, so a port only in TIME_WAIT does not count as taken.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise PortError(name, f"the {name} port {host}:{port} is not free ({e.strerror}): stop what listens "
                                      f"there or choose another --{name}-port") from None


def free_ports(host: str = "127.0.0.1") -> Ports:
    """Three ports nothing listens on now (bound together, so they differ)."""
    sockets = [socket.socket() for _ in range(3)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return Ports(*(s.getsockname()[1] for s in sockets))
    finally:
        for s in sockets:
            s.close()


def tritonserver_home() -> Path:
    """The wheel's server tree: bin/tritonserver, backends/, python_backend_stubs/."""
    # find_spec locates the package without importing it: its Python API's dependencies are
    # deliberately not installed.
    spec = importlib.util.find_spec("pytriton")
    home = Path(next(iter(spec.submodule_search_locations))) / "tritonserver" if spec else None
    if home is None or not (home / "bin" / "tritonserver").is_file():
        raise ServerError(f"tritonserver is not installed in this Python's environment: {INSTALL_HINT}")
    return home


def prepare_backends(work_dir: Path) -> Path:
    """Copy the wheel's backends to `work_dir/backends` with the stub for this Python beside the
    Python backend, where the backend looks for it; returns the backend folder."""
    home = tritonserver_home()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (home / "python_backend_stubs").iterdir() if p.is_dir())
        raise ServerError(f"the tritonserver wheel has Python backend stubs for {', '.join(have)}, not for this "
                          f"Python {version}: run Kiln from a virtual environment of one of those")
    backends = Path(work_dir) / "backends"
    if backends.exists():
        shutil.rmtree(backends)
    shutil.copytree(home / "backends", backends)
    shutil.copy2(stub, backends / "python" / stub.name)
    return backends


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    home = tritonserver_home()
    libs = [str(home.parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [*libs, env.get("LD_LIBRARY_PATH", "")] if p)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def _die_with_parent() -> None:
    # Runs in the child before exec: a killed parent (a test run, serve-triton) must not leave a
    # server holding its ports. Linux only, like the wheel.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TritonServer:
    """One tritonserver process serving `repo` on `host`. Use as a context manager, or call
    `start`, `wait_ready` and `stop`."""

    def __init__(self, repo: Path, work_dir: Path, host: str = "127.0.0.1", ports: Ports | None = None,
                 log_file: Path | None = None, verbose: bool = False):
        self.repo, self.work_dir, self.host = Path(repo), Path(work_dir), host
        self.ports = ports or Ports()
        self.log_file = log_file
        self.verbose = verbose
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports.metrics}/metrics"

    def command(self, backends: Path) -> list[str]:
        return [str(tritonserver_home() / "bin" / "tritonserver"), f"--model-repository={self.repo.resolve()}",
                f"--backend-directory={backends}",
                f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
                f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}",
                f"--metrics-port={self.ports.metrics}",
                # explicit + '*' loads every model once; auto-complete would import model.py twice.
                "--model-control-mode=explicit", "--load-model=*", "--disable-auto-complete-config",
                "--backend-config=python,shm-default-byte-size=4194304", f"--log-verbose={int(self.verbose)}",
                # An open client stream keeps the model from unloading; give up on it before stop()'s kill.
                f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        command = self.command(prepare_backends(self.work_dir))
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 - closed in stop()
        # A session of its own: Ctrl-C in a terminal reaches only serve-triton, which then stops
        # the server once, instead of the server also getting the signal and stopping twice.
        self.process = subprocess.Popen(command, env=server_env(), stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        self._log = out

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once /v2/health/ready answers 200; raise `ServerError` with the log's tail if the
        server exits or is not ready within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                  + self._log_tail())
            try:
                with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s" + self._log_tail())

    def wait(self) -> int:
        return self.process.wait()

    def stop(self, timeout: float = EXIT_TIMEOUT_S + 5.0) -> int:
        """SIGINT, then SIGKILL if it has not exited after `timeout` seconds; returns its exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
        return self.process.returncode

    def _log_tail(self, lines: int = 40) -> str:
        if not self.log_file or not Path(self.log_file).is_file():
            return ""
        tail = Path(self.log_file).read_text(errors="replace").splitlines()[-lines:]
        return f"; the end of its log ({self.log_file}):\n" + "\n".join(tail)

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
