"""Kiln plugins: one folder per op (spec + PyTorch reference; GPU kernels join them later).

Importing this package registers every plugin and its `kiln::<name>` torch custom op.
"""
from kiln.plugins import (add, attention, attention_o_proj, embedding, gelu, head_rms_norm, linear,  # noqa: F401
                          linear_residual, norm_qkv_rope, norm_swiglu, rms_norm, rope, silu_mul, take_rows)
from kiln.plugins.registry import PluginSpec, all_plugins, get_plugin, op
from kiln.plugins.step_inputs import STEP_INPUTS, StepInputSpec

__all__ = ["PluginSpec", "all_plugins", "get_plugin", "op", "STEP_INPUTS", "StepInputSpec"]
