"""The decode attention kernels take part in programmatic dependent launch on sm_90 and later, and only
there: their PTX waits for the kernel before them (`griddepcontrol.wait`) before it reads anything, and
lets the next one start (o_proj's GEMV, which streams its first weights meanwhile). The sm_80 and sm_89
builds, under the same launch meta, carry neither instruction, which those targets do not have."""
import pytest

from gpu_build import compiled_json

SCRIPT = """
import json, sys
from kiln.plugins.aot import TARGET_CC, compile_kernel
from kiln.plugins.attention.kernels import aot_kernels

result = []
for kernel in aot_kernels("bfloat16", {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16}):
    role = kernel.meta.get("role")
    if role not in ("decode", "decode_split", "combine_splits", "prefill"):
        continue
    for target in kernel.targets or TARGET_CC:
        lines = [line.strip() for line in compile_kernel(kernel, target).asm["ptx"].splitlines()]
        # An instruction may carry a predicate (@%p1 ld.global...).
        first = lambda op: next((i for i, line in enumerate(lines) if op in line.split("//")[0]), None)
        result.append({"role": role, "target": target, "pdl": bool(kernel.meta.get("pdl")),
                       "wait": first("griddepcontrol.wait"), "launch": first("griddepcontrol.launch_dependents"),
                       "read": min(i for i in (first("ld.global"), first("cp.async")) if i is not None)})
sys.stdout.write(json.dumps(result))
"""


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_json(SCRIPT)


def test_decode_kernels_wait_before_reading_on_sm90_and_later(kernels):
    decode = [k for k in kernels if k["role"] != "prefill"]
    assert {k["role"] for k in decode} == {"decode", "decode_split", "combine_splits"}
    for k in decode:
        assert k["pdl"], k
        if k["target"] in ("sm_90", "sm_100"):
            assert k["wait"] is not None and k["launch"] is not None and k["wait"] < k["read"], k
        else:
            assert k["wait"] is None and k["launch"] is None, k


def test_prefill_kernels_launch_as_before(kernels):
    prefill = [k for k in kernels if k["role"] == "prefill"]
    assert prefill and all(not k["pdl"] and k["wait"] is None and k["launch"] is None for k in prefill)
