"""Command-line tools of the builder: `build-engine` and `inspect-engine`."""
from __future__ import annotations

import json
from pathlib import Path

import click

from kiln.builder.build import BuildError, build_engine as run_build
from kiln.builder.calibrate import CalibrationError
from kiln.builder.config import (ACTIVATION_SCALES, FP8_TARGETS, KV_CACHE_DTYPES, TARGETS, BuildConfig,
                                 BuildConfigError, default_targets)
from kiln.builder.kernels import KernelError
from kiln.builder.onnx_export import EXTERNAL_DATA_BYTES, OnnxExportError, export_onnx
from kiln.builder.passes import KVScalesError, ShardError
from kiln.builder.trace import TraceError
from kiln.dtypes import MODEL_DTYPES
from kiln.engines.format import EngineFileError, read_engine_file
from kiln.engines.manifest import QUANTIZATIONS, Manifest
from kiln.models import CheckpointError, read_config


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--checkpoint", required=True, type=click.Path(path_type=Path),
              help="Hugging Face model folder (config.json, *.safetensors sharded or not, tokenizer files) or a "
                   ".gguf file (F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K weights are dequantized "
                   "to --dtype).")
@click.option("--output", required=True, type=click.Path(path_type=Path),
              help="Engine folder to write (rank{r}.engine, config.json, tokenizer). A previous engine there "
                   "is replaced; any other non-empty folder is refused.")
@click.option("--dtype", type=click.Choice(("auto",) + MODEL_DTYPES), default="auto", show_default=True,
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
              help="Hardware to build for; repeat for several. Default: this machine's GPU, else cpu. GPU "
                   "kernels compile here with Triton, no GPU needed; the CUDA C++ ones (decode GEMVs for 1-2 rows, "
                   "the e4m3 cache's decode attention, and for sm_90 with CUTLASS's headers the CuTe GEMMs of "
                   "steps of 129-256 rows and the prefill attention) need nvcc too (KILN_NVCC, the PATH or /usr/local/cuda), "
                   "and without it Triton's kernels serve in their place.")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="KV cache element type. auto: the model's dtype. fp8: e4m3 (float8_e4m3fn), half the bytes "
                   "per token, so the same memory holds twice the tokens; stored as value / scale with one k "
                   "and one v scale per layer (or per kv head) taken from the checkpoint when it carries them "
                   "(compressed-tensors kv_cache_scheme, ModelOpt k_scale/v_scale), else calibrated per kv head "
                   "with --calibration-prompts, else 1.0, as other engines do without calibration (small values "
                   "then lose precision: calibrate where you can).")
@click.option("--no-fuse", "no_fuse", is_flag=True,
              help="Keep the traced plan of primitive ops (no fusion passes): runs on the CPU; the reference "
                   "that a fusion must not change.")
@click.option("--onnx", "onnx_out", type=click.Path(path_type=Path),
              help="Then export each rank's plan as ONNX to this .onnx file (see inspect-engine --onnx).")
@click.option("--quantization", type=click.Choice(("auto",) + QUANTIZATIONS), default="auto", show_default=True,
              help="fp8: the decoder layers' projections run W8A8 in e4m3 (weights with a scale per output "
                   "channel, computed here; activations quantized per token), accumulating in float32; needs "
                   f"--target {', '.join(FP8_TARGETS)} or cpu (sm_80 has no FP8 tensor cores). auto: the "
                   "checkpoint's (fp8 for a compressed-tensors or ModelOpt FP8 checkpoint, else none).")
@click.option("--quantize-lm-head", is_flag=True,
              help="With --quantization fp8, quantize the LM head too (it stays in --dtype otherwise).")
@click.option("--calibration-prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A text file of prompts, one a line (a few dozen paragraphs of text like the model will "
                   "serve), run through the unquantized model on this machine's CPU for what --gptq, "
                   "--activation-scales static and --kv-cache-dtype fp8 measure. With --kv-cache-dtype fp8 each "
                   "layer's k and v get a scale per kv head from the largest value written to the cache, unless "
                   "the checkpoint carries KV scales.")
@click.option("--activation-scales", type=click.Choice(ACTIVATION_SCALES), default="per-token", show_default=True,
              help="With --quantization fp8: per-token quantizes each row of a projection's input with its own "
                   "scale, found as the row is made. static gives o_proj's and down's inputs one scale each, the "
                   "largest value --calibration-prompts gave them over 448 (larger values saturate): the kernel "
                   "before them writes their input in e4m3, one launch fewer a layer, for a little accuracy "
                   "(perplexity +0.1-0.5% on small models, tests/fp8_accuracy_check.py). The projections after an "
                   "RMSNorm stay per-token. A checkpoint's own input scales are used either way.")
@click.option("--gptq", is_flag=True,
              help="With --quantization fp8 and --calibration-prompts: round each FP8 weight by GPTQ (column by "
                   "column, each column's rounding error moved onto the columns not yet rounded, so that the "
                   "projection errs least on the inputs the prompts give it) instead of to its nearest value. "
                   "The engine's format and speed are unchanged; the build does the rounding on this machine's CPU. "
                   "Give it a few thousand tokens of text like the model will serve. FP8 perplexity over bf16 on "
                   "CPU checks: Gemma 3 270M +2.3% to +0.5%, SmolLM2-135M +2.8% to +1.5%.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def build_engine(checkpoint: Path, output: Path, dtype: str, tp_size: int, max_batch_size: int,
                 max_seq_len: int | None, max_num_tokens: int, kv_block_size: int, targets: tuple[str, ...],
                 kv_cache_dtype: str, no_fuse: bool, onnx_out: Path | None, quantization: str, quantize_lm_head: bool,
                 calibration_prompts: Path | None, activation_scales: str, gptq: bool, quiet: bool) -> None:
    """Compile a Hugging Face checkpoint or a GGUF file into a Kiln engine folder.

    Traces Kiln's definition of the model, fuses each decoder layer (RMSNorm+QKV+RoPE,
    attention+output projection, RMSNorm+SwiGLU, down projection+residual), folds norm weights
    into the projections, shards for tensor parallelism, plans activation memory and writes one
    rank{r}.engine per rank.

    \b
    Example:
      build-engine --checkpoint ./Llama-3.2-1B --output engines/llama1b --dtype float32 --target cpu
      build-engine --checkpoint ./Llama-3.1-8B --output engines/llama8b-fp8 --quantization fp8 --target sm_90
      build-engine --checkpoint ./Llama-3.2-1B --output e/1b --quantization fp8 --calibration-prompts t.txt --gptq
      inspect-engine engines/llama1b
      triton-repo --engine engines/llama1b --output /tmp/kiln-repo   (to serve it with Triton)
    """
    try:
        model_cfg = read_config(checkpoint)
        # `is None`, not `or`: an explicit 0 must reach BuildConfig's check, not become the default.
        max_seq_len = model_cfg.max_position_embeddings if max_seq_len is None else max_seq_len
        dtype = model_cfg.dtype if dtype == "auto" else dtype
        if quantization == "none" and model_cfg.quantization != "none":
            raise BuildConfigError(f"--quantization none: the checkpoint holds {model_cfg.quantization} weights; "
                                   f"build it with --quantization {model_cfg.quantization} (or auto)")
        quantization = model_cfg.quantization if quantization == "auto" else quantization
        cfg = BuildConfig(dtype=dtype, tp_size=tp_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                          max_num_tokens=max_num_tokens, kv_block_size=kv_block_size,
                          targets=tuple(dict.fromkeys(targets)) or default_targets(), fuse=not no_fuse,
                          kv_cache_dtype=kv_cache_dtype, quantization=quantization, quantize_lm_head=quantize_lm_head,
                          calibration_prompts=None if calibration_prompts is None else str(calibration_prompts),
                          activation_scales=activation_scales, gptq=gptq)
        if onnx_out is not None and cfg.quantization != "none":
            raise BuildConfigError(f"--onnx: a --quantization {cfg.quantization} engine has no ONNX form in Kiln yet")
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
    except CalibrationError as e:
        raise click.BadParameter(str(e), param_hint="--calibration-prompts") from None
    except (BuildError, TraceError, BuildConfigError, KernelError, KVScalesError) as e:
        raise click.UsageError(str(e)) from None
    click.echo(summary.render())
    if onnx_out is not None:
        _export(output, onnx_out, "--onnx")


def _export(engine: Path, onnx_out: Path, flag: str) -> None:
    try:
        for export in export_onnx(engine, onnx_out):
            click.echo(export.render())
    except OnnxExportError as e:
        raise click.BadParameter(str(e), param_hint=flag) from None


def _shape(shape: list) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--rank", type=int, default=0, show_default=True, help="Which rank's engine file to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--onnx", "onnx_out", type=click.Path(path_type=Path),
              help="Instead, export the plan as ONNX to this .onnx file (OUT.rank{r}.onnx per rank of a "
                   f"tensor-parallel engine; weights in OUT.onnx.data above {EXTERNAL_DATA_BYTES >> 20} MiB).")
def inspect_engine(engine_dir: Path, rank: int, as_json: bool, onnx_out: Path | None) -> None:
    """Show what an engine holds: model, build flags, targets, the plan op by op, the memory
    plan and the KV cache layout; or, with --onnx, write it as an ONNX model per rank: fused
    ops as functions of the `kiln` domain, the weights, the memory plan and the kernels as
    metadata, in the dense prefill form."""
    path = engine_dir / Manifest.rank_file(rank) if engine_dir.is_dir() else engine_dir
    if not path.is_file():
        raise click.BadParameter(f"{path} does not exist: pass an engine folder made by build-engine",
                                 param_hint="ENGINE_DIR")
    if onnx_out is not None:
        _export(engine_dir, onnx_out, "--onnx")
        return
    try:
        m = read_engine_file(path, verify=False).manifest
    except EngineFileError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(m.to_json(), indent=2))
        return
    click.echo(f"engine   {path}  (rank {m.rank} of {m.world_size}, Kiln {m.kiln_version})")
    click.echo("model    " + "  ".join(f"{k}={v}" for k, v in m.model.items()))
    click.echo(f"build    dtype={m.dtype}  quantization={m.quantization}  max_batch_size={m.max_batch_size}  max_seq_len={m.max_seq_len}  "
               f"max_num_tokens={m.max_num_tokens}  tp_size={m.world_size}")
    click.echo(f"targets  {', '.join(m.targets)}")
    click.echo(f"\nplan ({len(m.plan)} ops)")
    for i, op in enumerate(m.plan):
        t = m.tensors[op.output]
        ins = ", ".join(v for v in op.inputs.values() if v)
        attrs = " ".join(f"{k}={v}" for k, v in op.attrs.items())
        click.echo(f"  {i:3d} {op.op:<17} -> {op.output} {_shape(t.shape)} {t.dtype}")
        click.echo(f"      in: {ins}" + (f"\n      attrs: {attrs}" if attrs else ""))
    click.echo(f"\nmemory plan: arena {m.arena_bytes:,} bytes for at most {m.max_num_tokens} tokens, "
               f"{m.max_batch_size} sequences and {m.blocks_per_sequence} KV blocks per sequence in a step")
    for name, slot in sorted(m.slots.items(), key=lambda kv: kv[1].offset):
        click.echo(f"  {slot.offset:>12,} {slot.nbytes:>12,}  {name}")
    kv = m.kv
    click.echo(f"\nkv cache: {kv.num_layers} layers x {kv.num_kv_heads} kv heads x head_dim {kv.head_dim}, "
               f"{kv.dtype}, {kv.block_size} tokens per block, {kv.bytes_per_token:,} bytes per token"
               + (f", {kv.scale_granularity} scales in weight {kv.scales}" if kv.scales else ""))
    by_target: dict[str, int] = {}
    for entry in m.kernels.values():
        by_target[entry.target] = by_target.get(entry.target, 0) + 1
    click.echo("kernels: " + (", ".join(f"{n} cubins for {t}" for t, n in sorted(by_target.items()))
                              or "none (CPU engine)"))
    click.echo(f"weights: {len(m.weights)} tensors, {m.weight_bytes:,} bytes")
