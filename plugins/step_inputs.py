"""The inputs of one engine step: the contract between the runtime, which fills them, and the
model definitions, whose forward takes them by these names.

Symbolic dims: T = tokens in the step, S = sequences in the step, L = rows whose logits are
wanted, B = blocks per sequence (max_seq_len / kv_block_size, rounded up). The KV cache is a
separate state tensor, [layers, 2, num_blocks, block_size, kv_heads, head_dim]. D (no tensor has
it) counts the step's leading sequences of one new token each, `decode_rows`: the scheduler puts
decode rows first, and attention runs them apart from the prompt chunks of a mixed step.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepInputSpec:
    name: str
    dtype: str
    shape: tuple[str, ...]
    doc: str


STEP_INPUTS: tuple[StepInputSpec, ...] = (
    StepInputSpec("input_ids", "int32", ("T",), "token ids of every sequence's new tokens, packed"),
    StepInputSpec("positions", "int32", ("T",), "position of each token in its sequence"),
    StepInputSpec("slot_mapping", "int32", ("T",), "KV cache slot (block * block_size + offset) of each token"),
    StepInputSpec("block_tables", "int32", ("S", "B"), "cache blocks of each sequence, in order"),
    StepInputSpec("query_lens", "int32", ("S",), "new tokens of each sequence in this step"),
    StepInputSpec("context_lens", "int32", ("S",), "tokens in each sequence's cache after this step"),
    StepInputSpec("logits_indices", "int32", ("L",), "rows of the step whose logits are returned"),
)
KV_CACHE = "kv_cache"


def decode_rows(query_lens: torch.Tensor) -> int:
    """D: how many sequences, from the first, have one new token each (all of them in a pure
    decode step). Read on the host, from the step inputs before they go to the device."""
    longer = (query_lens != 1).nonzero()
    return int(longer[0, 0]) if len(longer) else query_lens.shape[0]
