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
# Where a kernel's parameters start in constant bank 0.
PARAM_BASE = {"sm_90": 0x210, "sm_100": 0x380}


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


def param_offsets(signature: dict[str, str], target: str) -> dict[int, str]:
    """Constant-bank offset -> parameter name (8-byte pointers, 4-byte scalars, each aligned to its size)."""
    offsets, at = {}, PARAM_BASE[target]
    for name, kind in signature.items():
        size = 8 if kind.startswith("*") else 4
        at = -(-at // size) * size
        offsets[at] = name
        at += size
    return offsets


def address_params(code: list[str], i: int, offsets: dict[int, str]) -> set[str]:
    """The parameters whose values flow into the address of the load at code[i]: a walk back through the
    instructions that wrote its address registers (a 64-bit address is a register pair)."""
    found = re.search(r"desc\[[^\]]*\]\[(U?R)(\d+)", code[i])
    if found is None:
        return set()
    prefix, number = found.groups()
    wanted, params = {f"{prefix}{number}", f"{prefix}{int(number) + 1}"}, set()
    for line in reversed(code[:i]):
        op, _, operands = re.sub(r"^@!?U?P\w+\s+", "", line).partition(" ")
        parts = [p.strip() for p in operands.split(",")]
        dest = re.fullmatch(r"(U?R)(\d+)(?:\.64)?", parts[0]) if parts[0] else None
        if dest is None:
            continue
        written = {parts[0].split(".")[0]}
        if ".64" in op or "WIDE" in op:
            written.add(f"{dest.group(1)}{int(dest.group(2)) + 1}")
        if not written & wanted:
            continue
        wanted -= written
        params |= {offsets.get(int(offset, 16), offset) for offset in re.findall(r"c\[0x0\]\[(0x[0-9a-f]+)\]", operands)}
        wanted |= set(re.findall(r"\bU?R\d+\b", ",".join(parts[1:]))) - {"RZ", "URZ"}
    return params
