"""`run-engine`: generate text from an engine folder on this machine (CPU executor, greedy)."""
from __future__ import annotations

import time
from pathlib import Path

import click
from tokenizers import Tokenizer

from runtime.engine import load_engine
from runtime.engine_file import EngineFileError
from runtime.executor import CpuExecutor
from runtime.greedy import greedy_generate


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path),
              help="Engine folder written by build-engine.")
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text; repeat for several.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Tokens to generate per prompt.")
def run_engine(engine_dir: Path, prompts: tuple[str, ...], max_tokens: int) -> None:
    """Generate text greedily from a Kiln engine, one prompt after another.

    \b
    Example:
      run-engine --engine engines/demo --prompt "The kiln" --max-tokens 24
    """
    if max_tokens < 1:
        raise click.BadParameter("must be at least 1", param_hint="--max-tokens")
    try:
        engine = load_engine(engine_dir)
    except EngineFileError as e:
        raise click.ClickException(str(e)) from None
    if engine.world_size != 1:
        raise click.ClickException(f"{engine_dir} is a {engine.world_size}-rank engine; run-engine runs 1-rank "
                                   "engines for now: rebuild with --tp-size 1")
    tokenizer_file = engine_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise click.ClickException(f"{engine_dir} has no tokenizer.json: rebuild from a checkpoint that has one")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tuple(engine.manifest["model"].get("eos_token_ids", ()))
    blocks = -(-engine.build["max_seq_len"] // engine.kv_cache["block_size"])
    executor = CpuExecutor(engine, num_kv_blocks=blocks)
    for prompt in prompts:
        ids = tokenizer.encode(prompt).ids
        start = time.perf_counter()
        try:
            out = greedy_generate(executor, ids, max_tokens, eos)
        except ValueError as e:
            raise click.ClickException(f"prompt {prompt!r}: {e}") from None
        seconds = time.perf_counter() - start
        click.echo(f"{prompt}{tokenizer.decode(out)}")
        click.echo(click.style(f"  [{len(ids)} prompt + {len(out)} generated tokens, "
                               f"{len(out) / seconds:.1f} tok/s]", dim=True), err=True)
