"""The dtype names Kiln writes and reads (in checkpoints, build flags, the IR and engine
manifests), and the one table that maps them to torch dtypes and element sizes.

A name is the torch dtype's own without `torch.`: "bfloat16", "float32", "int32", ...
"""
from __future__ import annotations

import torch

# The dtypes a model is built and run in; the step inputs and other index tensors use the rest.
MODEL_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`; ValueError for a name that is not one."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use a torch dtype name such as 'bfloat16' or 'int32'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def element_bytes(name: str) -> int:
    return torch_dtype(name).itemsize
