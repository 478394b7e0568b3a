"""Kiln model definitions and checkpoint loading (Hugging Face folders and GGUF files).

`load(checkpoint, dtype)` returns Kiln's PyTorch definition of the checkpoint's model, filled
with its weights; `read_chat_template` finds its chat template, `engine_files` the config and
tokenizer files an engine carries and `read_kv_scales` the FP8 KV-cache scales it may carry. This package is the only place that knows architectures and
checkpoint layouts.
"""
from kiln.models.checkpoint import engine_files, load, read_chat_template, read_config, read_kv_scales
from kiln.models.config import SUPPORTED_ARCHITECTURES, CheckpointError, ModelConfig

__all__ = ["load", "read_chat_template", "read_kv_scales", "engine_files", "SUPPORTED_ARCHITECTURES", "CheckpointError",
           "ModelConfig", "read_config"]
