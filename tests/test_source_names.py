"""Every name the sources use is defined: pyflakes over the package and the scripts.

Most of `scripts/` (the device sweeps and probes) only runs on a GPU, which CI has not got, so a
name left undefined there (a label copied from the decode sweep into the prefill one did this)
shows up on the device, costing a call. Only undefined names fail the test: an unused import is
often a fixture or a registration, and star imports are the tests' fixture modules.
"""
from __future__ import annotations

from pathlib import Path

from pyflakes import api, messages, reporter

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("bench", "builder", "engines", "models", "plugins", "runtime", "scripts", "tests")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(reporter.Reporter):
    def __init__(self):
        super().__init__(None, None)
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:
        self.found.append(f"{filename}: {msg}")


def test_no_source_uses_an_undefined_name():
    collect = _Collect()
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            api.checkPath(str(path), collect)
    assert not collect.found, "\n".join(collect.found)
