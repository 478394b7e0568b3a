"""Graph -> graph passes of the builder, in the order the build runs them."""
from kiln.builder.passes.fold import fold_weights
from kiln.builder.passes.kv_cache import KVScalesError, quantize_kv_cache
from kiln.builder.passes.fusion import (FUSIONS, fuse_attention_o_proj, fuse_linear_residual, fuse_norm_qkv_rope,
                                        fuse_norm_swiglu)
from kiln.builder.passes.memory import plan_memory
from kiln.builder.passes.shard import ShardError, shard, vocab_parallel

__all__ = ["FUSIONS", "fuse_norm_qkv_rope", "fuse_attention_o_proj", "fuse_norm_swiglu", "fuse_linear_residual",
           "quantize_kv_cache", "KVScalesError", "fold_weights", "shard", "ShardError", "vocab_parallel",
           "plan_memory"]
