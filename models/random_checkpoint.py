"""Small random Hugging Face checkpoints for demos and tests.

``make demo`` and the test-suite need real-looking checkpoints (config.json,
sharded safetensors, tokenizer files) for every model family Kiln supports,
without downloading anything. This module builds them from a ``transformers``
config with random weights and a byte-level BPE tokenizer trained locally on
a small inline corpus (`random_tokenizer.py`). ``transformers`` is imported lazily: it is a
test/demo dependency, never a runtime one.

Rope keys in config.json: the family configs are built from the legacy
``rope_theta`` / ``rope_scaling`` kwargs, which every transformers release
accepts. transformers 5.x (checked with 5.17 and 5.24) converts them and
writes only a ``rope_parameters`` object, with ``rope_theta`` inside it and no
top-level ``rope_theta`` or ``rope_scaling``::

    llama2, mistral, qwen2, qwen3: {"rope_type": "default", "rope_theta": ...}
    llama3, llama3.2:  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": max_pos // 4}
    llama-linear-rope: {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    gemma3: {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}

transformers 4.x writes the old form instead (top-level ``rope_theta``, and
``rope_scaling`` null, absent (mistral) or the dict without ``rope_theta``), as
do most published checkpoints, so Kiln's config reader must accept both.

With tied embeddings transformers leaves ``lm_head.weight`` out of the
safetensors files; loaders must fall back to ``model.embed_tokens.weight``.

Big shapes (Llama-3-8B: 16 GB in bf16) are built with ``device="cuda"``: the model is
made on the GPU directly in the requested dtype and randomized there.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import click

from kiln.atomic import atomic_folder
from kiln.dtypes import MODEL_DTYPES
from kiln.models.fp8_checkpoint_writer import FP8_FORMATS, FP8_STRATEGIES, quantize_checkpoint
from kiln.models.random_families import FAMILIES, family_config
from kiln.models.random_tokenizer import BOS_TOKEN, EOS_TOKEN, chat_tokens, save_tokenizer, train_tokenizer


def _randomize(model: Any) -> None:
    """Replace the default init with one that gives non-trivial logits.

    Values are drawn in float32 whatever the model's dtype and rounded once, so a model
    built directly in bf16 gets the distribution a float32 one would be rounded to. A float32
    parameter is drawn in place, exactly as before the `device` option existed.
    """
    import torch

    with torch.no_grad():
        # named_parameters() yields a tied embedding once, so it is drawn once.
        for name, param in model.named_parameters():
            draw = param if param.dtype == torch.float32 else torch.empty_like(param, dtype=torch.float32)
            if name.endswith("norm.weight"):
                # Far from 1 so that a wrong norm fold shows up in the logits.
                draw.copy_(1.0 + 0.1 * torch.randn_like(draw))
            elif name.endswith(".bias"):
                draw.normal_(0.0, 0.1)
            elif "embed_tokens" in name:
                draw.normal_(0.0, 0.1)
            else:
                # ~1/sqrt(fan_in) keeps activations O(1), so fp16 does not overflow
                # at demo sizes; clamped so tiny models still have visible attention.
                fan_in = draw.shape[-1]
                draw.normal_(0.0, min(0.1, max(0.02, fan_in ** -0.5)))
            if draw is not param:
                param.copy_(draw)
            del draw  # one float32 temporary at a time: an 8B model's embedding table is 2 GB of it


def _dtype_kwarg() -> str:
    """The keyword `from_config` takes the dtype by: `dtype` since transformers 4.56
    (5.x warns on `torch_dtype`), `torch_dtype` before."""
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _random_model(config: Any, dtype: str, device: str) -> Any:
    """The randomized model, built directly in `dtype` on `device`; the global RNG must
    already be seeded.

    transformers' default init runs first: it is a few milliseconds of GPU work, skipping it
    would reach into transformers' internals, and on the CPU it keeps the random stream where
    earlier releases had it. Those built the model in float32 and cast it at the end; on the
    CPU the init consumes the same random numbers whatever the dtype and `_randomize` draws in
    float32 and rounds once, so the bytes written for a seed are the same as theirs
    (tests/test_random_checkpoint.py checks it). A Llama-3-8B shape on "cuda" takes 16 GB
    of GPU memory and seconds, instead of 32 GB of CPU memory and minutes.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                 **{_dtype_kwarg(): getattr(torch, dtype)})
    _randomize(model)
    return model.eval()


def _check_device(device: str) -> None:
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is visible to torch")
    if kind == "meta":
        raise ValueError("device 'meta' holds no values to save")


def _check_target(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir} exists and is not a directory")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{output_dir} is not empty")


def write_random_checkpoint(
    output_dir: str | Path,
    family: str = "llama3",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 256,
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str | None = None,
    tie_word_embeddings: bool | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    fp8_format: str | None = None,
    fp8_strategy: str = "channel",
) -> Path:
    """Write a random `family` checkpoint plus tokenizer to `output_dir`.

    The directory must be absent or empty unless `overwrite` is set, in which
    case it is replaced. Files are written to a temporary sibling directory
    that is renamed at the end, so a failure leaves nothing half-written.
    `max_shard_size` (e.g. "20KB") splits the weights over several files.
    `device` is where the model is built and randomized: "cpu" (the default) gives the
    same bytes for a seed as always; "cuda" builds it on the GPU directly in `dtype`, which
    is what big shapes need (see `_random_model`). `fp8_format` ("compressed-tensors" or
    "modelopt") writes the decoder projections pre-quantized to FP8 in that format, with
    `fp8_strategy` "channel" or "tensor" scales (`models.fp8_checkpoint_writer`). Returns the
    resolved output path.
    """
    import torch
    from transformers.utils import logging as hf_logging

    output_dir = Path(output_dir).resolve()
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(MODEL_DTYPES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must be divisible by num_heads, and num_heads by num_kv_heads")
    _check_device(device)
    _check_target(output_dir, overwrite)
    tokenizer = train_tokenizer()
    # Appended after the trained vocabulary, so every family's other ids stay the same.
    tokenizer.add_special_tokens(list(chat_tokens(family)))
    if vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer.get_vocab_size()} tokens")

    size = dict(hidden_size=hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                intermediate_size=intermediate_size, vocab_size=vocab_size,
                max_position_embeddings=max_position_embeddings,
                bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
                eos_token_id=tokenizer.token_to_id(EOS_TOKEN))
    config = family_config(family, size, tie_word_embeddings)
    torch.manual_seed(seed)  # seeds every CUDA device too
    model = _random_model(config, dtype, device)

    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    # transformers 4.x defaults to pickle unless asked; 5.x always writes
    # safetensors and silently swallows the unknown keyword.
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True
    try:
        with atomic_folder(output_dir) as staging:
            # Its per-shard progress bar would drown the CLI's one-line summary.
            was_enabled = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
            try:
                model.save_pretrained(staging, **save_kwargs)
            finally:
                if was_enabled:
                    hf_logging.enable_progress_bar()
            save_tokenizer(tokenizer, staging, max_position_embeddings, family)
            if fp8_format is not None:
                quantize_checkpoint(staging, fp8_format, fp8_strategy)
            _check_target(output_dir, overwrite)  # again: the folder may have filled meanwhile
    finally:
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # give the model's memory back to the caller's next user
    return output_dir


def _count_parameters(directory: Path) -> int:
    # Counted from the files, so a tied embedding counts once, as it is stored.
    from safetensors import safe_open

    total = 0
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--family", type=click.Choice(FAMILIES), default="llama3", show_default=True,
              help="Model family whose config.json layout to reproduce.")
@click.option("--output", "output", type=click.Path(file_okay=False, path_type=Path),
              required=True, help="Directory to create.")
@click.option("--dtype", type=click.Choice(MODEL_DTYPES), default="float32", show_default=True)
@click.option("--hidden-size", type=int, default=64, show_default=True)
@click.option("--layers", type=int, default=2, show_default=True)
@click.option("--heads", type=int, default=4, show_default=True)
@click.option("--kv-heads", type=int, default=2, show_default=True)
@click.option("--intermediate-size", type=int, default=128, show_default=True)
@click.option("--vocab-size", type=int, default=512, show_default=True,
              help="Embedding rows; at least the tokenizer's 384 tokens.")
@click.option("--max-position-embeddings", type=int, default=256, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--max-shard-size", default=None,
              help='Split the weights into shards of at most this size, e.g. "100KB".')
@click.option("--tie-word-embeddings/--untie-word-embeddings", default=None,
              help="Override the family's default (tied for llama3.2 and gemma3).")
@click.option("--device", default="cpu", show_default=True,
              help='Where to build and randomize the model: "cuda" builds it there directly in '
                   '--dtype (what a Llama-3-8B shape needs); "cpu" gives the same bytes for a '
                   'seed as always.')
@click.option("--fp8-format", type=click.Choice(FP8_FORMATS), default=None,
              help="Write the decoder projections pre-quantized to FP8 (e4m3, plugins/fp8.py) in this "
                   "checkpoint format, as published FP8 models are; build-engine loads it as it is.")
@click.option("--fp8-strategy", type=click.Choice(FP8_STRATEGIES), default="channel", show_default=True,
              help="With --fp8-format: one scale per output channel (what build-engine --quantization fp8 "
                   "makes) or one per tensor.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it is not empty.")
def main(family: str, output: Path, dtype: str, hidden_size: int, layers: int, heads: int,
         kv_heads: int, intermediate_size: int, vocab_size: int, max_position_embeddings: int,
         seed: int, max_shard_size: str | None, tie_word_embeddings: bool | None,
         device: str, fp8_format: str | None, fp8_strategy: str, force: bool) -> None:
    """Write a small Hugging Face checkpoint with random weights.

    For demos and tests only: the weights are random, the byte-level BPE
    tokenizer is trained on a few built-in paragraphs of text, and nothing is
    downloaded. The result loads with transformers' AutoModelForCausalLM and
    AutoTokenizer, and with Kiln's checkpoint loader.
    """
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not force:
        raise click.UsageError(f"{output} exists and is not empty; pass --force to replace it")
    try:
        path = write_random_checkpoint(
            output, family, hidden_size=hidden_size, num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings, dtype=dtype, seed=seed,
            max_shard_size=max_shard_size, tie_word_embeddings=tie_word_embeddings,
            overwrite=force, device=device, fp8_format=fp8_format, fp8_strategy=fp8_strategy)
    except (ValueError, FileExistsError) as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"{family}: {_count_parameters(path):,} parameters, {dtype} -> {path}")


if __name__ == "__main__":
    main()
