"""AOT kernels are told which pointers are 16-byte aligned (`AotKernel.aligned`), and it shows in
their PTX: the decode attention streams K and V with 16-byte loads (one pipeline stage: plain vector
loads) and the GEMMs their tiles with 16-byte asynchronous copies. Compiled without that promise, the
same attention kernel reads K and V with 2-byte scalar loads (as engines built before it did): the
difference this test guards."""
import pytest

from gpu_build import compiled_json

SCRIPT = """
import dataclasses, json, re, sys
from kiln.plugins.aot import compile_kernel
from kiln.plugins.attention.kernels import aot_kernels as attention
from kiln.plugins.linear_residual.kernels import aot_kernels as linear_residual
from kiln.plugins.norm_swiglu.kernels import aot_kernels as norm_swiglu

def loads(kernel):
    ptx = compile_kernel(kernel, "sm_90").asm["ptx"]
    return {"async16": len(re.findall(r"cp\\.async\\.\\w+\\.shared\\.global \\[[^]]*\\], \\[[^]]*\\], 0x10", ptx)),
            "vector16": len(re.findall(r"ld\\.global(?:\\.nc)?\\.v4\\.b32", ptx)),
            "scalar16": len(re.findall(r"ld\\.global\\.b16", ptx))}

decode = next(k for k in attention("bfloat16", {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16})
              if k.meta.get("role") == "decode")
gemms = linear_residual("bfloat16", {"K": 4096, "N": 4096}) + norm_swiglu("bfloat16", {"K": 4096, "I": 14336, "block": 0})
sys.stdout.write(json.dumps({
    "attention": loads(decode),
    "attention_unaligned": loads(dataclasses.replace(decode, aligned=())),
    "gemms": [loads(k) for k in gemms if k.meta.get("bucket") in ("decode", "small")],
}))
"""


@pytest.fixture(scope="module")
def ptx_loads() -> dict:
    return compiled_json(SCRIPT)


def test_decode_attention_streams_kv_with_16_byte_loads(ptx_loads):
    # What scalar loads remain read q, whose row stride the kernel is not promised.
    assert ptx_loads["attention"]["async16"] + ptx_loads["attention"]["vector16"] > 0
    assert ptx_loads["attention"]["scalar16"] <= 16


def test_without_the_promise_attention_loads_2_bytes_at_a_time(ptx_loads):
    assert ptx_loads["attention_unaligned"]["async16"] == ptx_loads["attention_unaligned"]["vector16"] == 0
    assert ptx_loads["attention_unaligned"]["scalar16"] > 8 * ptx_loads["attention"]["scalar16"]


def test_decode_gemms_stream_weights_with_16_byte_copies(ptx_loads):
    assert ptx_loads["gemms"] and all(g["async16"] > 0 and g["scalar16"] == 0 for g in ptx_loads["gemms"]), \
        ptx_loads["gemms"]
