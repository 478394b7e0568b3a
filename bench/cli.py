"""`bench-engine`: measure an engine against the hardware's limits and the eager PyTorch baseline.

Phases, in order (each frees its device memory before the next): resolve the engine (given,
or built from a checkpoint, or from a random Llama-3-8B-shape checkpoint), measure the
copy bandwidth and GEMM rate, start-up in a fresh process, decode and offline throughput
through one EngineCore, latency through a Session, prefix caching on and off (an EngineCore
each), decode and offline again on the FP8-weights engine with --quantization fp8, then
the eager baseline, then the table and the JSON file.
"""
from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import click
import torch
from click.core import ParameterSource

from kiln.bench import decode, kv_dtype, latency, offline, prefix, startup
from kiln.bench.driver import EngineInfo, inspect, kv_token_budget, open_core, release
from kiln.bench.eager import eager_unsupported, fill_baseline
from kiln.bench.figures import Figure, beside_bf16
from kiln.bench.hardware import measure
from kiln.bench.model import SHAPES, Shape, check_shape, ensure_checkpoint, ensure_engine, with_overrides
from kiln.bench.options import PHASES, IntList, LengthPairs, Phases, PrefixLengths
from kiln.bench.report import render, results, write_json
from kiln.builder.config import KV_CACHE_DTYPES, BuildConfig, BuildConfigError, default_targets
from kiln.dtypes import MODEL_DTYPES, torch_dtype
from kiln.engines.manifest import QUANTIZATIONS
from kiln.engines.format import EngineFileError
from kiln.models.config import CheckpointError
from kiln.runtime.scheduler import POLICIES, POLICY_HELP


def _command_line(ctx: click.Context) -> str:
    """The command as typed, rebuilt from the options that were not left at their default."""
    words = ["bench-engine"]
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if not isinstance(p, click.Option) or source is ParameterSource.DEFAULT:
            continue
        value = ctx.params[p.name]
        if p.is_flag:
            words += [p.opts[0]] if value else []
        elif isinstance(value, list):
            words += [p.opts[0], ",".join("/".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)]
        elif isinstance(value, tuple):
            words += [p.opts[0], "/".join(map(str, value))]
        else:
            words += [p.opts[0], str(value)]
    return shlex.join(words)


def status(message: str) -> None:
    click.echo(f"bench-engine: {message}", err=True)


def _device(requested: str | None) -> str:
    if requested == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: this machine has no usable GPU (torch.cuda.is_available() is False)")
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


# Flags that override one field of the --shape preset: flag -> (Shape field, what it is).
SHAPE_FLAGS = {"--layers": ("num_layers", "decoder layers"), "--hidden-size": ("hidden_size", "hidden size"),
               "--heads": ("num_heads", "attention heads"), "--kv-heads": ("num_kv_heads", "KV heads"),
               "--intermediate-size": ("intermediate_size", "MLP width"),
               "--vocab-size": ("vocab_size", "vocabulary (at least 384)")}


def _shape_flags(command):
    """Adds one int option per SHAPE_FLAGS entry, named after its Shape field."""
    for flag, (field, what) in reversed(SHAPE_FLAGS.items()):
        command = click.option(flag, field, type=int, help=f"Override the shape's {what}.")(command)
    return command


def _shape(preset: str, overrides: dict) -> Shape:
    shape = with_overrides(SHAPES[preset], **overrides)
    problem = check_shape(shape)
    if problem:
        raise click.BadParameter(problem, param_hint="the model shape")
    return shape


def _resolve_engine(engine: Path | None, checkpoint: Path | None, work_dir: Path, device: str, shape: Shape,
                    cfg: BuildConfig) -> tuple[Path, Path | None]:
    """The engine folder to measure and the checkpoint for the eager baseline (None: none)."""
    if engine is not None:
        return engine, checkpoint
    if checkpoint is None:
        n = shape.parameters()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        status(f"random {size}-parameter checkpoint ({shape.key()}, {cfg.dtype})")
        checkpoint, reused = ensure_checkpoint(work_dir, shape, cfg.dtype, device)
        release(device)  # the writer may have initialised the weights on the GPU
        status(("reusing " if reused else "wrote ") + str(checkpoint))
    path, reused = ensure_engine(work_dir, checkpoint, cfg)
    status(("reusing engine " if reused else "built engine ") + str(path))
    return path, checkpoint


def _throughput(info: EngineInfo, hw, budget: int, notes: list[str], phases: list[str], batch_sizes: list[int],
                decode_context: int, decode_steps: int, offline_pairs: list[tuple[int, int]], requests: dict,
                seed: int, overlap: bool, prefix_caching: bool, policy: str) -> list[Figure]:
    """The decode and offline phases through one EngineCore whose KV pool takes at most `budget`
    tokens; adds each offline run's summary to `notes`."""
    if "decode" not in phases and "offline" not in phases:
        return []
    wanted = [decode.kv_tokens_needed(info, b, decode_context, decode_steps) for b in batch_sizes] \
        if "decode" in phases else []
    wanted += [offline.kv_tokens_wanted(info, i, o, requests[i, o]) for i, o in offline_pairs] \
        if "offline" in phases else []
    run = open_core(info, hw, min(budget, max(wanted + [info.manifest.kv.block_size])), overlap=overlap,
                    prefix_caching=prefix_caching, policy=policy)
    figures: list[Figure] = []
    try:
        if "decode" in phases:
            for b in batch_sizes:
                status(f"decode b={b}: {decode_context}-token prompts, {decode_steps} timed steps")
                figures.append(decode.measure_decode(run, b, decode_context, decode_steps, seed))
        if "offline" in phases:
            for i, o in offline_pairs:
                status(f"offline {i}/{o}: {requests[i, o]} requests")
                measured = offline.measure_offline(run, i, o, requests[i, o], seed, progress=True)
                figures += measured
                notes += [offline.summary(f) for f in measured[:1] if f.value is not None]
    finally:
        run.close()
    return figures


HELP = """Measure a Kiln engine: decode tokens/s, offline throughput and latency, each beside
its hardware limit and beside the same model run eagerly in PyTorch, all in one run.

\b
What is measured (each phase can be chosen with --only):
  startup  seconds from a fresh process's start to the engine loaded (weights uploaded,
           kernels loaded, graphs captured) and to its first token.
  decode   tokens/s at each --batch-sizes: b requests with --decode-context prompt tokens
           are prefilled, then 3 windows of --decode-steps steps in which all b decode are
           timed; the median window is the figure, all three go to the JSON. Beside it, the
           step time, its CUDA-graph replay's device time and the host's share of a step.
  offline  TensorRT-LLM perf-overview style: --offline-requests requests of each IN/OUT
           length pair submitted at once and run to completion; output and total tokens/s.
  latency  time to first token (TTFT) and inter-token latency (ITL), p50/p90/p99, with
           --rate-requests requests arriving at --rate per second through a Session.
  prefix   prefix caching on and off in the same run: --prefix-requests conversations share
           a system prompt, each first turn adds its own user message, and --prefix-turns - 1
           follow-ups each extend their conversation (--prefix-lengths SYSTEM/USER/OUT);
           TTFT p50 of first turns and of follow-ups, output tokens/s, and caching's
           throughput cost on the same shapes with nothing to share (0% hit rate).

\b
Beside each figure:
  limit    the least time the steps that ran could take: per step, the larger of
           (bytes that must move / copy bandwidth) and (FLOPs / GEMM rate), both ceilings
           measured at the start of this run; "of limit" is how close Kiln came.
  eager    the same checkpoint run eagerly in PyTorch (plain torch ops with
           scaled_dot_product_attention, no graphs, no compile); needs the checkpoint.

\b
Which engine:
  --engine DIR        an engine folder (tensor-parallel ones too); no eager baseline
                      unless --checkpoint names the checkpoint it was built from.
  --checkpoint DIR    build an engine from this Hugging Face checkpoint (into --work-dir).
  neither             write a random checkpoint of --shape (Llama-3-8B by default, 16 GB
                      in bf16) and build it; both are kept in --work-dir and reused.

\b
Examples:
  bench-engine                                  # Llama-3-8B shape on this GPU
  bench-engine --engine engines/qwen3 --only decode --batch-sizes 1,8
  bench-engine --shape tiny --device cpu --max-batch-size 8 --max-seq-len 64 \\
      --batch-sizes 1,4 --decode-context 16 --decode-steps 16 --offline 8/8 --rate-lengths 8/8 \\
      --prefix-lengths 16/4/4 --prefix-requests 4
  bench-engine --only prefix                    # prefix caching on the Llama-3-8B shape
  bench-engine --quantization fp8 --only decode,offline   # FP8 beside bf16, Llama-3-8B shape
"""


@click.command(help=HELP, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--engine", "engine_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Engine folder to measure (built by build-engine).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Hugging Face checkpoint folder: built into an engine, and run eagerly for the baseline.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
              default="~/.cache/kiln/bench", show_default=True,
              help="Where generated checkpoints and engines are kept and reused.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), help="[default: cuda when a GPU is present]")
@click.option("--shape", type=click.Choice(list(SHAPES)), default="llama3-8b", show_default=True,
              help="Shape of the random checkpoint (no --engine or --checkpoint).")
@_shape_flags
@click.option("--dtype", type=click.Choice(MODEL_DTYPES), default="bfloat16", show_default=True,
              help="Weights and KV cache of the engine bench builds (not with --engine).")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="fp8: also build the checkpoint with an e4m3 KV cache and run decode and offline on it too, "
                   "its KV pool sized from the same free memory (about twice the tokens), each figure beside "
                   "the model-dtype cache's (not with --engine). Concurrency is capped by --max-batch-size: "
                   "raise it for long sequences to gain from the larger pool.")
@click.option("--quantization", type=click.Choice(QUANTIZATIONS), default="none", show_default=True,
              help="fp8: also build the FP8 engine (build-engine --quantization fp8) of the same checkpoint and "
                   "run decode and offline on it after the bf16 one, each FP8 figure beside the bf16 figure it "
                   "is compared with (not with --engine). With --kv-cache-dtype fp8 it has the e4m3 cache too.")
@click.option("--quantize-lm-head", is_flag=True,
              help="With --quantization: the quantized engine's LM head too (build-engine --quantize-lm-head); "
                   "the bf16 engine's stays as it is.")
@click.option("--calibration-prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --quantization: static activation scales for the quantized engine from these prompts "
                   "(build-engine --calibration-prompts --activation-scales static), as calibrated FP8 checkpoints "
                   "carry them, and with "
                   "--kv-cache-dtype fp8 its cache's scales too; with --kv-cache-dtype fp8 alone, the e4m3-cache "
                   "engine's scales.")
@click.option("--max-batch-size", type=int, default=256, show_default=True, help="Build flag (not with --engine).")
@click.option("--max-seq-len", type=int, default=4352, show_default=True, help="Build flag: 2048+2048 fits.")
@click.option("--max-num-tokens", type=int, default=8192, show_default=True, help="Build flag: tokens per step.")
@click.option("--only", "phases", type=Phases(), default=",".join(PHASES), show_default=True,
              help="Phases to run.")
@click.option("--batch-sizes", type=IntList(), default="1,8,64,256", show_default=True,
              help="Decode batch sizes.")
@click.option("--decode-context", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompt tokens before the timed decode steps.")
@click.option("--decode-steps", type=click.IntRange(min=1), default=64, show_default=True,
              help="Timed decode steps per window (3 windows per batch size).")
@click.option("--offline", "offline_pairs", type=LengthPairs(), default="128/128,2048/2048", show_default=True,
              help="Input/output token lengths of the offline runs.")
@click.option("--offline-requests", type=click.IntRange(min=1),
              help=f"Requests per offline run [default: {offline.SHORT_REQUESTS:,} when in + out <= "
                   f"{offline.SHORT_TOKENS}, else {offline.LONG_REQUESTS:,}; the KV pool is sized as for serving].")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True,
              help="Latency test: requests arriving per second.")
@click.option("--rate-requests", type=click.IntRange(min=1), default=64, show_default=True,
              help="Latency test: how many requests arrive.")
@click.option("--rate-lengths", type=LengthPairs(), default="128/128", show_default=True,
              help="Latency test: input/output token lengths.")
@click.option("--prefix-requests", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prefix test: conversations sharing the system prompt.")
@click.option("--prefix-lengths", type=PrefixLengths(), default="1024/64/64", show_default=True,
              help="Prefix test: token counts of the system prompt, each user message and each answer.")
@click.option("--prefix-turns", type=click.IntRange(min=1), default=3, show_default=True,
              help="Prefix test: turns per conversation (the first, then follow-ups).")
@click.option("--no-baseline", is_flag=True, help="Skip the eager PyTorch baseline.")
@click.option("--no-overlap", is_flag=True,
              help="Measure the plain engine loop (host work between steps not overlapped with the device).")
@click.option("--no-prefix-caching", is_flag=True,
              help="Run decode, offline and latency with prefix caching off (the prefix phase measures both).")
@click.option("--policy", type=click.Choice(POLICIES), default=POLICIES[0], show_default=True,
              help=f"The scheduler's admission policy for decode, offline and latency: {POLICY_HELP}")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompts.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("bench-results.json"), show_default=True, help="Where to write the results.")
@click.pass_context
def bench_engine(ctx: click.Context, engine_dir: Path | None, checkpoint: Path | None, work_dir: Path,
                 device: str | None, shape: str, num_layers: int | None, hidden_size: int | None,
                 num_heads: int | None, num_kv_heads: int | None, intermediate_size: int | None,
                 vocab_size: int | None, dtype: str, kv_cache_dtype: str, quantization: str,
                 quantize_lm_head: bool, calibration_prompts: Path | None, max_batch_size: int, max_seq_len: int,
                 max_num_tokens: int, phases: list[str],
                 batch_sizes: list[int], decode_context: int, decode_steps: int,
                 offline_pairs: list[tuple[int, int]], offline_requests: int | None, rate: float,
                 rate_requests: int, rate_lengths: list[tuple[int, int]], prefix_requests: int,
                 prefix_lengths: tuple[int, int, int], prefix_turns: int, no_baseline: bool, no_overlap: bool,
                 no_prefix_caching: bool, policy: str, seed: int, json_path: Path) -> None:
    if len(rate_lengths) != 1:
        raise click.BadParameter("give one IN/OUT pair", param_hint="--rate-lengths")
    if kv_cache_dtype == "fp8" and engine_dir is not None:
        raise click.UsageError("--kv-cache-dtype fp8 builds the checkpoint a second time, with an e4m3 KV cache: "
                               "give --checkpoint (or a --shape) instead of --engine")
    device = _device(device)
    if (device == "cpu" and engine_dir is None and checkpoint is None
            and ctx.get_parameter_source("shape") is ParameterSource.DEFAULT):
        raise click.UsageError(
            f"no GPU here, so bench-engine would run on the CPU, and the default --shape {shape} first writes a "
            f"random {SHAPES[shape].parameters() / 1e9:.0f}B-parameter checkpoint. Measure a small engine instead "
            "(--engine DIR, or --shape tiny with small build flags: see the examples in --help), or give "
            f"--shape {shape} to do it anyway")
    model_shape = _shape(shape, {field: ctx.params[field] for field, _ in SHAPE_FLAGS.values()})
    model_shape = with_overrides(model_shape, max_position_embeddings=max(model_shape.max_position_embeddings,
                                                                          max_seq_len))
    notes: list[str] = []
    if quantize_lm_head and quantization == "none":
        raise click.UsageError("--quantize-lm-head is for the --quantization engine: give --quantization fp8 too")
    if calibration_prompts and quantization == "none" and kv_cache_dtype != "fp8":
        raise click.UsageError("--calibration-prompts is for the --quantization engine or the --kv-cache-dtype fp8 "
                               "one: give --quantization fp8 or --kv-cache-dtype fp8 too")
    if quantization != "none" and engine_dir is not None:
        raise click.UsageError(f"--quantization {quantization} builds a bf16 and an {quantization} engine from one "
                               "checkpoint to measure them side by side: give --checkpoint (or a --shape), not "
                               "--engine")
    try:
        cfg = BuildConfig(dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                          max_num_tokens=max_num_tokens,
                          targets=default_targets() if device == "cuda" else ("cpu",))
        # With --kv-cache-dtype fp8 the quantized engine has the e4m3 cache too, as FP8 serving figures are taken.
        quantized_cfg = (dataclasses.replace(cfg, quantization=quantization, quantize_lm_head=quantize_lm_head,
                                             calibration_prompts=calibration_prompts and str(calibration_prompts),
                                             activation_scales="static" if calibration_prompts else "per-token",
                                             kv_cache_dtype=kv_cache_dtype)
                         if quantization != "none" else None)
        engine_dir, checkpoint = _resolve_engine(engine_dir, checkpoint, work_dir.expanduser(), device,
                                                 model_shape, cfg)
        info = inspect(engine_dir, device)
        quantized_info = None
        if quantized_cfg is not None:
            path, reused = ensure_engine(work_dir.expanduser(), checkpoint, quantized_cfg)
            status(("reusing engine " if reused else "built engine ") + str(path))
            quantized_info = inspect(path, device)
    except (EngineFileError, CheckpointError, BuildConfigError, ValueError, FileExistsError) as e:
        raise click.ClickException(str(e)) from e

    status(f"measuring copy bandwidth and GEMM rate on {device}")
    hw = measure(device, torch_dtype(info.manifest.dtype))
    release(device)  # the measurement's buffers, before free memory is read to size the KV pool
    budget = kv_token_budget(info, device)
    figures: list[Figure] = []
    requests = {pair: offline_requests or offline.default_requests(*pair) for pair in offline_pairs}

    if "startup" in phases:
        status("start-up: a fresh process loads the engine and generates one token")
        figures += startup.measure_startup(info, device, min(budget, startup.kv_tokens_wanted(info)))
        release(device)
    throughput = dict(phases=phases, batch_sizes=batch_sizes, decode_context=decode_context,
                      decode_steps=decode_steps, offline_pairs=offline_pairs, requests=requests, seed=seed,
                      overlap=not no_overlap, prefix_caching=not no_prefix_caching, policy=policy)
    figures += _throughput(info, hw, budget, notes, **throughput)
    fp8_figures: list[Figure] = []
    if kv_cache_dtype == "fp8" and ("decode" in phases or "offline" in phases):
        release(device)
        fp8_dir, _ = _resolve_engine(None, checkpoint, work_dir.expanduser(), device, model_shape,
                                     kv_dtype.fp8_config(cfg, calibration_prompts))
        fp8_info = inspect(fp8_dir, device)
        status(f"the same with an e4m3 KV cache ({fp8_dir})")
        fp8_figures = kv_dtype.tagged(_throughput(fp8_info, hw, kv_token_budget(fp8_info, device), notes,
                                                  **throughput))
        notes += kv_dtype.comparisons(figures, fp8_figures, info.manifest.kv.dtype)
        release(device)
    if "latency" in phases:
        (i, o), = rate_lengths
        status(f"latency: {rate_requests} requests of {i}/{o} tokens at {rate:g} per second")
        kv = min(budget, latency.kv_tokens_wanted(info, i, o, rate_requests))
        figures += latency.measure_latency(info, hw, kv, rate, rate_requests, i, o, seed, progress=True,
                                           overlap=not no_overlap, prefix_caching=not no_prefix_caching,
                                           policy=policy)
        release(device)
    if "prefix" in phases:
        workload = prefix.Workload(prefix_requests, *prefix_lengths, prefix_turns)
        figures += prefix.measure_prefix(info, hw, min(budget, workload.kv_tokens_wanted(info)), workload, seed,
                                         overlap=not no_overlap, status=status)
        release(device)
    quantized: list[Figure] = []
    if quantized_info is not None and ("decode" in phases or "offline" in phases):
        release(device)
        status(f"the same with {quantization} weights ({quantized_info.path})")
        quantized_notes: list[str] = []
        quantized = _throughput(quantized_info, hw, kv_token_budget(quantized_info, device), quantized_notes,
                                **throughput)
        notes += [f"{quantization} engine: {n}" for n in quantized_notes]
        release(device)

    if no_baseline:
        notes.append("eager baseline skipped (--no-baseline)")
    elif checkpoint is None:
        notes.append(f"no eager baseline: pass --checkpoint with the checkpoint this engine was built from "
                     f"({info.manifest.source})")
    elif (unsupported := eager_unsupported(checkpoint)) is not None:
        notes.append(f"no eager baseline: {unsupported}")
    elif any(f.value is not None and f.section in ("decode", "offline") for f in figures):
        fill_baseline(figures, checkpoint, info, device, decode_context, decode_steps, seed, status)
    kv_dtype.share_eager(figures, fp8_figures)
    figures += fp8_figures
    figures += beside_bf16(quantized, figures, quantization)
    if quantized:
        notes.append(f"{quantization} figures: the {quantization} engine built from the same checkpoint, measured "
                     "after the bf16 one, decode and offline; 'vs bf16' is how many times better. Their FLOP "
                     "limit uses the bf16 GEMM rate measured above")
    if any(f.section in ("latency", "prefix") for f in figures):
        notes.append("latency and prefix have no eager baseline: an eager script has no server loop to compare with")
    m = info.manifest
    if m.world_size > 1:
        notes.append(f"tensor-parallel engine ({m.world_size} ranks): limits are one rank's "
                     "share over one device's ceilings; the eager baseline runs on one device")

    header = [f"engine {engine_dir}  ({m.dtype}, tp {m.world_size}, targets {', '.join(m.targets)})",
              f"device {hw.device_name}  torch {torch.__version__}"]
    if quantized_info is not None:
        lm_head = ", LM head too" if quantize_lm_head else ""
        static = f", static activation scales from {calibration_prompts}" if calibration_prompts else ""
        cache = ", e4m3 KV cache" if kv_cache_dtype == "fp8" else ""
        header.insert(1, f"engine {quantized_info.path}  ({quantization}{lm_head}{static}{cache}, the same checkpoint)")
    click.echo(render(figures, hw, header, notes))
    context = {"engine": str(engine_dir), "checkpoint": str(checkpoint) if checkpoint else None,
               "quantized_engine": str(quantized_info.path) if quantized_info is not None else None,
               "build": {"dtype": m.dtype, "max_batch_size": m.max_batch_size, "max_seq_len": m.max_seq_len,
                         "max_num_tokens": m.max_num_tokens, "kv_block_size": m.kv.block_size},
               "world_size": m.world_size,
               "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in ctx.params.items()}}
    write_json(results(figures, hw, _command_line(ctx), context, notes), json_path)
    status(f"results written to {json_path}")
