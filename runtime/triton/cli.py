"""Command-line tools for Triton: `triton-repo` writes a model repository for an engine,
`serve-triton` runs the real tritonserver with one."""
from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import click

from kiln.runtime.arguments import ArgumentError
from kiln.runtime.cli import bad_flag
from kiln.runtime.scheduler import POLICIES, POLICY_HELP
from kiln.runtime.triton.repo import MARKER, RepoError, write_repo
from kiln.runtime.triton.server import PortError, Ports, ServerError, TritonServer, check_ports

_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _repo_options(command):
    for option in reversed((
        click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path),
                     help="Engine folder written by build-engine."),
        click.option("--model-name", default="kiln", show_default=True, help="The model's name in Triton."),
        click.option("--kv-cache-fraction", type=float,
                     help="Share of the memory left after weights and arena that the KV cache may take, capped at "
                          "what a full batch at max_seq_len can use [default: 0.9]."),
        click.option("--max-kv-tokens", type=int, help="KV cache size in tokens, instead of --kv-cache-fraction."),
        click.option("--policy", type=click.Choice(POLICIES), default=POLICIES[0], show_default=True,
                     help=POLICY_HELP),
        click.option("--no-prefix-caching", is_flag=True,
                     help="Compute every prompt in full instead of reusing the KV blocks of prefixes seen before."),
    )):
        command = option(command)
    return command


def _write_repo(ctx: click.Context, engine_dir: Path, output: Path, model_name: str, max_kv_tokens: int | None,
                policy: str, kv_cache_fraction: float | None, no_prefix_caching: bool) -> None:
    """`write_repo`, with a bad option reported as its flag and a bad folder as a usage error."""
    try:
        write_repo(engine_dir, output, model_name, max_kv_tokens, policy, kv_cache_fraction, not no_prefix_caching)
    except ArgumentError as e:
        raise bad_flag(ctx, e) from None
    except RepoError as e:
        raise click.UsageError(str(e)) from None


@click.command(context_settings=_SETTINGS)
@_repo_options
@click.option("--output", required=True, type=click.Path(path_type=Path),
              help="Repository folder to write. A repository written here before is replaced; any other "
                   "non-empty folder is refused.")
@click.pass_context
def triton_repo(ctx: click.Context, engine_dir: Path, output: Path, model_name: str, kv_cache_fraction: float | None,
                max_kv_tokens: int | None, policy: str, no_prefix_caching: bool) -> None:
    """Write a Triton Inference Server model repository that serves a Kiln engine.

    The repository holds one decoupled Python-backend model with TensorRT-LLM's token interface
    (input_ids, request_output_len, ... -> output_ids) and a text interface (text_input,
    max_tokens -> text_output); its README lists every input.

    \b
    Example:
      triton-repo --engine engines/demo --output /tmp/kiln-repo
      serve-triton --engine engines/demo --repo /tmp/kiln-repo
    """
    _write_repo(ctx, engine_dir, output, model_name, max_kv_tokens, policy, kv_cache_fraction, no_prefix_caching)
    click.echo(f"wrote {output}/{model_name} for {engine_dir.resolve()}; start it with: "
               f"serve-triton --engine {engine_dir} --repo {output}")


@click.command(context_settings=_SETTINGS)
@_repo_options
@click.option("--repo", type=click.Path(path_type=Path),
              help="Model repository to serve; written first if it does not exist [default: a temporary one].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the server listens on.")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--ready-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds to wait for the engine to load.")
@click.option("--verbose", is_flag=True, help="tritonserver's verbose log.")
@click.pass_context
def serve_triton(ctx: click.Context, engine_dir: Path, model_name: str, kv_cache_fraction: float | None,
                 max_kv_tokens: int | None, policy: str, no_prefix_caching: bool, repo: Path | None, host: str,
                 http_port: int, grpc_port: int, metrics_port: int, ready_timeout: float, verbose: bool) -> None:
    """Serve a Kiln engine with Triton Inference Server until Ctrl-C.

    Writes the model repository (into a temporary folder unless --repo is given), starts the
    tritonserver that the nvidia-pytriton wheel ships, with the environment its Python backend
    needs, and prints the URLs once the model is loaded.

    \b
    Example:
      serve-triton --engine engines/demo
      curl -d '{"text_input": "The kiln", "max_tokens": 20}' localhost:8000/v2/models/kiln/generate
    """
    ports = Ports(http_port, grpc_port, metrics_port)
    try:
        check_ports(host, ports)
    except PortError as e:
        raise click.BadParameter(str(e), ctx=ctx, param_hint=f"'--{e.port_name}-port'") from None
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the server cleanly too, like Ctrl-C
    with tempfile.TemporaryDirectory(prefix="kiln-triton-") as tmp:
        if repo is None or not (repo / MARKER).is_file():
            repo = repo or Path(tmp) / "repo"
            _write_repo(ctx, engine_dir, repo, model_name, max_kv_tokens, policy, kv_cache_fraction,
                        no_prefix_caching)
        server = TritonServer(repo, Path(tmp) / "server", host, ports, verbose=verbose)
        try:
            server.start()
            server.wait_ready(ready_timeout)
            name = _served_model(repo)
            click.echo(click.style("\nKiln is serving through Triton; Ctrl-C stops it.", bold=True))
            click.echo(f"  HTTP     {server.http_url}/v2/models/{name}/generate (and /generate_stream)")
            click.echo(f"  gRPC     {server.grpc_url}  (model {name!r})")
            click.echo(f"  metrics  {server.metrics_url}")
            code = server.wait()
            if code != 0:
                raise click.ClickException(f"tritonserver exited with code {code}")
        except ServerError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("\nstopping tritonserver ...", err=True)
        finally:
            server.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _served_model(repo: Path) -> str:
    return next(p.parent.name for p in sorted(repo.glob("*/config.pbtxt")))
