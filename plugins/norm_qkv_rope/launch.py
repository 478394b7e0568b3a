"""Driver launch of `norm_qkv_rope`'s AOT kernels, one per GEMM shape bucket: q to the output,
k and v straight into the KV cache. See `plugins.driver_launch` for the launcher contract."""
from __future__ import annotations

import torch

from kiln.plugins.attention.kernels import padded
from kiln.plugins.driver_launch import check_aligned, grid
from kiln.plugins.linear.launch import launch_row_scale, pick_bucket, row_scale_bytes, split_args


def scratch_bytes(attrs: dict, limits: dict[str, int]) -> dict[str, int]:
    return row_scale_bytes(limits)


def launch(kernels: list, metas: list[dict], inputs: list, attrs: dict, out: torch.Tensor,
           dims: dict[str, int], stream: int, scratch: dict[str, torch.Tensor]) -> None:
    """inputs in the spec's order: x, norm_weight?, w_qkv, b_qkv?, q_norm?, k_norm?, positions,
    rope_cache (fp32), kv_cache (written in place), slot_mapping, kv_scales? (an e4m3 cache's
    [layers, 2, kv heads]). The kernels take the optional
    pointers only when they were built with them (absent ones are constexpr None)."""
    x, norm_weight, w_qkv, b_qkv, q_norm, k_norm, positions, rope_cache, kv_cache, slot_mapping, kv_scales = \
        padded(inputs, 11)[:11]
    if (q_norm is None) != (k_norm is None):
        # The kernel was built for both or neither; one alone has no kernel to match it.
        raise ValueError("norm_qkv_rope needs both q_norm and k_norm, or neither")
    if not kv_cache.is_contiguous():
        raise ValueError("norm_qkv_rope's kernel writes a contiguous KV cache")
    rows = x.shape[0]
    i = pick_bucket(metas, rows)
    # Weights and step inputs are whole arena regions (256-byte aligned); activations may be views.
    check_aligned(metas[i], x, kv_cache, out)
    args = [x.data_ptr()]
    if metas[i].get("tma"):  # the norm weight is folded; the row scales come from a pre-pass
        args += [launch_row_scale(kernels, metas, x, attrs["eps"], stream, scratch)]
    args += [norm_weight.data_ptr()] if norm_weight is not None else []
    args += [w_qkv.data_ptr()]
    args += [t.data_ptr() for t in (b_qkv, q_norm, k_norm) if t is not None]
    args += [positions.data_ptr(), rope_cache.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr()]
    args += [kv_scales.data_ptr()] if kv_scales is not None else []
    args += [out.data_ptr(), *split_args(metas[i], scratch), rows, kv_cache.shape[2] * kv_cache.shape[3],
             attrs["layer"], attrs["eps"]]
    kernels[i].launch(grid(metas[i]["grid"], {"T": rows}), args, stream)
