"""Issue 17's GPU check on trained weights, shared by tests/test_real_gpu.py and
scripts/real_model_gpu.py: SmolLM2-135M-Instruct's GGUF built as a bf16 engine for this GPU,
against transformers bf16 on the same GPU loading the same weights (the GGUF's Hugging Face folder),
over 32 chat prompts x 64 greedy tokens, teacher-forced (parity_tools.measure_bf16_parity)."""
from __future__ import annotations

from pathlib import Path

from parity_tools import Bf16Parity, cached_engine, measure_bf16_parity
from real_models import CHAT_QUESTIONS, cached, chat_prompts

MODEL = "smollm2-135m"
NUM_PROMPTS, MAX_TOKENS = 32, 64
# The issue's bar: share of teacher-forced positions where Kiln's token is transformers' argmax,
# and each sequence's logits relative L2 error.
AGREEMENT, REL_ERR = 0.99, 2e-2
# 32 sequences of up to ~60 prompt tokens and 64 generated ones in flight.
BUILD = dict(max_seq_len=192, max_num_tokens=256, max_batch_size=32, kv_block_size=16)


def measure_real_model(workdir: Path, device: str = "cuda") -> Bf16Parity | None:
    """The figures, or None when the model's GGUF is not in this machine's cache. `device` "cpu"
    runs the same comparison on the CPU (slowly): a dry run of everything but the kernels."""
    files = cached(MODEL)
    if files is None:
        return None
    if device == "cuda":
        from kiln.runtime.cuda_driver import device_arch

        targets = [device_arch()]
    else:
        targets = ["cpu"]
    engine = cached_engine(workdir, files.gguf, targets, "bfloat16", **BUILD)
    prompts = chat_prompts(engine, CHAT_QUESTIONS[:NUM_PROMPTS])
    return measure_bf16_parity(f"{MODEL} bf16 engine vs transformers bf16 ({NUM_PROMPTS} chat prompts x {MAX_TOKENS})",
                               files.hf, engine, prompts, device, MAX_TOKENS)


def passed(result: Bf16Parity) -> bool:
    (agreement, _), errors = result.kiln_vs_hf
    return agreement >= AGREEMENT and max(errors) <= REL_ERR
