"""Kiln model definitions and Hugging Face checkpoint loading.

`load(checkpoint_dir, dtype)` returns Kiln's PyTorch definition of the checkpoint's model,
filled with its weights; `read_chat_template` finds its chat template. This package is the only
place that knows architectures and checkpoint layouts.
"""
from kiln.models.checkpoint import load, read_chat_template
from kiln.models.config import SUPPORTED_ARCHITECTURES, CheckpointError, ModelConfig, read_config

__all__ = ["load", "read_chat_template", "SUPPORTED_ARCHITECTURES", "CheckpointError", "ModelConfig", "read_config"]
