"""The engine contract between `kiln.builder` and `kiln.runtime`: the `.engine` file format
(`format`) and the typed `Manifest` inside it (`manifest`); README.md documents the bytes.

The builder writes engines through this package and the runtime reads them through it; neither
imports the other. Engines you build can live in this folder too (git ignores them).
"""
