"""FP8 weights (W8A8) on the GPU (`pytest -m gpu -rP`): a small float32 engine built with
--quantization fp8 (and once more with the FP8 KV cache too) for the CPU and this GPU, 16
prompts x 64 greedy tokens in flight on each, then both executors teacher-forced on the CPU's
tokens, their argmax compared position by position. The CPU executor runs the plugins' W8A8
references (`plugins/fp8.py`); the GPU kernels quantize the same GEMM inputs per token but sum
RMSNorm's squares and the products in another order, so a value next to an e4m3 rounding
boundary can land one step away: the logits are compared within 1e-2 and the argmax must agree
on 98% of the positions, as for the FP8 KV cache (test_fp8_kv_gpu). The figures are printed
(and appended to KILN_GPU_RESULTS)."""
from __future__ import annotations

from statistics import median

import pytest

from kiln.plugins.fp8 import FP8_TARGETS
from parity_tools import (argmax_agreement, cached_checkpoint, cached_engine, gpu_and_cpu_runs, make_prompts,
                          publish, relative_errors, report)
from test_gpu_parity import BUILD, SMALL, arch, gpu_workdir  # noqa: F401 (fixtures)

FP8_REL_ERR, FP8_AGREEMENT = 1e-2, 0.98


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", ["auto", "fp8"])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_fp8_gpu_engine_matches_its_cpu_reference(family, kv_cache, gpu_workdir, arch, record_property):  # noqa: F811
    if arch not in FP8_TARGETS:
        pytest.skip(f"{arch} has no FP8 tensor cores (FP8 engines are built for {', '.join(FP8_TARGETS)})")
    checkpoint = cached_checkpoint(gpu_workdir, family, **SMALL)
    engine = cached_engine(gpu_workdir, checkpoint, ["cpu", arch], "float32", **BUILD,
                           extra=("--quantization", "fp8", "--kv-cache-dtype", kv_cache))
    prompts = make_prompts(SMALL["vocab_size"])
    tokens, logits = gpu_and_cpu_runs(engine, prompts)
    errors = relative_errors(logits["cuda"], logits["cpu"])
    # On the same (CPU's) tokens: a free-running GPU sequence that took the other side of one
    # near-tie would count every later position as a disagreement (see test_fp8_kv_gpu).
    gpu_argmax = [step_logits.argmax(dim=1).tolist() for step_logits in logits["cuda"]]
    agreement = argmax_agreement(gpu_argmax, logits["cpu"])
    line = report(f"{family} small float32, fp8 weights, {kv_cache} KV cache, cuda vs cpu", tokens["cuda"],
                  agreement, errors)
    publish(line, record_property)
    assert agreement[0] >= FP8_AGREEMENT, line
    assert median(errors) <= FP8_REL_ERR, line
