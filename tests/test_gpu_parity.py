"""Greedy parity of the GPU engine: issue 4's acceptance (GPU only: `pytest -m gpu -rP`).

On the GPU, 16 prompts of 8 to 100 random token ids go to one `Session(engine,
device="cuda")` together, 64 greedy tokens each, so prefill chunks, mixed steps and decode
batches all run in flight. Then each prompt with its 64 tokens is fed teacher-forced to the
reference, and to the engine's executor as prefill chunks asking every logit: an early flip
cannot cascade, each of the 64 positions is compared on its own.

- bf16 engine against transformers on the GPU (small llama3, qwen3 and gemma3 models, and the
  Llama-3-8B shape): the issue's figures (share of the 16 x 64 positions where Kiln's token is
  an argmax of transformers bf16's logits, relative L2 error of each sequence's [64, vocab]
  logits) are measured and printed; the assertion is that Kiln is as close to the float32
  computation as transformers' own bf16 run is (see `check_bf16_parity` for why).
- float32 engine on the GPU against the same engine on the CPU (small llama3 and gemma3):
  identical greedy tokens and logits within 1e-4 (test_cuda_executor.py checks single steps and 2 prompts x 8 tokens;
  this is 16 requests in flight for 64 tokens).
- an engine built only for another GPU is refused with a message naming its targets and the
  --target to rebuild with.

"Is an argmax" counts exact ties in the reference's logits (bf16 logits over a 128k vocabulary
tie at the top now and then) as agreeing with either tied token; the summary also gives the
share equal to the reference's first argmax. Each test prints a one-line summary (seen with
-rP), records it as a JUnit property, and appends it to the file KILN_GPU_RESULTS names, if
set. The summary also holds figures no assertion uses: transformers bf16 against transformers
float32 on the same weights (the noise floor of any bf16 run), Kiln against float32, and Kiln's
prefill logits against its own decode-time choices.

KILN_GPU_WORKDIR names a folder that keeps checkpoints, engines and compiled kernels between
runs (the 8B checkpoint and engine are 16 GB each and take minutes to make); an engine there is
rebuilt when the sources it is built from change. Without it, everything goes to pytest's tmp.

The comparison functions (prompts, teacher forcing, agreement, relative error) are plain
functions, checked on the CPU here against a float32 CPU engine and transformers.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from statistics import median

import pytest
import torch
from transformers import AutoModelForCausalLM

from parity_tools import (NUM_PROMPTS, PROMPT_LENS, argmax_agreement, cached_checkpoint, cached_engine, free_gpu,
                          gpu_and_cpu_runs, hf_teacher_forced, kiln_generate, kiln_teacher_forced, make_prompts,
                          measure_bf16_parity, open_executor, publish, relative_errors, report, teacher_forced_tokens)
from kiln.runtime import Session
from kiln.runtime.engine import EngineLoadError, load_engine

FP32_REL_ERR = 1e-4
# Kiln against float32 may trail transformers bf16 against float32 by 1.5% of the tokens
# (16 of 1,024: near-ties break either way) and by a quarter in median relative error.
BF16_AGREEMENT_MARGIN, BF16_ERROR_FACTOR = 0.015, 1.25
# 16 sequences of up to 164 tokens in flight: the 16 prompts' 1,000-odd tokens are prefilled in
# chunks of 256 beside the decodes of the sequences admitted first.
BUILD = dict(max_seq_len=256, max_num_tokens=256, max_batch_size=16, kv_block_size=16)
SMALL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=512, vocab_size=512)
LLAMA3_8B = dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                 vocab_size=128256, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def gpu_workdir(tmp_path_factory):
    if os.environ.get("KILN_GPU_WORKDIR"):
        path = Path(os.environ["KILN_GPU_WORKDIR"])
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = tmp_path_factory.mktemp("gpu-parity")
    yield path
    # pytest keeps its last three tmp folders: three 8B checkpoints and engines would fill the disk.
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def arch() -> str:
    from kiln.runtime.cuda_driver import device_arch

    return device_arch()


def check_bf16_parity(name: str, checkpoint: Path, engine_dir: Path, vocab_size: int, record_property) -> None:
    """Kiln's bf16 engine must be at least as close to the float32 computation as transformers'
    own bf16 run is (within the margins below).

    The issue asks for >= 99% agreement and <= 2e-2 relative error against transformers bf16.
    With random weights the logits are nearly flat, so bf16 rounding alone breaks near-ties:
    on an H200 (2026-11-29) transformers bf16 agreed with its own float32 run on only 83% of
    the 8B shape's tokens (rel err 7.0e-2) and 97.6-99.0% for the small models. Those figures
    are printed with every run; the assertion compares Kiln with that noise floor instead."""
    parity = measure_bf16_parity(name, checkpoint, engine_dir, make_prompts(vocab_size))
    publish(parity.line, record_property)
    (k32, k32_err), (h32, h32_err) = parity.kiln_vs_fp32, parity.hf_vs_fp32
    assert k32[0] >= h32[0] - BF16_AGREEMENT_MARGIN, parity.line
    assert median(k32_err) <= BF16_ERROR_FACTOR * median(h32_err), parity.line


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3"])
def test_small_bf16_engine_matches_transformers_on_the_gpu(family, gpu_workdir, arch, record_property):
    checkpoint = cached_checkpoint(gpu_workdir, family, **SMALL)
    engine = cached_engine(gpu_workdir, checkpoint, [arch], "bfloat16", **BUILD)
    check_bf16_parity(f"{family} small bf16", checkpoint, engine, SMALL["vocab_size"], record_property)


@pytest.mark.gpu
def test_llama3_8b_bf16_engine_matches_transformers_on_the_gpu(gpu_workdir, arch, record_property):
    # Made on the GPU directly in bf16: seconds, instead of minutes and 32 GB on the CPU.
    checkpoint = cached_checkpoint(gpu_workdir, "llama3", dtype="bfloat16", device="cuda", **LLAMA3_8B)
    free_gpu()
    engine = cached_engine(gpu_workdir, checkpoint, [arch], "bfloat16", **BUILD)
    check_bf16_parity("llama3 8B bf16", checkpoint, engine, LLAMA3_8B["vocab_size"], record_property)


# -- GPU: float32 engine against the CPU executor -----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_float32_gpu_engine_matches_cpu_engine(family, gpu_workdir, arch, record_property):
    checkpoint = cached_checkpoint(gpu_workdir, family, **SMALL)
    engine = cached_engine(gpu_workdir, checkpoint, ["cpu", arch], "float32", **BUILD)
    prompts = make_prompts(SMALL["vocab_size"])
    tokens, logits = gpu_and_cpu_runs(engine, prompts)

    errors = relative_errors(logits["cuda"], logits["cpu"])
    line = report(f"{family} small float32, cuda vs cpu", tokens["cuda"], argmax_agreement(tokens["cuda"], logits["cpu"]),
                  errors)
    publish(line, record_property)
    for i, (got, want) in enumerate(zip(tokens["cuda"], tokens["cpu"])):
        if got != want:
            j = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            top2 = logits["cpu"][i][j].topk(2).values
            pytest.fail(f"prompt {i}: token {j} is {got[j]} on the GPU, {want[j]} on the CPU (the CPU's top two "
                        f"logits there differ by {float(top2[0] - top2[1]):.2e}); {line}")
    assert max(errors) <= FP32_REL_ERR, line


# -- GPU: an engine for another GPU is refused -------------------------------------------------

@pytest.mark.gpu
def test_engine_for_another_gpu_is_refused(gpu_workdir, arch):
    from kiln.runtime.cuda_executor import CudaExecutor

    other = "sm_89" if arch != "sm_89" else "sm_80"
    engine_dir = cached_engine(gpu_workdir, cached_checkpoint(gpu_workdir, "qwen3"), [other], "bfloat16",
                               max_seq_len=64, max_num_tokens=64)
    message = f"engine built for {other};.* needs {arch}: rebuild with --target {arch}"
    with pytest.raises(EngineLoadError, match=message):
        Session(engine_dir, device="cuda")
    with pytest.raises(EngineLoadError, match=message):
        CudaExecutor(load_engine(engine_dir, target=other), 4)


# -- CPU: the comparison functions themselves --------------------------------------------------

def test_agreement_and_relative_error_definitions():
    logits = [torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 0.0, 0.0]]), torch.tensor([[1.0, 2.0, 0.0, -1.0]])]
    # Token 2 ties with token 1 for the first row's top: an argmax, though not the first.
    assert argmax_agreement([[2, 0], [1]], logits) == (1.0, 2 / 3)
    assert argmax_agreement([[1, 1], [0]], logits) == (1 / 3, 1 / 3)
    with pytest.raises(AssertionError):
        argmax_agreement([[1], [1]], logits)
    want = [torch.randn(3, 5, generator=torch.Generator().manual_seed(0)), torch.ones(2, 5)]
    errors = relative_errors([w * 1.01 for w in want], want)
    assert errors == pytest.approx([0.01, 0.01], rel=1e-4)
    assert relative_errors(want, want) == [0.0, 0.0]

    prompts = make_prompts(512)
    assert prompts == make_prompts(512) and len(prompts) == NUM_PROMPTS
    assert sorted(len(p) for p in prompts)[::NUM_PROMPTS - 1] == list(PROMPT_LENS)
    assert all(3 <= t < 512 for p in prompts for t in p)
    assert teacher_forced_tokens([5, 6, 7], [8, 9]) == ([5, 6, 7, 8], 2)


def test_teacher_forcing_against_transformers_on_the_cpu(factory):
    """The GPU tests' functions on a float32 CPU engine: its greedy tokens are transformers'
    argmax at every teacher-forced position, and the logits agree to float32 precision."""
    checkpoint = factory.checkpoint("llama3")
    engine = factory.engine(checkpoint, dtype="float32")  # at most 64 tokens a step, 32 logit rows
    prompts = make_prompts(512, n=4, lengths=(1, 30))
    tokens = kiln_generate(engine, "cpu", prompts, max_tokens=20)
    executor = open_executor(engine, "cpu")
    kiln = [kiln_teacher_forced(executor, p, t) for p, t in zip(prompts, tokens)]
    chunked = [kiln_teacher_forced(executor, p, t, max_chunk=3) for p, t in zip(prompts, tokens)]
    executor.close()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf = [hf_teacher_forced(model, p, t) for p, t in zip(prompts, tokens)]

    assert [k.shape for k in kiln] == [(20, 512)] * 4
    assert argmax_agreement(tokens, hf) == (1.0, 1.0)
    assert argmax_agreement(tokens, kiln) == (1.0, 1.0)
    assert max(relative_errors(kiln, hf)) < FP32_REL_ERR
    assert max(relative_errors(chunked, kiln)) < 1e-5
    # The positions line up: one step off, the tokens no longer agree.
    shifted = [torch.cat([h[1:], h[:1]]) for h in hf]
    assert argmax_agreement(tokens, shifted)[0] < 0.5
    # One wrong token costs exactly its share.
    wrong = [list(t) for t in tokens]
    wrong[1][7] = (wrong[1][7] + 1) % 512
    assert argmax_agreement(wrong, hf)[0] == pytest.approx(1 - 1 / 80)
    print(report("llama3 tiny float32, cpu vs transformers", tokens, argmax_agreement(tokens, hf),
                 relative_errors(kiln, hf)))


def test_bf16_measurement_on_the_cpu(tmp_path):
    """The bf16 GPU tests' whole path on the CPU, from an engine built by `cached_engine` in a
    fresh process: figures in the range bf16 gives (CPU reference ops against transformers;
    the GPU tests compare Kiln with transformers' own bf16 noise), and a second `cached_engine` call reuses
    the engine."""
    checkpoint = cached_checkpoint(tmp_path, "llama3")
    assert cached_checkpoint(tmp_path, "llama3") == checkpoint
    engine = cached_engine(tmp_path, checkpoint, ["cpu"], "bfloat16", **BUILD)
    built = (engine / "rank0.engine").stat().st_mtime_ns
    assert cached_engine(tmp_path, checkpoint, ["cpu"], "bfloat16", **BUILD) == engine
    assert (engine / "rank0.engine").stat().st_mtime_ns == built
    prompts = make_prompts(512, n=4)
    parity = measure_bf16_parity("llama3 tiny bf16, cpu", checkpoint, engine, prompts, "cpu", 32)
    (agreement, errors), line = parity.kiln_vs_hf, parity.line
    print(line)
    assert line.startswith("llama3 tiny bf16, cpu: agreement ") and "over 128 tokens" in line
    assert 0.9 <= agreement[1] <= agreement[0] <= 1.0
    assert len(errors) == 4 and all(1e-4 < e < 5e-2 for e in errors)
