"""Driver launches of `linear`'s AOT-compiled GEMM bucket kernels, and the bucket helpers the
other GEMM plugins (linear_residual, attention_o_proj, norm_qkv_rope, norm_swiglu) share, as
their kernels share `linear.kernels`' tiles. See `plugins.driver_launch` for the launcher
contract."""
from __future__ import annotations

from functools import lru_cache

import torch

from kiln.plugins.driver_launch import check_aligned, grid
from kiln.plugins.linear import cute_gemm, fp8
from kiln.plugins.linear.gemv import address
from kiln.runtime.cuda_driver import encode_tensor_map


@lru_cache(maxsize=4096)
def tensor_map(address: int, element: str, shape: tuple[int, int], box: tuple[int, int]) -> bytes:
    """`cuda_driver.encode_tensor_map`, remembered: the engine's buffers never move, so a CuTe GEMM's
    operands repeat from step to step (a weight's always, x's once per row count)."""
    return encode_tensor_map(address, element, shape, box)


def map_rows(x: torch.Tensor, block_m: int) -> int:
    """Rows of a CuTe GEMM's TMA descriptor of x [T, K]: T rounded up to whole block_m-row tiles where x's
    buffer holds them (the engine's activation buffers are sized for the most tokens a step takes), else
    T. TMA fills a box's rows past the descriptor with zeros, and on an H200 (session 33) the 64-column
    GEMM took 32.4 us for o_proj at T = 160 against 16.8 at T = 256. Rows past T read whatever the
    buffer holds: a row's sums depend on its own x alone, and the kernel stores none of theirs."""
    rows, k = x.shape
    held = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    return max(rows, min(-(-rows // block_m) * block_m, held // k))


def pick_bucket(metas: list[dict], rows: int) -> int:
    """Index of the GEMM shape bucket serving `rows` rows: the first whose max_rows admits
    them, as `plugins.linear.tiles.pick_tile` chooses (buckets are in TILES order)."""
    for i, meta in enumerate(metas):
        if "bucket" in meta and (meta["max_rows"] is None or rows <= meta["max_rows"]):
            return i
    raise ValueError(f"no GEMM bucket serves {rows} rows among {[m.get('bucket') for m in metas]}")


def split_args(meta: dict, scratch: dict[str, torch.Tensor]) -> list[int]:
    """The split-K workspace pointers a GEMM bucket kernel takes after its output (none when
    it does not split K). The executor sizes these scratch buffers from the metas' "scratch"
    and allocates them zeroed, as the arrival counts need."""
    if meta.get("split_k", 1) == 1:
        return []
    return [scratch["gemm_split_part"].data_ptr(), scratch["gemm_split_count"].data_ptr()]


def row_scale_bytes(limits: dict[str, int]) -> dict[str, int]:
    """The fused norm GEMMs' row scales: one fp32 per row (`linear.tma.row_scale_kernel`)."""
    return {"row_scale": limits["T"] * 4}


def launch_row_scale(kernels: list, metas: list[dict], x: torch.Tensor, eps: float, stream: int,
                     scratch: dict[str, torch.Tensor]) -> int:
    """Run the row-scale pre-pass of a TMA norm GEMM over x's rows; returns the scales' address."""
    i = next(i for i, meta in enumerate(metas) if meta.get("row_scale"))
    scales = scratch["row_scale"]
    rows = x.shape[0]
    kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), [x.data_ptr(), scales.data_ptr(), rows, eps], stream)
    return scales.data_ptr()


def check_fp8(meta: dict, w_scale: torch.Tensor | None) -> None:
    """A GEMM bucket kernel built for FP8 weights gets their scales, and one built without gets none."""
    if ("fp8" in meta) != (w_scale is not None):
        raise ValueError(f"GEMM kernel built {'with' if 'fp8' in meta else 'without'} FP8 weights, given "
                         f"{'no ' if w_scale is None else ''}weight scales: the engine's kernels and weights "
                         "disagree; rebuild the engine")


def check_static(meta: dict, x_static: torch.Tensor | None, what: str) -> None:
    """A kernel built to divide by a static activation scale gets one, and one built without gets none."""
    if ("static" in meta) != (x_static is not None):
        raise ValueError(f"{what} built {'with' if 'static' in meta else 'without'} a static activation scale, given "
                         f"{'none' if x_static is None else 'one'}: the engine's kernels and weights disagree; "
                         "rebuild the engine")


def gemv_scale_args(meta: dict, w_scale: torch.Tensor | None, x_static: torch.Tensor | None) -> list[int]:
    """A GEMV's scale parameters, which only its FP8 entry points take (after the weight): the weight's
    scales, then the static activation scale (0 for an entry built without one, `check_static`)."""
    if w_scale is None:
        return []
    check_static(meta, x_static, "FP8 GEMV")
    return [w_scale.data_ptr(), address(x_static)]


def gemv_input(meta: dict, x: torch.Tensor, scratch: dict[str, torch.Tensor], handoff: bool) -> int:
    """A linear GEMV's x operand: x, or for one built to read x prestaged (meta "prestaged", `linear.gemv`) the
    row x's producer staged in the handoff's scratch, which it writes only where the plan hands x on."""
    if not meta.get("prestaged"):
        return x.data_ptr()
    if not handoff:
        raise ValueError("FP8 GEMV built to read x staged by the kernel before, in a plan that does not hand x "
                         "on: the engine's kernels and plan disagree; rebuild the engine")
    return scratch[fp8.HANDOFF[0]].data_ptr()


def launch_quantize(kernels: list, metas: list[dict], x: torch.Tensor, norm_weight: torch.Tensor | None,
                    eps: float, stream: int, scratch: dict[str, torch.Tensor],
                    x_static: torch.Tensor | None = None) -> tuple[int, int]:
    """Run an FP8 plugin's quantize pre-pass (`linear.fp8`) over x's rows, with the static activation
    scale x_static if the engine has one; returns the addresses of the e4m3 rows and of their scales,
    in the scratch buffers its meta names."""
    i = next(i for i, meta in enumerate(metas) if meta.get("quantize"))
    check_static(metas[i], x_static, "FP8 pre-pass")
    rows = x.shape[0]
    check_aligned(metas[i], x, norm_weight, x_static)
    args = [x.data_ptr()] + ([norm_weight.data_ptr()] if norm_weight is not None else [])
    args += [scratch["fp8_x"].data_ptr(), scratch["fp8_x_scale"].data_ptr()]
    args += [x_static.data_ptr()] if x_static is not None else []
    kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), args + [rows, eps], stream)
    return scratch["fp8_x"].data_ptr(), scratch["fp8_x_scale"].data_ptr()


def gemm_input_args(kernels: list, metas: list[dict], i: int, x: torch.Tensor, norm_weight: torch.Tensor | None,
                    eps: float, stream: int, scratch: dict[str, torch.Tensor],
                    x_static: torch.Tensor | None = None, handoff: bool = False) -> list[int]:
    """The x operand pointers of GEMM bucket kernel i: x, or for an FP8 kernel the quantize
    pre-pass's e4m3 rows and their scales (run here first), or with `handoff` the ones x's
    producer wrote for it (`linear.fp8`'s handoff)."""
    if metas[i].get("fp8") and handoff:
        return [scratch[name].data_ptr() for name in fp8.HANDOFF]
    if metas[i].get("fp8"):
        return list(launch_quantize(kernels, metas, x, norm_weight, eps, stream, scratch, x_static))
    return [x.data_ptr()]


def norm_gemm_input_args(kernels: list, metas: list[dict], i: int, x: torch.Tensor,
                         norm_weight: torch.Tensor | None, eps: float, stream: int,
                         scratch: dict[str, torch.Tensor], x_static: torch.Tensor | None = None) -> list[int]:
    """The x operand pointers of a fused norm GEMM's bucket kernel i: for FP8 the quantize
    pre-pass's e4m3 rows and scales (the norm applied; x_static: the static activation scale, if
    any); else x, the row-scale pre-pass's scales where the kernel reads them (TMA buckets, meta
    "row_scale_input"), and an unfolded norm weight where the kernel applies it (a TMA bucket's is
    always folded). Pre-passes run here."""
    meta = metas[i]
    if meta.get("fp8"):
        return gemm_input_args(kernels, metas, i, x, norm_weight, eps, stream, scratch, x_static)
    args = [x.data_ptr()]
    if meta.get("tma") or meta.get("row_scale_input"):
        args.append(launch_row_scale(kernels, metas, x, eps, stream, scratch))
    if norm_weight is not None and not meta.get("tma"):
        args.append(norm_weight.data_ptr())
    return args


def launch_gemm(kernels: list, metas: list[dict], x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor,
                stream: int, scratch: dict[str, torch.Tensor], w_scale: torch.Tensor | None = None,
                x_static: torch.Tensor | None = None, handoff: bool = False) -> None:
    """out = x weight^T (+ bias) (+ residual) with the bucket kernel for x's row count, W8A8 when
    the kernels were built for FP8 (w_scale: the weight's scales; x_static: the static activation
    scale, for kernels built with one; `handoff`: x's producer hands x on to this op, `linear.fp8`:
    the Triton GEMMs read its e4m3 rows at HANDOFF_ROWS rows, the GEMV built for it, meta "prestaged",
    the row it staged). `linear_kernel` takes bias
    and residual pointers only when built with them; the GEMVs and the CuTe GEMM always (0 when
    absent), the CuTe GEMM x and the weight as TMA descriptors (and its split-K workspace when it
    splits K)."""
    rows = x.shape[0]
    i = pick_bucket(metas, rows)
    check_fp8(metas[i], w_scale)
    check_aligned(metas[i], x, weight, w_scale, bias, residual, out)
    if metas[i].get("gemv"):
        args = [gemv_input(metas[i], x, scratch, handoff), weight.data_ptr(),
                *gemv_scale_args(metas[i], w_scale, x_static), address(bias), address(residual), out.data_ptr(),
                *weight.shape]
        kernels[i].launch(grid(metas[i]["grid"], {}), args, stream)
        return
    if metas[i].get("cute"):
        n, k = weight.shape
        block_m = metas[i]["block_m"]
        args = [tensor_map(x.data_ptr(), "bf16", (map_rows(x, block_m), k), (block_m, cute_gemm.k_tile())),
                tensor_map(weight.data_ptr(), "bf16", (n, k), (metas[i]["block_n"], cute_gemm.k_tile())),
                address(bias), address(residual), out.data_ptr(), *split_args(metas[i], scratch), rows, n, k]
        kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), args, stream)
        return
    args = gemm_input_args(kernels, metas, i, x, None, 0.0, stream, scratch, x_static,
                           handoff and fp8.handoff_rows(rows)) + [weight.data_ptr()]
    args += [t.data_ptr() for t in (w_scale, bias, residual) if t is not None]
    args += [out.data_ptr(), *split_args(metas[i], scratch), rows]
    kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), args, stream)


def launch_cute_qkv(kernel, grid: tuple[int, int, int], block_m: int, pairs: int, x: torch.Tensor,
                    w_qkv: torch.Tensor, row_scale: int, b_qkv: torch.Tensor | None, positions: torch.Tensor,
                    rope: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, layer: int,
                    heads: int, kv_heads: int, stream: int) -> None:
    """The CuTe qkv GEMM (`cute_gemm.qkv` at tiles of `block_m` rows and `pairs` rotary pairs) on `grid`: x
    and w_qkv as TMA descriptors (x over whole tiles where its buffer holds them), then the address of x's
    row scales, bias (0 when absent), positions, rope, the bf16 cache [layers, 2, blocks, block size, kv
    heads, head_dim], slots, q out and the sizes."""
    rows, k = x.shape
    args = [tensor_map(x.data_ptr(), "bf16", (map_rows(x, block_m), k), (block_m, cute_gemm.k_tile())),
            tensor_map(w_qkv.data_ptr(), "bf16", tuple(w_qkv.shape),
                       (cute_gemm.qkv_box(pairs, kv_cache.shape[-1]), cute_gemm.k_tile())),
            row_scale, address(b_qkv), positions.data_ptr(), rope.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(),
            out.data_ptr(), rows, kv_cache.shape[2] * kv_cache.shape[3], layer, heads, kv_heads, k]
    kernel.launch(grid, args, stream)


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs: x [T, K], weight [N, K], bias [N] or None, then weight_scale [N] (FP8) and
    weight_input_scale (a static activation scale) when given. Summing partials over ranks
    (`all_reduce`) is the executor's business."""
    x, weight, bias, w_scale, x_static = (*inputs, None, None)[:5]
    launch_gemm(kernels, metas, x, weight, bias, None, out, stream, scratch, w_scale, x_static)
