"""The engine contract between `kiln.builder` and `kiln.runtime`: the engine file format and
its manifest. Built engines land in this folder by default (ignored by git)."""
