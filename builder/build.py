"""The build: model -> trace -> fusion -> (FP8 quantization) -> per rank (shard, fold, plan memory)
-> engine folder.

The output folder is assembled in a temporary sibling and renamed into place at the end, so
a failed build leaves nothing half-written.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from kiln import models
from kiln.atomic import atomic_folder
from kiln.builder.calibrate import Calibration, calibrate, read_prompts
from kiln.builder.config import BuildConfig
from kiln.builder.ir import Graph, layer_of
from kiln.builder.kernels import compile_all_reduce, compile_kernels
from kiln.builder.passes import FUSIONS, fold_weights, plan_memory, quantize_kv_cache, shard, vocab_parallel
from kiln.builder.passes.kv_cache import KV_SCALES, granularity
from kiln.builder.passes.quantize import (hand_off_fp8, has_static_scales, is_fp8, quantize_fp8,
                                          weights_to_quantize)
from kiln.builder.passes.memory import MemoryPlan
from kiln.builder.trace import trace
from kiln.engines.format import write_engine_file
from kiln.engines.manifest import KVLayout, Manifest, PlanEntry, TensorSpec
from kiln.plugins import get_plugin, nvcc

KILN_VERSION = "0.1.0"
TOKENIZER_FILE = "tokenizer.json"  # what the runtime encodes and decodes with
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class BuildError(ValueError):
    """The build cannot go on; the message says why and what to do."""


@dataclass
class BuildSummary:
    output: Path
    layers: int
    fusions_per_layer: dict[str, int]
    op_counts: dict[str, int]
    weight_bytes: list[int]
    arena_bytes: list[int]
    targets: list[str]
    kernels: list[int]
    quantization: str = "none"
    seconds: float = 0.0
    activation_scales: str = ""   # FP8: "static" (calibrated, or the checkpoint's) or "per-token"
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        fused = ", ".join(f"{op} x{n}" for op, n in self.fusions_per_layer.items()) or "none"
        lines = [
            f"engine      {self.output}",
            f"ranks       {len(self.weight_bytes)}   targets {', '.join(self.targets)}",
            f"layers      {self.layers}   fused ops per layer: {fused}",
            f"plan        {sum(self.op_counts.values())} ops: "
            + ", ".join(f"{op} {n}" for op, n in sorted(self.op_counts.items())),
            f"weights     {_mib(self.weight_bytes[0])} per rank ({_mib(sum(self.weight_bytes))} total)"
            + (f", {self.quantization} GEMMs" if self.quantization != "none" else "")
            + (f" ({self.activation_scales} activation scales)" if self.activation_scales else ""),
            f"arena       {_mib(self.arena_bytes[0])} per rank (activations and step inputs)",
            f"kernels     {self.kernels[0]} cubins per rank" + ("" if self.kernels[0] else " (CPU only: none needed)"),
            f"time        {self.seconds:.1f} s",
        ]
        return "\n".join(lines + [f"note        {n}" for n in self.notes])


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def lower_rank(graph: Graph, cfg: BuildConfig, rank: int) -> tuple[Graph, MemoryPlan]:
    """One rank's graph, with weights folded, and its memory plan."""
    g = fold_weights(shard(graph, rank, cfg.tp_size))
    return g, plan_memory(g, cfg.bounds)


def manifest_for(graph: Graph, memory: MemoryPlan, cfg: BuildConfig, model_info: dict, rank: int,
                 kernel_keys: dict[str, dict], tokenizer_file: str | None,
                 chat_template_file: str | None = None, all_reduce_keys: dict[str, list[str]] | None = None) -> Manifest:
    """Rank `rank`'s manifest; the writer adds the weight and kernel indexes."""
    kv = graph.tensors["kv_cache"]
    scales = graph.weights.get(KV_SCALES)
    return Manifest(
        kiln_version=KILN_VERSION, model=model_info, dtype=cfg.dtype, targets=tuple(cfg.targets),
        rank=rank, world_size=cfg.tp_size, max_num_tokens=cfg.max_num_tokens,
        max_batch_size=cfg.max_batch_size, max_seq_len=cfg.max_seq_len,
        kv=KVLayout(num_layers=kv.shape[0], block_size=cfg.kv_block_size, num_kv_heads=kv.shape[4],
                    head_dim=kv.shape[5], dtype=kv.dtype, scales=KV_SCALES if scales is not None else None,
                    scale_granularity=granularity(scales) if scales is not None else None),
        tokenizer_file=tokenizer_file, chat_template_file=chat_template_file,
        inputs=tuple(graph.inputs), outputs=tuple(graph.outputs),
        tensors={name: TensorSpec(tuple(t.shape), t.dtype, t.kind)
                 for name, t in graph.tensors.items() if t.kind != "weight"},
        plan=tuple(PlanEntry(n.op, get_plugin(n.op).version, n.inputs, n.attrs, n.output, n.source,
                             {t: tuple(k) for t, k in kernel_keys.get(n.output, {}).items()})
                   for n in graph.nodes),
        arena_bytes=memory.arena_bytes, slots=memory.slots,
        all_reduce_kernels={t: tuple(k) for t, k in (all_reduce_keys or {}).items()},
        quantization=cfg.quantization,
    )


def _fusions_per_layer(graph: Graph) -> tuple[int, dict[str, int]]:
    layers = {layer_of(n.source) for n in graph.nodes} - {None}
    counts: dict[str, int] = {}
    for n in graph.nodes:
        if get_plugin(n.op).fused and layer_of(n.source) is not None:
            counts[n.op] = counts.get(n.op, 0) + 1
    return len(layers), {op: c // max(len(layers), 1) for op, c in counts.items()}


def _check_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise BuildError(f"--output {output} is a file, not a folder")
    if output.is_dir() and any(output.iterdir()) and not (output / Manifest.rank_file(0)).exists():
        raise BuildError(f"--output {output} is not empty and holds no engine: choose an empty or new folder")


def _calibration_prompts(cfg: BuildConfig, extra_files: Mapping[str, bytes]) -> list[list[int]] | None:
    """The token ids of --calibration-prompts, each cut to max_seq_len; None without the flag.
    Read before anything is written, so a bad file fails the build at once."""
    if cfg.calibration_prompts is None:
        return None
    from tokenizers import Tokenizer

    texts = read_prompts(cfg.calibration_prompts)
    if TOKENIZER_FILE not in extra_files:
        raise BuildError(f"--calibration-prompts needs the checkpoint's {TOKENIZER_FILE} to tokenize the prompts")
    tokenizer = Tokenizer.from_str(extra_files[TOKENIZER_FILE].decode("utf-8"))
    return [ids[:cfg.max_seq_len] for ids in (tokenizer.encode(t).ids for t in texts) if ids]


def build_from_model(model: nn.Module, output: str | Path, cfg: BuildConfig, model_info: dict,
                     extra_files: Mapping[str, bytes] | None = None, progress: bool = False,
                     chat_template: str | None = None, kv_scales: torch.Tensor | None = None) -> BuildSummary:
    """Compile an in-memory model definition into an engine folder; `extra_files` (name ->
    contents: the checkpoint's config and tokenizer files) are written into it, and
    `chat_template` (Jinja text) as CHAT_TEMPLATE_FILE. With `cfg.kv_cache_dtype` fp8 the cache
    is e4m3 with `kv_scales` ([layers, 2] or [layers, 2, kv heads]; None is 1.0 everywhere)."""
    start = time.time()
    output = Path(output)
    _check_output(output)
    extra_files = dict(extra_files or {})
    tokenizer_file = TOKENIZER_FILE if TOKENIZER_FILE in extra_files else None
    calibration = _calibration_prompts(cfg, extra_files)
    passes = {f.__name__: f for f in (FUSIONS if cfg.fuse else ())}
    measured: list[Calibration] = []   # what the "calibrate" pass measured, before anything is quantized
    if calibration:
        def calibrate_pass(g: Graph) -> Graph:
            gptq = weights_to_quantize(g, cfg.quantize_lm_head) if cfg.gptq else ()
            if cfg.gptq and not gptq:
                raise BuildError("--gptq: the checkpoint's weights are FP8 already, so there is nothing to round; "
                                 "build without --gptq (GPTQ rounds a bf16/fp16 checkpoint's weights)")
            measured.append(calibrate(g, calibration, cfg.kv_block_size, progress, gptq))
            return g
        passes["calibrate"] = calibrate_pass
    if cfg.kv_cache_dtype == "fp8":
        passes[quantize_kv_cache.__name__] = lambda g: quantize_kv_cache(
            g, measured[0].kv_scales() if kv_scales is None and measured else kv_scales)
    if cfg.quantization == "fp8":
        static = cfg.activation_scales == "static"
        passes["quantize_fp8"] = lambda g: quantize_fp8(g, cfg.quantize_lm_head,
                                                        measured[0].activations if measured and static else None,
                                                        measured[0].rounded if measured else None)
        passes[hand_off_fp8.__name__] = hand_off_fp8
    steps = ["trace", *passes]
    for r in range(cfg.tp_size):
        steps += [f"rank {r}: shard+fold+plan", f"rank {r}: kernels", f"rank {r}: write"]
    bar = tqdm(total=len(steps), desc="build-engine", unit="step", disable=not progress)
    try:
        with atomic_folder(output) as tmp:
            bar.set_postfix_str("trace")
            graph = trace(model)
            bar.update()
            for name, rewrite in passes.items():
                bar.set_postfix_str(name)
                graph = rewrite(graph)
                bar.update()
            if cfg.quantization == "none" and is_fp8(graph):
                raise BuildError("the model holds FP8 weights (a pre-quantized checkpoint): build it with "
                                 "--quantization fp8")
            layers, fusions = _fusions_per_layer(graph)
            weight_bytes, arena_bytes, kernel_counts, notes = [], [], [], []
            for rank in range(cfg.tp_size):
                bar.set_postfix_str(f"rank {rank}: shard, fold, plan memory")
                g, memory = lower_rank(graph, cfg, rank)
                if rank == 0 and cfg.tp_size > 1 and not vocab_parallel(g):
                    notes.append(f"the LM head runs whole on every rank: its vocabulary "
                                 f"({g.tensors[g.outputs[0]].shape[-1]}) does not split evenly over --tp-size "
                                 f"{cfg.tp_size}")
                bar.update()

                def compiling(what: str, r: int = rank) -> None:
                    bar.set_postfix_str(f"rank {r}: compile {what}")

                blobs, keys = compile_kernels(g, cfg.dtype, list(cfg.targets), cfg.kv_block_size, compiling)
                collective, all_reduce_keys = compile_all_reduce(cfg.dtype, list(cfg.targets), cfg.tp_size, compiling)
                blobs.update(collective)
                bar.update()
                bar.set_postfix_str(f"rank {rank}: write {len(g.weights)} weights")
                manifest = manifest_for(g, memory, cfg, model_info, rank, keys, tokenizer_file,
                                        CHAT_TEMPLATE_FILE if chat_template is not None else None, all_reduce_keys)
                write_engine_file(tmp / Manifest.rank_file(rank), manifest, g.weights, blobs)
                bar.update()
                kernel_counts.append(len(blobs))
                weight_bytes.append(sum(w.numel() * w.element_size() for w in g.weights.values()))
                arena_bytes.append(memory.arena_bytes)
            for name, data in extra_files.items():
                (tmp / name).write_bytes(data)
            if chat_template is not None:
                (tmp / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    finally:
        bar.close()
    scales = ("static" if has_static_scales(graph) else "per-token") if cfg.quantization != "none" else ""
    if measured and measured[0].rounded:
        notes.append(f"{len(measured[0].rounded)} FP8 weights rounded by GPTQ over the "
                     f"{sum(map(len, calibration))} tokens of --calibration-prompts")
    return BuildSummary(output, layers, fusions, graph.count_ops(), weight_bytes, arena_bytes, list(cfg.targets),
                        kernel_counts, cfg.quantization, time.time() - start, notes=notes, activation_scales=scales)


def build_engine(checkpoint: str | Path, output: str | Path, cfg: BuildConfig, progress: bool = False) -> BuildSummary:
    """Build an engine folder from a Hugging Face checkpoint folder or a GGUF file."""
    checkpoint = Path(checkpoint)
    model, mcfg = models.load(checkpoint, cfg.dtype, max_positions=cfg.max_seq_len)
    notes = []
    if cfg.max_seq_len > mcfg.max_position_embeddings:
        notes.append(f"--max-seq-len {cfg.max_seq_len} exceeds the model's max_position_embeddings "
                     f"({mcfg.max_position_embeddings}): quality past it is not guaranteed")
    kv_scales = models.read_kv_scales(checkpoint, mcfg)
    if cfg.kv_cache_dtype == "fp8":
        notes.append("KV cache float8_e4m3fn, " + (
            "with the checkpoint's scales" if kv_scales is not None else
            "scales calibrated per kv head on --calibration-prompts" if cfg.calibration_prompts else
            "scales 1.0 (the checkpoint has none; --calibration-prompts would calibrate them)"))
    elif kv_scales is not None:
        notes.append("the checkpoint carries FP8 KV-cache scales: --kv-cache-dtype fp8 would use them")
    if any(t != "cpu" for t in cfg.targets) and nvcc.nvcc_path() is None:
        notes.append("nvcc not found: the CUDA kernels (GEMVs for decode steps of 1-2 rows, an e4m3 cache's decode "
                     "attention) are left out, and Triton's serve in their place (decode about 3% slower on an "
                     "H200); install the CUDA toolkit or set KILN_NVCC to build them")
    elif "sm_90" in cfg.targets and not nvcc.cutlass_available():
        notes.append("CUTLASS's headers not found: the CuTe kernels of sm_90 (the GEMMs and qkv of steps of "
                     "129-256 rows, the prefill attention) are left out and "
                     "Triton's serve in their place; `pip install --no-deps nvidia-cutlass==4.2.0.0` (make install "
                     "does) to build them")
    summary = build_from_model(model, output, cfg, {"source": str(checkpoint), **mcfg.to_dict()},
                               models.engine_files(checkpoint), progress, models.read_chat_template(checkpoint),
                               kv_scales)
    summary.notes += notes
    return summary
