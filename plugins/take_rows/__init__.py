"""Plugin `take_rows`: [T, H] and row indices [L] -> [L, H] (last token of each sequence).

`embedding` is the same gather over its token table, so its spec is made by `row_gather` too.
"""
from kiln.plugins.registry import PluginSpec, register
from kiln.plugins.take_rows.reference import take_rows


def row_gather(name: str, version: int, package: str, inputs: tuple[str, str], table: str, indices: str,
               reference, attrs: dict[str, type] | None = None) -> PluginSpec:
    """The spec of an op that gathers rows of `table` [N, H] at `indices` [R]: [R, H] in the
    table's dtype, run by this folder's `gather_rows` kernel."""
    return PluginSpec(
        name=name, version=version, package=package, inputs=inputs, attrs=attrs or {},
        shape=lambda s, a: (s[indices][0], s[table][1]),
        dtype=table, reference=reference,
        # What kernels.aot_kernels needs: the row width.
        compile_shapes=lambda s, a, block_size: {"hidden": s[table][1]},
    )


SPEC = register(row_gather("take_rows", 1, __name__, ("x", "indices"), "x", "indices", take_rows))
