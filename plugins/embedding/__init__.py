"""Plugin `embedding`: token ids [T] -> hidden states [T, H], each row times `scale` (Gemma's
sqrt(hidden_size), already rounded to the table's dtype; 1.0 elsewhere)."""
from kiln.plugins.embedding.reference import embedding
from kiln.plugins.registry import register
from kiln.plugins.take_rows import row_gather

SPEC = register(row_gather("embedding", 2, __name__, ("input_ids", "weight"), "weight", "input_ids", embedding,
                          {"scale": float}))
