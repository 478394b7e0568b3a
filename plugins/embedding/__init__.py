"""Plugin `embedding`: token ids [T] -> hidden states [T, H]."""
from kiln.plugins.embedding.reference import embedding
from kiln.plugins.registry import register
from kiln.plugins.take_rows import row_gather

SPEC = register(row_gather("embedding", 1, __name__, ("input_ids", "weight"), "weight", "input_ids", embedding))
