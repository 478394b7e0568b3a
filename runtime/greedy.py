"""Greedy generation for one sequence at a time, straight on an executor.

The smallest loop that turns an engine into text: a prefill step, then one decode step per
token, each sequence in blocks of its own. (Batched serving is the scheduler's job.)
"""
from __future__ import annotations

from runtime.executor import CpuExecutor
from runtime.step import SequenceChunk, pack_step


def greedy_generate(executor: CpuExecutor, prompt_ids: list[int], max_tokens: int,
                    eos_ids: tuple[int, ...] = ()) -> list[int]:
    engine = executor.engine
    block_size, blocks_per_seq = engine.kv_cache["block_size"], engine.bounds["B"]
    max_seq_len = engine.build["max_seq_len"]
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) + max_tokens > max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the engine's "
                         f"max_seq_len {max_seq_len}")
    if len(prompt_ids) > engine.bounds["T"]:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the engine's max_num_tokens {engine.bounds['T']}")
    needed = -(-(len(prompt_ids) + max_tokens) // block_size)
    if needed > executor.kv_cache.shape[2]:
        raise ValueError(f"sequence needs {needed} KV blocks; the executor has {executor.kv_cache.shape[2]}")
    table = list(range(needed))
    tokens = list(prompt_ids)
    chunk = SequenceChunk(tokens, 0, table)
    out: list[int] = []
    while len(out) < max_tokens:
        logits = executor.run(pack_step([chunk], block_size, blocks_per_seq))
        token = int(logits[-1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        chunk = SequenceChunk([token], len(tokens), table)
        tokens.append(token)
    return out
