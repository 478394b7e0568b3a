"""Triton kernel for `embedding`: rows of the token table by id (the `take_rows` gather)."""
from __future__ import annotations

import torch

from kiln.plugins.aot import AotKernel
from kiln.plugins.take_rows.kernels import gather_rows, gather_rows_aot


def run(inputs: list, attrs: dict, out: torch.Tensor) -> None:
    """inputs: input_ids [T], weight [vocab, H]; attr scale."""
    input_ids, weight = inputs
    gather_rows(weight, input_ids, out, attrs["scale"])


def aot_kernels(dtype: str, shapes: dict) -> list[AotKernel]:
    """`shapes` key: hidden (row width of the table)."""
    return [gather_rows_aot(dtype, shapes["hidden"], "T")]
