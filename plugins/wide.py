"""Float32 copies of CPU weights, made once per weight: what the CPU references multiply by.

A GPU GEMM multiplies bf16, fp16 or e4m3 values into float32 and rounds its output once; the CPU
references do the same with a float32 GEMM over a widened weight. That keeps their numerics one
definition on every CPU (torch's own bf16 GEMMs round differently on a CPU with bf16
dot-product instructions than on one without), and it is the fast way on a CPU: converting an
element costs more than multiplying it (about 20 ns: seconds a step for a 135M model), and on an
AVX2 CPU a float32 GEMM of 64 rows runs 3.6x faster than the bf16 one. Each live weight keeps its
copy until the weight is freed (or written: then it is converted again).
"""
from __future__ import annotations

import weakref

import torch

_WIDE: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def widened(w: torch.Tensor) -> torch.Tensor:
    """`w` as float32: on the CPU converted once per weight (and again if it is written)."""
    if w.device.type != "cpu" or w.dtype == torch.float32:
        return w.float()
    key = id(w)
    hit = _WIDE.get(key)
    if hit is None or hit[0]() is not w or hit[1] != w._version:
        hit = (weakref.ref(w, lambda _, key=key: _WIDE.pop(key, None)), w._version, w.float())
        _WIDE[key] = hit
    return hit[2]
