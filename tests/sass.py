"""Reading a cubin's machine code (SASS) in tests, with `nvdisasm` from the nvidia-cuda-nvdisasm wheel (a
test extra): where a kernel's instructions really are, which the PTX does not tell once ptxas has
scheduled it (tests/test_gemv_sass.py, tests/test_attention_pdl.py)."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

# `griddepcontrol.wait`, and `griddepcontrol.launch_dependents`, as SASS names them.
WAIT, LAUNCH_DEPENDENTS = "ACQBULK", "PREEXIT"


def nvdisasm() -> str | None:
    """The wheel's nvdisasm (under the `nvidia` namespace package), else one on the PATH."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for found in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(found)
    return shutil.which("nvdisasm")


def disassemble(binary: bytes) -> list[str]:
    """A cubin's instructions, one a line, predicates kept, without addresses."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(binary)
        text = subprocess.run([nvdisasm(), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in text.splitlines()
            if re.search(r"/\*[0-9a-f]{4}\*/", line)]


def is_load(instruction: str) -> bool:
    """A load from global memory: LDG, an asynchronous copy to shared memory (LDGSTS) or a TMA load."""
    return re.search(r"\b(LDG|LDGSTS|UTMALDG|UBLKCP)\b", instruction) is not None
