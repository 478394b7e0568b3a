"""Packing the work of one engine step into the step inputs (see `plugins.step_inputs`).

A step holds several sequences; each contributes a chunk of new tokens (a prefill chunk or a
single decode token) that extend what its KV cache already holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceChunk:
    """New tokens of one sequence in a step.

    `start` is how many of the sequence's tokens are already in the cache; `block_table` lists
    the cache blocks the sequence owns, enough for start + len(token_ids) tokens. `all_logits`
    asks for the logits of every new token instead of only the last one.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    all_logits: bool = False


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.__dict__)


def pack_step(chunks: list[SequenceChunk], block_size: int, blocks_per_seq: int) -> StepInputs:
    ids, positions, slots, lens, ctx, logit_rows = [], [], [], [], [], []
    tables = torch.zeros(len(chunks), blocks_per_seq, dtype=torch.int32)
    for s, c in enumerate(chunks):
        end = c.start + len(c.token_ids)
        if len(c.block_table) * block_size < end:
            raise ValueError(f"sequence {s}: {len(c.block_table)} blocks cannot hold {end} tokens")
        first = len(ids)
        ids += c.token_ids
        for pos in range(c.start, end):
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        tables[s, : len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.int32)
        lens.append(len(c.token_ids))
        ctx.append(end)
        logit_rows += list(range(first, len(ids))) if c.all_logits else [len(ids) - 1]

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return StepInputs(i32(ids), i32(positions), i32(slots), tables, i32(lens), i32(ctx), i32(logit_rows))
