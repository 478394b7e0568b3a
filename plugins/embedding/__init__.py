"""Plugin `embedding`: token ids [T] -> hidden states [T, H]."""
from kiln.plugins.embedding.reference import embedding
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="embedding", version=1, package=__name__,
    inputs=("input_ids", "weight"), attrs={},
    shape=lambda s, a: (s["input_ids"][0], s["weight"][1]),
    dtype="weight", reference=embedding,
    # What kernels.aot_kernels needs: the row width.
    compile_shapes=lambda s, a, block_size: {"hidden": s["weight"][1]},
))
