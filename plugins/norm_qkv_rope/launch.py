"""Driver launch of `norm_qkv_rope`'s AOT kernels, one per GEMM shape bucket: q to the output,
k and v straight into the KV cache. See `plugins.driver_launch` for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.attention.kernels import padded
from kiln.plugins.driver_launch import check_aligned, grid
from kiln.plugins.linear.gemv import address
from kiln.plugins.linear.launch import (check_fp8, gemv_scale_args, launch_cute_qkv, launch_row_scale,
                                        norm_gemm_input_args, pick_bucket, row_scale_bytes, split_args)


def scratch_bytes(attrs: dict, limits: dict[str, int]) -> dict[str, int]:
    return row_scale_bytes(limits)


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs in the spec's order: x, norm_weight?, w_qkv, b_qkv?, q_norm?, k_norm?, positions,
    rope_cache (fp32), kv_cache (written in place), slot_mapping, kv_scales? (an e4m3 cache's
    [layers, 2, kv heads]), then w_qkv_scale (FP8) and w_qkv_input_scale (a static activation scale)
    when given. The kernels take the optional pointers only when they were built with them (absent
    ones are constexpr None); an FP8 Triton bucket reads e4m3 rows from the quantize pre-pass,
    which applies the norm weight, and the FP8 GEMV (gemv1) quantizes x itself. The CuTe qkv GEMM takes
    x and w_qkv as TMA descriptors and the row-scale pre-pass's scales."""
    x, norm_weight, w_qkv, b_qkv, q_norm, k_norm, positions, rope_cache, kv_cache, slot_mapping, kv_scales, \
        w_scale, x_static = padded(inputs, 13)
    if (q_norm is None) != (k_norm is None):
        # The kernel was built for both or neither; one alone has no kernel to match it.
        raise ValueError("norm_qkv_rope needs both q_norm and k_norm, or neither")
    if not kv_cache.is_contiguous():
        raise ValueError("norm_qkv_rope's kernel writes a contiguous KV cache")
    rows = x.shape[0]
    i = pick_bucket(metas, rows)
    check_fp8(metas[i], w_scale)
    # Weights and step inputs are whole arena regions (256-byte aligned); activations may be views.
    check_aligned(metas[i], x, kv_cache, out)
    num_slots = kv_cache.shape[2] * kv_cache.shape[3]
    if metas[i].get("gemv"):
        meta = metas[i]
        args = [x.data_ptr(), address(norm_weight), w_qkv.data_ptr(), *gemv_scale_args(meta, w_scale, x_static),
                address(b_qkv),
                positions.data_ptr(), rope_cache.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr(),
                *([kv_scales.data_ptr(), kv_cache.shape[3]] if meta.get("fp8_kv") else []), out.data_ptr(), num_slots,
                attrs["layer"],
                attrs["eps"], meta["heads"], meta["kv_heads"], meta["head_dim"], x.shape[1]]
        kernels[i].launch(grid(meta["grid"], {}), args, stream)
        return
    if metas[i].get("cute"):
        launch_cute_qkv(kernels[i], grid(metas[i]["grid"], {"T": rows}), metas[i]["block_m"], metas[i]["pairs"], x,
                        w_qkv, launch_row_scale(kernels, metas, x, attrs["eps"], stream, scratch), b_qkv, positions,
                        rope_cache, kv_cache, slot_mapping, out, attrs["layer"], attrs["num_heads"],
                        attrs["num_kv_heads"], stream)
        return
    args = norm_gemm_input_args(kernels, metas, i, x, norm_weight, attrs["eps"], stream, scratch, x_static)
    args += [t.data_ptr() for t in (w_qkv, w_scale, b_qkv, q_norm, k_norm) if t is not None]
    args += [positions.data_ptr(), rope_cache.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr()]
    args += [kv_scales.data_ptr()] if kv_scales is not None else []
    args += [out.data_ptr(), *split_args(metas[i], scratch), rows, num_slots, attrs["layer"], attrs["eps"]]
    kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), args, stream)
