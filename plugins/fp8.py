"""FP8 (e4m3) numerics: the one definition that every FP8 weight, activation and KV-cache path
is checked against (CPU references and GPU kernels alike).

- Weights: float8_e4m3fn [N, K] and one float32 scale per output feature, w ~ wq * scale[:, None];
  the scale maps the row's largest magnitude onto e4m3's largest finite value (448).
- Activations: quantized per token (row) when they are made, x ~ xq * scale[:, None], with the
  same rule per row. A row of zeros gets the smallest scale, so nothing divides by zero. An
  RMSNorm'd row times a norm weight g takes its largest magnitude as rstd * max |x * g|, rounded
  to x's dtype (`normed_row_scales`): what a fused kernel knows after one pass over x. Or,
  static: one float32 scale for the whole tensor, fixed at build time from a calibration run
  (the largest magnitude seen, over 448); a larger value at run time saturates at +-448.
- GEMM: the products of e4m3 values are exact in float32, so y = (xq @ wq^T in float32)
  * x_scale[:, None] * w_scale[None, :], then cast to the activation dtype.

Rounding is torch's float -> float8_e4m3fn cast (round to nearest even, saturated here by the
clamp first: e4m3fn has no infinity, and an unclamped overflow would become NaN).
"""
from __future__ import annotations

import torch

from kiln.plugins.wide import widened

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# The GPU targets with e4m3 tensor cores (sm_80 has none): where FP8 engines are built and run.
FP8_TARGETS = ("sm_89", "sm_90", "sm_100")
# The smallest scale a row gets: keeps an all-zero row finite and its reciprocal in float32.
MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturating at +-448; `scale` broadcasts against `x`."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # Divided by a tensor, not the number: on a GPU torch divides by a Python scalar as a product
    # with its reciprocal, a float32 ulp off at times (the kernels divide exactly).
    return (amax / torch.full_like(amax, E4M3_MAX)).clamp(min=MIN_SCALE)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """One float32 scale per row of a 2-D tensor: its largest magnitude over 448."""
    return _scales(x.float().abs().amax(dim=-1))


def normed_row_scales(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The per-token scales of the rows RMSNorm(x) * weight (rstd: each row's RMSNorm factor,
    [T] or [T, 1]): rstd * max |x * weight| rounded to x's dtype, over 448. The normalized
    values are rounded twice on their own way (`rms_norm.reference`), so the largest may land a
    step above this and saturate at 448; the kernels find the scale in the pass over x that
    finds rstd, without a second pass (and a second block-wide reduction) over the row."""
    amax = (x.float() * weight.float()).abs().amax(dim=-1) * rstd.float().reshape(-1)
    return _scales(amax.to(x.dtype).float())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 values and their float32 scales [rows]: for weights (a row is an output
    feature) and for activations (a row is a token) alike."""
    scale = row_scales(x)
    return to_e4m3(x, scale[:, None]), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T with W8A8 numerics: x quantized per token here, or with the given `x_scale`: a
    static per-tensor one ([1]) or one per row ([T]); accumulated in float32; returns x's dtype."""
    if x_scale is None:
        xq, x_scale = quantize_rows(x)
    else:
        x_scale = x_scale.float().reshape(-1).expand(x.shape[0])
        xq = to_e4m3(x, x_scale[:, None])
    acc = xq.float() @ widened(wq).t()
    return (acc * x_scale[:, None] * w_scale.float()[None, :]).to(x.dtype)
