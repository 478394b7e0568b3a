"""Plugin `embedding`: token ids [T] -> hidden states [T, H]."""
from kiln.plugins.embedding.reference import embedding
from kiln.plugins.registry import PluginSpec, register

SPEC = register(PluginSpec(
    name="embedding", version=1,
    inputs=("input_ids", "weight"), attrs={},
    shape=lambda s, a: (s["input_ids"][0], s["weight"][1]),
    dtype="weight", reference=embedding,
))
