"""Kiln installs under one namespace: `kiln.runtime`, `kiln.models`, ... and nothing at the top
level that could shadow a user's own `runtime` or `models` package."""
from __future__ import annotations

import subprocess
import sys


def test_kiln_is_the_only_top_level_name(tmp_path):
    # A fresh interpreter in an empty folder: nothing from the checkout's root is on sys.path.
    script = "\n".join([
        "from kiln import Session, SamplingParams",
        "assert Session.__module__ == 'kiln.runtime.session' and SamplingParams(max_tokens=2).max_tokens == 2",
        "for name in ('runtime', 'models', 'builder', 'plugins', 'engines', 'bench'):",
        "    try:",
        "        __import__(name)",
        "    except ModuleNotFoundError:",
        "        continue",
        "    raise SystemExit(f'import {name} worked: Kiln put {name!r} at the top level')",
    ])
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
