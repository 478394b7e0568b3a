"""Kiln plugins: one folder per op (spec, PyTorch reference, GPU kernels and their launcher).

Importing this package registers every built-in plugin (`registry.BUILTIN`) and its
`kiln::<name>` torch custom op.
"""
import importlib

from kiln.plugins.registry import BUILTIN, PluginSpec, all_plugins, get_plugin, op
from kiln.plugins.step_inputs import STEP_INPUTS, StepInputSpec

for _name in BUILTIN:
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["PluginSpec", "all_plugins", "get_plugin", "op", "STEP_INPUTS", "StepInputSpec"]
