"""Command-line tools of the builder: `build-engine` and `inspect-engine`."""
from __future__ import annotations

import json
from pathlib import Path

import click

from kiln.builder.build import BuildError, build_engine as run_build
from kiln.builder.config import DTYPES, TARGETS, BuildConfig, BuildConfigError, default_targets
from kiln.builder.kernels import KernelError
from kiln.builder.passes import ShardError
from kiln.builder.trace import TraceError
from kiln.models import CheckpointError, read_config
from kiln.runtime.engine_file import EngineFileError, read_engine_file
from kiln.runtime.triton.repo import RepoError, write_repo


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--checkpoint", required=True, type=click.Path(path_type=Path),
              help="Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer files.")
@click.option("--output", required=True, type=click.Path(path_type=Path),
              help="Engine folder to write (rank{r}.engine, config.json, tokenizer). A previous engine there "
                   "is replaced; any other non-empty folder is refused.")
@click.option("--dtype", type=click.Choice(("auto",) + DTYPES), default="auto", show_default=True,
              help="Weight and activation dtype; auto takes the checkpoint's. float32 is exact on CPU.")
@click.option("--tp-size", type=int, default=1, show_default=True,
              help="Tensor-parallel ranks: one rank{r}.engine each. Must divide the attention heads.")
@click.option("--max-batch-size", type=int, default=8, show_default=True,
              help="Most sequences in one step.")
@click.option("--max-seq-len", type=int, default=None,
              help="Longest prompt + output, in tokens. Default: the model's max_position_embeddings.")
@click.option("--max-num-tokens", type=int, default=2048, show_default=True,
              help="Most tokens in one step (decode tokens plus prefill chunks); sizes the activation arena.")
@click.option("--kv-block-size", type=int, default=16, show_default=True,
              help="Tokens per paged KV-cache block (a power of two).")
@click.option("--target", "targets", multiple=True, type=click.Choice(TARGETS),
              help="Hardware to build for; repeat for several. Default: this machine's GPU, else cpu.")
@click.option("--triton-repo", type=click.Path(path_type=Path),
              help="Then write a Triton Inference Server model repository for the engine here (see triton-repo).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def build_engine(checkpoint: Path, output: Path, dtype: str, tp_size: int, max_batch_size: int,
                 max_seq_len: int | None, max_num_tokens: int, kv_block_size: int, targets: tuple[str, ...],
                 triton_repo: Path | None, quiet: bool) -> None:
    """Compile a Hugging Face checkpoint into a Kiln engine folder.

    Traces Kiln's definition of the model, fuses each decoder layer (RMSNorm+QKV+RoPE,
    attention+output projection, RMSNorm+SwiGLU, down projection+residual), folds norm weights
    into the projections, shards for tensor parallelism, plans activation memory and writes one
    rank{r}.engine per rank.

    \b
    Example:
      build-engine --checkpoint ./Llama-3.2-1B --output engines/llama1b --dtype float32 --target cpu
      inspect-engine engines/llama1b
    """
    try:
        model_cfg = read_config(checkpoint)
        # `is None`, not `or`: an explicit 0 must reach BuildConfig's check, not become the default.
        max_seq_len = model_cfg.max_position_embeddings if max_seq_len is None else max_seq_len
        dtype = model_cfg.dtype if dtype == "auto" else dtype
        cfg = BuildConfig(dtype=dtype, tp_size=tp_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                          max_num_tokens=max_num_tokens, kv_block_size=kv_block_size,
                          targets=tuple(dict.fromkeys(targets)) or default_targets())
    except BuildConfigError as e:
        raise click.UsageError(str(e)) from None
    except CheckpointError as e:
        raise click.BadParameter(str(e), param_hint="--checkpoint") from None
    try:
        summary = run_build(checkpoint, output, cfg, progress=not quiet)
    except CheckpointError as e:
        raise click.BadParameter(str(e), param_hint="--checkpoint") from None
    except ShardError as e:
        raise click.BadParameter(str(e), param_hint="--tp-size") from None
    except (BuildError, TraceError, BuildConfigError, KernelError) as e:
        raise click.UsageError(str(e)) from None
    click.echo(summary.render())
    if triton_repo is not None:
        try:
            write_repo(output, triton_repo)
        except RepoError as e:
            raise click.BadParameter(str(e), param_hint="--triton-repo") from None
        click.echo(f"triton repository {triton_repo}: serve it with "
                   f"serve-triton --engine {output} --repo {triton_repo}")


def _shape(shape: list) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--rank", type=int, default=0, show_default=True, help="Which rank's engine file to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
def inspect_engine(engine_dir: Path, rank: int, as_json: bool) -> None:
    """Show what an engine holds: model, build flags, targets, the plan op by op, the memory
    plan and the KV cache layout."""
    path = engine_dir / f"rank{rank}.engine" if engine_dir.is_dir() else engine_dir
    if not path.is_file():
        raise click.BadParameter(f"{path} does not exist: pass an engine folder made by build-engine",
                                 param_hint="ENGINE_DIR")
    try:
        m = read_engine_file(path, verify=False).manifest
    except EngineFileError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(m, indent=2))
        return
    model, build, mem = m["model"], m["build"], m["memory_plan"]
    click.echo(f"engine   {path}  (rank {m['rank']} of {m['world_size']}, Kiln {m['kiln_version']})")
    click.echo(f"model    {model.get('architecture', '?')}  layers {model.get('num_layers', '?')}  "
               f"hidden {model.get('hidden_size', '?')}  vocab {model.get('vocab_size', '?')}")
    click.echo("build    " + "  ".join(f"{k}={v}" for k, v in build.items() if k != "targets"))
    click.echo(f"targets  {', '.join(m['targets'])}")
    click.echo(f"\nplan ({len(m['plan'])} ops)")
    for i, op in enumerate(m["plan"]):
        t = m["tensors"][op["output"]]
        ins = ", ".join(v for v in op["inputs"].values() if v)
        attrs = " ".join(f"{k}={v}" for k, v in op["attrs"].items())
        click.echo(f"  {i:3d} {op['op']:<17} -> {op['output']} {_shape(t['shape'])} {t['dtype']}")
        click.echo(f"      in: {ins}" + (f"\n      attrs: {attrs}" if attrs else ""))
    click.echo(f"\nmemory plan: arena {mem['arena_bytes']:,} bytes for bounds "
               + " ".join(f"{k}={v}" for k, v in mem["bounds"].items()))
    for name, slot in sorted(mem["tensors"].items(), key=lambda kv: kv[1]["offset"]):
        click.echo(f"  {slot['offset']:>12,} {slot['nbytes']:>12,}  {name}")
    kv = m["kv_cache"]
    click.echo(f"\nkv cache: {kv['num_layers']} layers x {kv['num_kv_heads']} kv heads x head_dim {kv['head_dim']}, "
               f"{kv['dtype']}, {kv['block_size']} tokens per block")
    by_target: dict[str, int] = {}
    for entry in m["kernels"].values():
        by_target[entry["target"]] = by_target.get(entry["target"], 0) + 1
    click.echo("kernels: " + (", ".join(f"{n} cubins for {t}" for t, n in sorted(by_target.items()))
                              or "none (CPU engine)"))
    weights = m["weights"]
    click.echo(f"weights: {len(weights)} tensors, {sum(w['nbytes'] for w in weights.values()):,} bytes")
