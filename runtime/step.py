"""Packing the work of one engine step into the step inputs (see `plugins.step_inputs`).

A step holds several sequences; each contributes a chunk of new tokens (a prefill chunk or a
single decode token) that extend what its KV cache already holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
class Feed:
    """Input tokens that the previous step sampled and the host has not seen yet: the executor
    sets `input_ids[rows[i]] = sampled[picks[i]]` on the device after staging the inputs."""

    rows: list[int]
    picks: list[int]
    sampled: torch.Tensor | None  # the previous step's sampled ids, where its logits were (None:
                                  # on each tensor-parallel rank, which keeps its own)

    def apply(self, input_ids: torch.Tensor) -> None:
        device = input_ids.device
        n = len(self.rows)
        if self.rows == self.picks == list(range(n)):
            # A decode batch in the previous step's order (the steady state): one copy, where the
            # general case uploads both index lists and runs three kernels, every step.
            input_ids[:n].copy_(self.sampled[:n])
            return
        chosen = self.sampled.index_select(0, to_device(self.picks, torch.long, self.sampled.device))
        input_ids.index_copy_(0, to_device(self.rows, torch.long, device), chosen.to(device, input_ids.dtype))


class SampledIds:
    """A step's sampled token ids on their way to the host: `ids` stays where the logits were
    (the next step's `Feed` reads it there) and a copy to pinned host memory is started at once;
    `wait()` waits for that copy alone. `logprobs` are read on the host when sampled."""

    def __init__(self, ids: torch.Tensor, logprobs: list[dict | None]):
        self.ids = ids
        self.logprobs = logprobs
        self._ready = None
        self._host = ids
        if ids.device.type == "cuda":
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def wait(self) -> tuple[list[int], list[dict | None]]:
        """The ids as a host list, and the logprobs entries."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist(), self.logprobs

    def running(self) -> bool:
        return self._ready is not None and not self._ready.query()


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the device's stream: a CUDA copy
    goes from pinned memory, non-blocking. (A plain `torch.tensor(values, device=...)` makes a
    blocking copy that waits for every kernel in flight, which the overlapped loop must not.)"""
    on_gpu = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=on_gpu).to(device, non_blocking=True)


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

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Tokens, sequences and logit rows: with the engine's blocks per sequence, every
        input's shape."""
        return self.num_tokens, self.query_lens.shape[0], self.logits_indices.shape[0]

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.__dict__)


def pack_step(chunks: list[SequenceChunk], block_size: int, blocks_per_seq: int) -> StepInputs:
    # Runs every engine step on the host while the GPU waits: plain lists and one numpy table,
    # then one tensor per input.
    ids, positions, slots, lens, ctx, logit_rows = [], [], [], [], [], []
    tables = np.zeros((len(chunks), blocks_per_seq), dtype=np.int32)
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        end = c.start + n
        table = c.block_table
        if len(table) * block_size < end:
            raise ValueError(f"sequence {s}: {len(table)} blocks cannot hold {end} tokens")
        first = len(ids)
        ids += c.token_ids
        if n == 1:  # a decode row, the common case: no comprehension to set up
            positions.append(c.start)
            slots.append(table[c.start // block_size] * block_size + c.start % block_size)
        else:
            new_positions = range(c.start, end)
            positions += new_positions
            slots += [table[pos // block_size] * block_size + pos % block_size for pos in new_positions]
        tables[s, :len(table)] = table
        lens.append(n)
        ctx.append(end)
        if c.all_logits:
            logit_rows += range(first, first + n)
        else:
            logit_rows.append(first + n - 1)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return StepInputs(i32(ids), i32(positions), i32(slots), torch.from_numpy(tables), i32(lens), i32(ctx),
                      i32(logit_rows))
