"""`serve-engine`: serve an engine folder over the OpenAI API with uvicorn until Ctrl-C."""
from __future__ import annotations

import socket
from pathlib import Path

import click
import uvicorn

from kiln.runtime.arguments import ArgumentError
from kiln.runtime.cli import bad_flag, show_kiln_log
from kiln.runtime.engine_core import check_engine_options
from kiln.runtime.openai.app import create_app
from kiln.runtime.scheduler import POLICIES, POLICY_HELP
from kiln.runtime.session import Session


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path),
              help="Engine folder written by build-engine.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the server listens on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--model-name", help="The model's name in the API [default: the engine folder's name].")
@click.option("--kv-cache-fraction", type=float,
              help="Share of the memory left after weights and arena that the KV cache may take, capped at what "
                   "a full batch at max_seq_len can use [default: 0.9].")
@click.option("--max-kv-tokens", type=int, help="KV cache size in tokens, instead of --kv-cache-fraction.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where to run: auto takes the GPU when the engine was built for its arch, else the CPU.")
@click.option("--policy", type=click.Choice(POLICIES), default=POLICIES[0], show_default=True,
              help=POLICY_HELP)
@click.option("--no-prefix-caching", is_flag=True,
              help="Compute every prompt in full instead of reusing the KV blocks of prefixes seen before.")
@click.pass_context
def serve_engine(ctx: click.Context, engine_dir: Path, host: str, port: int, model_name: str | None,
                 kv_cache_fraction: float | None, max_kv_tokens: int | None, device: str, policy: str,
                 no_prefix_caching: bool) -> None:
    """Serve a Kiln engine over the OpenAI API until Ctrl-C.

    POST /v1/completions and /v1/chat/completions (streamed or not), GET /v1/models, /health
    (503 while the engine loads) and /metrics (Prometheus). The engine loads after the server
    starts listening.

    \b
    Example:
      serve-engine --engine engines/demo --port 8000
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
    """
    try:
        check_engine_options(device, kv_cache_fraction, max_kv_tokens, policy, 60.0)
    except ArgumentError as e:
        raise bad_flag(ctx, e) from None
    if not (engine_dir / "rank0.engine").is_file():
        raise click.BadParameter(f"{engine_dir} holds no rank0.engine: build one with build-engine",
                                 param_hint="'--engine'")
    _check_port(host, port)
    show_kiln_log()
    name = model_name or engine_dir.resolve().name
    failures: list[str] = []

    def failed(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    app = create_app(lambda: Session(engine_dir, device=device, kv_cache_fraction=kv_cache_fraction,
                                     max_kv_tokens=max_kv_tokens, policy=policy,
                                     prefix_caching=not no_prefix_caching), name, failed)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5))
    click.echo(click.style(f"Kiln serves {engine_dir} as model {name!r} at http://{host}:{port}/v1; Ctrl-C stops it.",
                           bold=True), err=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn has shut down cleanly, then raises the Ctrl-C again
        pass
    if failures:
        raise click.ClickException(failures[0])


def _check_port(host: str, port: int) -> None:
    """A port in use is a flag error now, not a uvicorn traceback after the engine is loaded."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise click.BadParameter(f"cannot listen on {host}:{port} ({e.strerror}): pick another --port",
                                     param_hint="'--port'") from None
