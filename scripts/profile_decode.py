"""Where a decode step's time goes, op by op, on the GPU: a developer's profile, not a benchmark.

    PYTHONPATH=. python3 scripts/profile_decode.py ENGINE_DIR [--batch 1 --batch 64] [--context 128] [--json F]

For each batch size: one prefill puts `context` tokens of every sequence in the cache, then
the whole decode step is timed as the executor runs it (graph replay), and each kind of plan op is
timed twice, in graphs: alone (its launches one after another), and in the step (the step's graph without
that kind's launches, subtracted from the whole step's). The two differ where a kernel overlaps its
neighbours: a kernel launched for programmatic dependent launch overlaps the one before only if that one
lets it (`plugins.aot.programmatic`), which its own kind does and the step's other kinds may not. Then
one eager (graph-less) step of the decode rows plus a new prompt, with the host's time to launch it beside
its device time. Each op's weight bytes over its time give the bandwidth it reaches; the sum over ops shows
the launch gaps the graph removes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kiln.plugins.attention import launch as attention
from kiln.plugins.attention_o_proj import launch as attention_o_proj
from kiln.runtime.cuda_executor import CudaExecutor
from kiln.runtime.engine import load_engine
from kiln.runtime.step import SequenceChunk, pack_step
from scripts.gpu_timing import warm


def time_ms(fn, repeats: int = 20) -> float:
    """Median milliseconds of `fn` on the current stream, after `gpu_timing.WARM_S` seconds of warm-up calls."""
    warm(fn)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile(ex: CudaExecutor, batch: int, context: int) -> dict:
    """Prints the step's and each kind of op's time; returns them: step ms, and us a launch by op kind."""
    engine = ex.engine
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    per_seq = -(-(context + 1) // bs)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    g = torch.Generator().manual_seed(0)
    per_step = max(1, engine.manifest.max_num_tokens // context)
    for first in range(0, batch, per_step):
        chunk = range(first, min(batch, first + per_step))
        ex.run(pack_step([SequenceChunk(torch.randint(0, 1000, (context,), generator=g).tolist(), 0, tables[s])
                          for s in chunk], bs, nb))
    step = pack_step([SequenceChunk([7], context, t) for t in tables], bs, nb)
    total = time_ms(lambda: ex.run(step))
    weights = sum(w.nbytes for name, w in ex.weights.items() if "embed" not in name)
    print(f"batch {batch}, context {context}: step {total:.3f} ms ({batch / total * 1e3:.0f} tok/s), "
          f"{weights / total / 1e6:.0f} GB/s of non-embedding weights")
    eager_mixed_step(ex, tables, context, g)
    result = {"batch": batch, "context": context, "step_ms": total, "us_each": {}}
    kinds: dict[str, list] = {}
    for op in ex.ops:
        kinds.setdefault(op.launcher.__name__.split(".")[-2], []).append(op)
        if op.launcher is attention_o_proj:
            # Its attention stage alone, to tell it apart from the o_proj GEMM.
            kinds.setdefault("(attention part)", []).append(op)
    # The step's ops in graphs of their own: the whole step, and the step without each kind of op (the skipped
    # ops' outputs keep what they last held, which costs the ops after them the same to read). Before each
    # replay the step inputs are put back from a copy on the device: the memory plan lets later activations
    # reuse an input's bytes once its last reader is done (the token ids' after the embedding).
    dims, values = ex._begin(step, ())
    values.update((op.output, ex._view(op.output, dims)) for op in ex.ops)
    inputs = ex.arena[ex.inputs.start:ex.inputs.end]
    staged = inputs.clone()

    def in_step_ms(ops: list) -> float:
        graph = step_graph(ex, values, dims, ops)
        return time_ms(lambda: (inputs.copy_(staged), graph.replay()))

    whole = in_step_ms(ex.ops)
    for kind, ops in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        # One graph launches every op of this kind, right after the step inputs were put back:
        # ops that read step inputs (token ids, slots, block tables) see valid ones, and
        # activations are whatever is there, which costs the same to read.
        inputs.copy_(staged)
        graph = (attention_part_graph if kind == "(attention part)" else step_graph)(ex, values, dims, ops)
        ms = time_ms(graph.replay)
        nbytes = 0 if kind == "(attention part)" else sum(
            ex.weights[t].nbytes for op in ops for t in op.inputs if t in ex.weights)
        in_step = None
        if kind != "(attention part)":   # a part of an op: the step cannot go without it
            skipped = {id(op) for op in ops}
            in_step = (whole - in_step_ms([op for op in ex.ops if id(op) not in skipped])) / len(ops) * 1e3
        print(f"  {kind:18s} x{len(ops):<3d} {ms:8.3f} ms  {ms / len(ops) * 1e3:8.1f} us each alone, "
              f"{'-' if in_step is None else f'{in_step:.1f}':>6} in the step  "
              f"{nbytes / ms / 1e6 if 'embed' not in kind else 0:7.0f} GB/s of weights")
        result["us_each"][kind] = ms / len(ops) * 1e3
        result.setdefault("us_in_step", {})[kind] = in_step
    return result


def attention_part_graph(ex: CudaExecutor, values: dict, dims: dict[str, int], ops: list) -> torch.cuda.CUDAGraph:
    """A graph of the attention stage alone of each attention_o_proj op in `ops`, into its scratch buffer."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream().cuda_stream
        for op in ops:
            args = [None if t is None else values[t] if t in values else ex.weights[t] for t in op.inputs]
            roles = [i for i, m in enumerate(op.metas) if "role" in m]
            q = args[0]
            attn = ex.scratch["attention_o_proj_attn"][:q.numel() * q.element_size()].view(q.dtype)
            # attention_o_proj's inputs: attention's first 8, w_o, b_o, residual, kv_scales, w_o_scale, and the
            # static scale that kernels built with the FP8 handoff take.
            kv_scales, x_static = [args[i] if len(args) > i else None for i in (11, 13)]
            handing = any(op.metas[i].get("handoff") for i in roles)
            attention.launch([op.kernels[i] for i in roles], [op.metas[i] for i in roles], args[:8] + [kv_scales],
                             op.attrs, attn.view(q.shape), dims, stream, ex.scratch, x_static if handing else None)
    return graph


def step_graph(ex: CudaExecutor, values: dict, dims: dict[str, int], ops: list) -> torch.cuda.CUDAGraph:
    """A graph of `ops` (the plan's, or some of them, in plan order) launched as the executor launches a
    one-rank step."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream().cuda_stream
        for op in ops:
            args = [None if t is None else values[t] if t in values else ex.weights[t] for t in op.inputs]
            op.launcher.launch(op.kernels, op.metas, args, op.attrs, values[op.output], dims, stream, ex.scratch)
    return graph


def eager_mixed_step(ex: CudaExecutor, tables: list[list[int]], context: int, g: torch.Generator) -> None:
    """A step that runs without a graph: the batch's decode rows and one new sequence's prompt
    of `context` tokens (as a request arriving mid-stream makes). Printed: the host's time to
    enqueue it (the launches from Python) beside the device's time to run it; a step whose
    launches take longer than its kernels leaves the GPU waiting on the host."""
    engine = ex.engine
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    free = max(b for t in tables for b in t) + 1
    fresh = list(range(free, free + -(-context // bs)))
    if fresh[-1] >= ex.pad_block or len(tables) + 1 > engine.manifest.max_batch_size:
        return
    chunks = [SequenceChunk([7], context, t) for t in tables]
    chunks.append(SequenceChunk(torch.randint(0, 1000, (context,), generator=g).tolist(), 0, fresh))
    step = pack_step(chunks, bs, nb)
    device_ms = time_ms(lambda: ex.run(step))
    torch.cuda.synchronize()
    host = []
    for _ in range(10):
        start = time.perf_counter()
        ex.run(step)
        host.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    print(f"  eager step of {len(tables)} decode rows + a {context}-token prompt: device {device_ms:.3f} ms, "
          f"host enqueue {statistics.median(host):.3f} ms ({len(ex.ops)} plan ops)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    engine = load_engine(args.engine, target=f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}",
                         verify=False)
    batches = args.batch or [1, 64]
    bs = engine.manifest.kv.block_size
    # One sequence more than the largest batch: the eager step adds a new prompt.
    ex = CudaExecutor(engine, (max(batches) + 1) * -(-(args.context + 1) // bs))
    results = [profile(ex, batch, args.context) for batch in batches]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
