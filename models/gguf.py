"""A GGUF file as the checkpoint a Hugging Face folder would be: its `config.json`, its tensors under
Hugging Face names (dequantized to float32), and its tokenizer files. `models.load` and the
builder read a `.gguf` through this, so a GGUF and a folder take the same build path.

`convert_gguf` writes that folder to disk (config.json, model.safetensors, tokenizer files), and
`gguf-to-hf` is its command line.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from kiln.atomic import atomic_folder
from kiln.dtypes import torch_dtype
from kiln.models.config import CheckpointError
from kiln.models.gguf_config import check_architecture, hf_config, hf_tensor_name, to_hf_tensor
from kiln.models.gguf_file import GGUFFile, open_gguf
from kiln.models.gguf_tokenizer import tokenizer_files


@dataclass(frozen=True)
class GGUFCheckpoint:
    """The Hugging Face view of one GGUF file."""

    file: GGUFFile
    config: dict[str, Any]
    files: dict[str, str]  # tokenizer files, name -> text

    @property
    def chat_template(self) -> str | None:
        return self.files.get("chat_template.jinja")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every weight the model reads."""
        arch = self.file.architecture
        for name in self.file.tensor_names:
            hf_name = hf_tensor_name(arch, name)
            if hf_name is not None:
                yield hf_name, to_hf_tensor(arch, name, self.file.tensor(name), self.config)

    def folder_files(self) -> dict[str, bytes]:
        """What a Hugging Face folder of this model holds besides its weights."""
        out = {"config.json": (json.dumps(self.config, indent=2) + "\n").encode()}
        out.update({name: text.encode("utf-8") for name, text in self.files.items()})
        return out


@functools.lru_cache(maxsize=4)
def _describe(f: GGUFFile) -> GGUFCheckpoint:
    check_architecture(f)
    return GGUFCheckpoint(f, hf_config(f), tokenizer_files(f))


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open and check a GGUF file and describe it as a Hugging Face checkpoint; every error
    (not a GGUF, truncated, unsupported architecture, tensor type or tokenizer) is raised here,
    before any weight is read."""
    return _describe(open_gguf(path))


def convert_gguf(path: str | Path, output: str | Path, dtype: str | None = None) -> Path:
    """Write the Hugging Face folder of a GGUF file: config.json, model.safetensors (weights in
    `dtype`, by default the config's `torch_dtype`) and the tokenizer files. The folder appears
    complete or not at all."""
    from safetensors.torch import save_file

    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(f"{output} exists and is not an empty folder: choose a new one")
    ckpt = read_gguf(path)
    target = torch_dtype(dtype or ckpt.config["torch_dtype"])
    tensors = {name: t.to(target).contiguous() for name, t in ckpt.tensors()}
    with atomic_folder(output) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, data in ckpt.folder_files().items():
            (tmp / name).write_bytes(data)
    return output


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("gguf_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--output", required=True, type=click.Path(path_type=Path),
              help="Folder to write (must not exist or be empty).")
@click.option("--dtype", type=click.Choice(("float32", "float16", "bfloat16")), default=None,
              help="Weight dtype in model.safetensors. Default: the GGUF's (float32 for a quantized file).")
def main(gguf_file: Path, output: Path, dtype: str | None) -> None:
    """Convert a GGUF file into a Hugging Face model folder (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json, chat_template.jinja) that transformers and
    build-engine load."""
    try:
        convert_gguf(gguf_file, output, dtype)
    except (CheckpointError, FileNotFoundError) as e:
        raise click.BadParameter(str(e), param_hint="GGUF_FILE") from None
    click.echo(f"wrote {output}")
