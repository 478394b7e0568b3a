"""PyTorch reference for `linear`: y = x W^T (+ b), optionally all-reduced across TP ranks (row
parallel) or gathered from them (the vocabulary-parallel LM head: `all_gather_columns`, which the
CUDA executor calls too); and `project`, the one GEMM every projection's reference runs: in the
model dtype (on a CPU accumulated in float32 and rounded once, as a GPU does: `plugins.wide`), or
W8A8 with `plugins.fp8`'s numerics when the weight is float8_e4m3fn with its per-output-feature scale;
and `project_normed`, the same after an RMSNorm, as the norm plugins' references run it."""
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from kiln.plugins.fp8 import fp8_linear, normed_row_scales, row_scales
from kiln.plugins.rms_norm.reference import rms_norm, rstd
from kiln.plugins.wide import widened


# Calibration (builder/calibrate.py) watches what every GEMM multiplies, through this one function.
_GEMM_INPUT_OBSERVERS: list[Callable[[torch.Tensor], None]] = []


@contextmanager
def observing_gemm_inputs(observe: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `observe(x)` with the input of every projection a reference runs, while inside."""
    _GEMM_INPUT_OBSERVERS.append(observe)
    try:
        yield
    finally:
        _GEMM_INPUT_OBSERVERS.remove(observe)


def project(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
            bias: Optional[torch.Tensor] = None, input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x W^T (+ b). With `weight_scale` the weight is e4m3 and x is quantized per token, or with
    `input_scale` when given: static per tensor ([1]) or per row ([T])."""
    for observe in _GEMM_INPUT_OBSERVERS:
        observe(x)
    if weight_scale is None and x.device.type == "cpu":
        wide_bias = None if bias is None else bias.float()
        return torch.nn.functional.linear(x.float(), widened(weight), wide_bias).to(x.dtype)
    if weight_scale is None:
        return torch.nn.functional.linear(x, weight, bias)
    y = fp8_linear(x, weight, weight_scale, input_scale)
    return y + bias if bias is not None else y


def normed_input_scales(x: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """The per-token e4m3 scales of the rows rms_norm(x, norm_weight, eps) as the fused FP8
    kernels find them: of the normalized rows themselves where the norm weight is folded (None),
    else `plugins.fp8.normed_row_scales`."""
    if norm_weight is None:
        return row_scales(rms_norm(x, None, eps))
    return normed_row_scales(x, norm_weight, rstd(x, eps))


def project_normed(x: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float, weight: torch.Tensor,
                   weight_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None,
                   input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """project(rms_norm(x, norm_weight, eps), ...), an FP8 one quantizing per token with the
    fused kernels' scales (`normed_input_scales`)."""
    if weight_scale is not None and input_scale is None and norm_weight is not None:
        input_scale = normed_input_scales(x, norm_weight, eps)
    return project(rms_norm(x, norm_weight, eps), weight, weight_scale, bias, input_scale)


def all_reduce_if(y: torch.Tensor, all_reduce: bool) -> torch.Tensor:
    """Sum partial results of a row-parallel projection over the tensor-parallel group."""
    if all_reduce and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(y)
    return y


def all_gather_columns(part: torch.Tensor, gathered: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Every rank's column slice `part` [T, N], side by side in rank order in `out` [T, ranks * N]:
    gathered rank after rank into `gathered` [ranks * T, N] (the layout every backend gathers
    into without a copy), then put in place by one transposing copy. Returns `out`."""
    rows, width = part.shape
    ranks = out.shape[1] // width
    # torch 2.13 renamed all_gather_into_tensor (deprecating the old name); older torch has only that.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, part)
    out.view(rows, ranks, width).copy_(gathered.view(ranks, rows, width).transpose(0, 1))
    return out


def all_gather_if(y: torch.Tensor, ranks: int) -> torch.Tensor:
    """The whole output of a vocabulary-parallel projection (`ranks` > 1): every rank's slice."""
    if ranks <= 1:
        return y
    rows, width = y.shape
    return all_gather_columns(y, y.new_empty(ranks * rows, width), y.new_empty(rows, ranks * width))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           parallel: str, heads: int, all_reduce: bool, weight_scale: Optional[torch.Tensor] = None,
           weight_input_scale: Optional[torch.Tensor] = None, all_gather: int = 0) -> torch.Tensor:
    y = all_reduce_if(project(x, weight, weight_scale, input_scale=weight_input_scale), all_reduce)
    # The bias goes after the reduction so that it is added once, not once per rank.
    y = y + bias if bias is not None else y
    return all_gather_if(y, all_gather)
