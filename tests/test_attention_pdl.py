"""The decode attention kernels take part in programmatic dependent launch on sm_90 and later, and only
there. The ones any step takes wait for the kernel before them (`griddepcontrol.wait`) before they read
anything, then let the next one start (o_proj's GEMV, which streams its first weights meanwhile). The EARLY
ones that a step of one sequence takes (`kernels.EARLY_ROLES`, sm_90 on only) let the next kernel start
first, then read only the step's inputs and earlier steps' keys until they wait: never q, which the kernel
before writes. Checked in the PTX and in the SASS that ptxas makes of it (which may move loads: it moved the
FP8 GEMVs', session 45), each load's address walked back to the parameters it comes from. The sm_80 and
sm_89 builds, under the same launch meta, carry neither instruction, which those targets do not have."""
import pytest

from gpu_build import compiled_json
from sass import LAUNCH_DEPENDENTS, WAIT, address_params, disassemble, is_load, nvdisasm, param_offsets

from kiln.plugins.attention.kernels import EARLY_ROLES

# What an EARLY kernel may read before it waits: the step's inputs (copied in before the step's first kernel)
# and the cache, where the kernel before writes only the newest key, which it reads after.
EARLY_READS = {"context_lens_ptr", "block_tables_ptr", "k_cache_ptr", "v_cache_ptr"}

SCRIPT = """
import json, sys
from kiln.plugins.aot import TARGET_CC, compile_kernel
from kiln.plugins.attention.kernels import aot_kernels

result = []
for kernel in aot_kernels("bfloat16", {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16}):
    role = kernel.meta.get("role")
    if role not in ("decode", "decode_split", "decode_one", "decode_one_split", "combine_splits", "prefill"):
        continue
    for target in kernel.targets or TARGET_CC:
        compiled = compile_kernel(kernel, target)
        lines = [line.strip() for line in compiled.asm["ptx"].splitlines()]
        # An instruction may carry a predicate (@%p1 ld.global...).
        first = lambda op: next((i for i, line in enumerate(lines) if op in line.split("//")[0]), None)
        result.append({"role": role, "target": target, "pdl": bool(kernel.meta.get("pdl")),
                       "params": {n: t for n, t in kernel.signature.items() if t != "constexpr"},
                       "wait": first("griddepcontrol.wait"), "launch": first("griddepcontrol.launch_dependents"),
                       "read": min(i for i in (first("ld.global"), first("cp.async")) if i is not None),
                       "cubin": compiled.asm["cubin"].hex()})
sys.stdout.write(json.dumps(result))
"""


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_json(SCRIPT)


def named(k: dict) -> tuple[str, str]:
    return k["role"], k["target"]


def test_decode_kernels_wait_before_reading_on_sm90_and_later(kernels):
    decode = [k for k in kernels if k["role"] != "prefill"]
    # A bf16 cache has no combine kernel: the split kernel merges its parts.
    assert {k["role"] for k in decode} == {"decode", "decode_split", *EARLY_ROLES}
    for k in decode:
        assert k["pdl"], named(k)
        if k["role"] in EARLY_ROLES:
            assert k["target"] in ("sm_90", "sm_100"), named(k)
            assert k["launch"] is not None and k["wait"] is not None and k["launch"] < k["read"] < k["wait"], named(k)
        elif k["target"] in ("sm_90", "sm_100"):
            assert k["wait"] is not None and k["launch"] is not None and k["wait"] < k["read"], named(k)
        else:
            assert k["wait"] is None and k["launch"] is None, named(k)


@pytest.mark.skipif(nvdisasm() is None, reason="needs nvdisasm (make install puts nvidia-cuda-nvdisasm in)")
def test_decode_kernels_read_before_the_wait_only_what_no_kernel_before_writes(kernels):
    dependent = [k for k in kernels if k["role"] != "prefill" and k["target"] in ("sm_90", "sm_100")]
    assert {k["role"] for k in dependent} == {"decode", "decode_split", *EARLY_ROLES}
    for k in dependent:
        code = disassemble(bytes.fromhex(k["cubin"]))
        waits = [i for i, line in enumerate(code) if line == WAIT]
        assert len(waits) == 1 and LAUNCH_DEPENDENTS in code, named(k)
        offsets = param_offsets(k["params"], k["target"])
        pointers = {name for name, kind in k["params"].items() if kind.startswith("*")}
        reads = [address_params(code, i, offsets) if is_load(line) else set() for i, line in enumerate(code)]
        early, late = pointers & set().union(*reads[:waits[0]]), pointers & set().union(*reads[waits[0]:])
        if k["role"] in EARLY_ROLES:
            assert code.index(LAUNCH_DEPENDENTS) < waits[0], named(k)
            assert early == EARLY_READS and "q_ptr" in late, (named(k), early, late)
        else:
            assert not any(is_load(line) for line in code[:waits[0]]), named(k)
            assert {"q_ptr", "k_cache_ptr", "v_cache_ptr"} <= late, (named(k), early, late)


def test_prefill_kernels_launch_as_before(kernels):
    prefill = [k for k in kernels if k["role"] == "prefill"]
    assert prefill and all(not k["pdl"] and k["wait"] is None and k["launch"] is None for k in prefill)
