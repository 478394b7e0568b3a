"""Driver launch of `embedding`'s AOT kernel: `take_rows`'s gather over the token table.
See `plugins.driver_launch` for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.take_rows.launch import launch_gather


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: input_ids [T], weight [vocab, H]; attr scale."""
    input_ids, weight = inputs
    launch_gather(kernels[0], metas[0], weight, input_ids, out, stream, attrs["scale"])
