"""Kiln model definitions and Hugging Face checkpoint loading.

`load(checkpoint_dir, dtype)` returns Kiln's PyTorch definition of the checkpoint's model,
filled with its weights. This package is the only place that knows architectures.
"""
from kiln.models.checkpoint import load
from kiln.models.config import SUPPORTED_ARCHITECTURES, CheckpointError, ModelConfig, read_config

__all__ = ["load", "SUPPORTED_ARCHITECTURES", "CheckpointError", "ModelConfig", "read_config"]
