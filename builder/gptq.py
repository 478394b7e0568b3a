"""GPTQ rounding of an FP8 weight (`build-engine --quantization fp8 --calibration-prompts FILE --gptq`).

Rounding each e4m3 weight to its nearest value leaves each row's error to chance. GPTQ (Frantar et al.,
2022) rounds a weight [N, K] one input column at a time and moves each column's rounding error onto the
columns not yet rounded, in the proportions that cancel it best on the inputs the calibration prompts
gave the projection: it minimises ||X W^T - X Q^T|| over those inputs X rather than ||W - Q||. The
statistic it needs is H = X^T X [K, K]. Columns go in the order of their input's energy (diag H, largest
first), and the work goes in blocks of BLOCK columns so that most of it is one matrix product a block.

Each row keeps the scale that rounding to nearest gives it (`plugins.fp8.row_scales`), so a GPTQ weight
is an ordinary per-output-channel e4m3 weight: nothing downstream knows how it was rounded. An input
channel that the prompts never reached (H's diagonal 0) is rounded to nearest and moves nothing.
"""
from __future__ import annotations

import torch

from kiln.plugins.fp8 import FP8, row_scales, to_e4m3

BLOCK = 128
# Added to H's diagonal, as a share of its mean: keeps H invertible when the prompts gave fewer tokens
# than K, or inputs that move together.
DAMPING = 0.01


def gptq_e4m3(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] rounded to float8_e4m3fn by GPTQ over `hessian` [K, K] (the sum of x x^T over the
    calibration inputs x of the projection), and its float32 scale per row [N]. Runs where `hessian` is."""
    device = hessian.device
    w = weight.to(device=device, dtype=torch.float32)
    scale = row_scales(w)
    h = hessian.to(torch.float32).clone()
    unseen = h.diagonal() == 0
    h[unseen, unseen] = 1.0
    order = torch.argsort(h.diagonal(), descending=True)
    h = h[order][:, order]
    h.diagonal().add_(DAMPING * h.diagonal().mean())
    # The upper Cholesky factor of H^-1: row j holds how column j's error spreads over columns j.. .
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    # Transposed, so that a column of the weight is a contiguous row here.
    wt = w[:, order].t().contiguous()
    k = wt.shape[0]
    qt = torch.empty(wt.shape, dtype=FP8, device=device)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block, ub = wt[start:end], u[start:end, start:end]
        errors = torch.empty_like(block)
        for j in range(end - start):
            qt[start + j] = to_e4m3(block[j], scale)
            errors[j] = (block[j] - qt[start + j].float() * scale) / ub[j, j]
            block[j + 1:] -= ub[j, j + 1:, None] * errors[j]
        wt[end:] -= u[start:end, end:].t() @ errors
    q = qt.t()
    restore = torch.argsort(order)
    return q.view(torch.uint8)[:, restore].view(FP8).cpu(), scale.cpu()
