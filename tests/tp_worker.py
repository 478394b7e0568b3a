"""Shared scenario and process entry point for tests/test_tensor_parallel.py.

A plain module (not a test file) so that processes started with the "spawn" method can
import `run_rank` by name. `run_scenario` is also what the tp 1 reference runs in-process.
"""
from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch

NUM_KV_BLOCKS = 64
DECODE_STEPS = 8
# Two sequences with prefills of different lengths and distinct, non-contiguous block tables
# (4 blocks of 4 slots hold prefill + 8 decode tokens for both). The first asks for every
# prefill token's logits, the second for its last token's only.
PROMPTS = ([1, 17, 200, 45, 99, 310, 5], [1, 250, 8, 77, 140])
BLOCK_TABLES = ([3, 0, 7, 5], [1, 6, 2, 9])
ALL_LOGITS = (True, False)


def run_scenario(engine) -> dict:
    """One prefill step of both sequences, then DECODE_STEPS greedy decode steps of both.

    Returns {"logits": [float32 logits of each step], "tokens": [[greedy tokens] per sequence]}.
    """
    from kiln.runtime.executor import CpuExecutor
    from kiln.runtime.step import SequenceChunk, pack_step

    ex = CpuExecutor(engine, num_kv_blocks=NUM_KV_BLOCKS)
    block_size = engine.manifest.kv.block_size
    blocks_per_seq = engine.manifest.blocks_per_sequence
    chunks = [SequenceChunk(list(p), 0, list(t), all_logits=a)
              for p, t, a in zip(PROMPTS, BLOCK_TABLES, ALL_LOGITS)]
    lengths = [len(p) for p in PROMPTS]
    all_logits, tokens = [], [[] for _ in PROMPTS]
    for _ in range(1 + DECODE_STEPS):
        logits = ex.run(pack_step(chunks, block_size, blocks_per_seq))
        all_logits.append(logits)
        # The last logits row of each sequence; sequence 0 has one row per prefill token.
        rows, row = [], 0
        for c in chunks:
            row += len(c.token_ids) if c.all_logits else 1
            rows.append(row - 1)
        next_ids = logits[rows].argmax(dim=-1).tolist()
        chunks = []
        for s, tok in enumerate(next_ids):
            tokens[s].append(tok)
            chunks.append(SequenceChunk([tok], lengths[s], list(BLOCK_TABLES[s])))
            lengths[s] += 1
    return {"logits": all_logits, "tokens": tokens}


def run_rank(rank: int, world_size: int, engine_dir: str, port: int, out_path: str) -> None:
    """Process entry point: one rank of a gloo group runs the scenario and saves its result."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        try:
            from kiln.runtime.engine import load_engine

            engine = load_engine(engine_dir, rank)
            if (engine.manifest.rank, engine.manifest.world_size) != (rank, world_size):
                raise AssertionError(f"loaded rank {engine.manifest.rank}/{engine.manifest.world_size}, "
                                     f"expected {rank}/{world_size}")
            result = run_scenario(engine)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save(result, out_path)
    except BaseException:
        with open(out_path + ".err", "w") as f:
            f.write(traceback.format_exc())
        raise
