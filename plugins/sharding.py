"""How a plugin says what one tensor-parallel rank keeps of its op.

A plugin's `shard` rule (`PluginSpec.shard`) gets the op's input shapes (weights' are
concrete), its attributes, the rank, the world size and the op's source module (for messages),
and returns a `Shard`: the attributes that change on this rank and a `Split` for each weight
input it cuts. The builder's shard pass applies them and checks that ops sharing a weight cut
it the same way. The helpers below are the cuts the built-in rules share: whole heads, or an
even slice of rows or columns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


class ShardError(ValueError):
    """The model's shape cannot be split over the requested number of ranks."""


@dataclass(frozen=True)
class Split:
    """This rank's part of one weight: `take` cuts it from the whole; `how` names the cut, so
    two ops that read the same weight can be checked to agree."""

    how: str
    take: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shard:
    """One rank's part of an op: the attributes it changes and its weight inputs' splits (by
    input name; an absent optional input is skipped)."""

    attrs: dict = field(default_factory=dict)
    weights: dict[str, Split] = field(default_factory=dict)


# (input shapes, attrs, rank, world size, source module) -> this rank's part of the op.
ShardRule = Callable[[dict[str, tuple | None], dict, int, int, str], Shard]


def heads(total: int, rank: int, world: int, what: str, replicate: bool = True) -> tuple[int, int]:
    """(first head, count) of this rank's heads. kv heads are replicated when too few;
    attention (q) heads never are (`replicate=False`)."""
    if total % world == 0:
        per = total // world
        return rank * per, per
    if replicate and total < world and world % total == 0:
        return rank // (world // total), 1
    raise ShardError(f"{total} {what} cannot be split over --tp-size {world}: "
                     f"use a tp size that divides {total} (or that {total} divides, for kv heads)")


def split_even(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """(start, count) of this rank's equal share of `n`."""
    if n % world:
        raise ShardError(f"{what} of size {n} cannot be split over --tp-size {world}: use a tp size that divides {n}")
    return rank * (n // world), n // world


def rows(w: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return w[start:start + count].contiguous()


def output_split(start: int, count: int) -> Split:
    """Output features start..start+count of a [N, K] weight (or an [N] bias): column parallel."""
    return Split(f"column {start}+{count}", lambda w: rows(w, start, count))


def input_split(start: int, count: int) -> Split:
    """Input features start..start+count of an [N, K] weight: row parallel."""
    return Split(f"row {start}+{count}", lambda w: w[:, start:start + count].contiguous())
