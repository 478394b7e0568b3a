"""FP8 KV cache on a real trained model (SmolLM2-135M-Instruct, from its GGUF) on the CPU: the
bfloat16 engine with an e4m3 cache (scales 1.0, no calibration) has a perplexity on a fixed
text within 1% of the same engine with a bfloat16 cache; how often their greedy chat
completions agree is reported. scripts/fp8_kv_accuracy.py runs the same check on a GPU."""
from __future__ import annotations

import pytest

from kiln.builder.build import build_engine
from kiln.builder.config import BuildConfig
from fp8_kv_accuracy import measure
from real_models import CHAT_QUESTIONS, chat_prompts

BUILD = dict(dtype="bfloat16", targets=("cpu",), max_batch_size=16, max_seq_len=320, max_num_tokens=256)
NUM_PROMPTS, MAX_TOKENS = 8, 24


@pytest.fixture(scope="module")
def engines(real_model, module_dir):
    smollm = real_model("smollm2-135m")
    for name, kv in (("bf16", "auto"), ("fp8", "fp8")):
        build_engine(smollm.gguf, module_dir / name, BuildConfig(**BUILD, kv_cache_dtype=kv))
    return module_dir / "bf16", module_dir / "fp8"


def test_fp8_kv_perplexity_within_one_percent_of_the_model_dtype_cache(engines, record_property):
    plain, fp8 = engines
    prompts = chat_prompts(plain, CHAT_QUESTIONS[:NUM_PROMPTS])
    result = measure(plain, fp8, "cpu", prompts, MAX_TOKENS)
    line = (f"SmolLM2-135M bf16, CPU: perplexity {result.perplexity_model_dtype:.4f} (bf16 KV) vs "
            f"{result.perplexity_fp8:.4f} (fp8 KV), {100 * result.perplexity_change:+.2f}% over "
            f"{result.tokens_scored} tokens; greedy agreement {result.greedy_agreement:.3f}, "
            f"{result.identical_completions}/{result.completions} completions identical")
    print(line)
    record_property("fp8_kv_accuracy", line)
    assert result.perplexity_model_dtype < 50  # a trained model on English text
    assert abs(result.perplexity_change) <= 0.01, line
