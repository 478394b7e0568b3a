"""FP8 KV cache on a real trained model (SmolLM2-135M-Instruct, from its GGUF) on the CPU: the
bfloat16 engine with an e4m3 cache whose scales `--calibration-prompts` measured has a perplexity
on fixed passages within 1% of the same engine with a bfloat16 cache; how often their greedy chat
completions agree is reported. The cache at scales 1.0 (no calibration, what a checkpoint without
KV scales gets) is reported too, and guarded against breaking. scripts/fp8_kv_accuracy.py runs the
same check on a GPU."""
from __future__ import annotations

import pytest

from kiln.builder.build import build_engine
from kiln.builder.config import BuildConfig
from fp8_accuracy_check import CALIBRATION
from fp8_kv_accuracy import measure
from real_models import CHAT_QUESTIONS, chat_prompts

BUILD = dict(dtype="bfloat16", targets=("cpu",), max_batch_size=16, max_seq_len=320, max_num_tokens=256)
NUM_PROMPTS, MAX_TOKENS = 8, 24
# Over the 1,975 tokens of tests/passages.py, each +-0.34% (one standard error): +0.41% with calibrated scales,
# +0.68% at scales 1.0 (which put small values in e4m3's subnormals), on an AMD EPYC with AVX2 and references
# multiplying into float32 (session 59); +0.36% and +1.13% on an Intel Xeon with AMX and torch's bf16 GEMMs
# before; session 60's CI run on this AVX2 kind of machine read +0.50% and +0.69%. The uncalibrated cache gets a
# bar well above its figure, to catch a broken path rather than a rounding.
UNCALIBRATED_GUARD = 0.05


@pytest.fixture(scope="module")
def engines(real_model, module_dir):
    smollm = real_model("smollm2-135m")
    prompts = module_dir / "calibration.txt"
    prompts.write_text("\n".join(CALIBRATION) + "\n", encoding="utf-8")
    builds = {"bf16": {}, "fp8": {"kv_cache_dtype": "fp8", "calibration_prompts": str(prompts)},
              "fp8-ones": {"kv_cache_dtype": "fp8"}}
    for name, extra in builds.items():
        build_engine(smollm.gguf, module_dir / name, BuildConfig(**BUILD, **extra))
    return {name: module_dir / name for name in builds}


@pytest.mark.parametrize("cache", ["fp8", "fp8-ones"])
def test_fp8_kv_perplexity_within_one_percent_of_the_model_dtype_cache(engines, record_property, cache):
    prompts = chat_prompts(engines["bf16"], CHAT_QUESTIONS[:NUM_PROMPTS])
    result = measure(engines["bf16"], engines[cache], "cpu", prompts, MAX_TOKENS)
    scales = "calibrated scales" if cache == "fp8" else "scales 1.0"
    line = (f"SmolLM2-135M bf16, CPU: perplexity {result.perplexity_model_dtype:.4f} (bf16 KV) vs "
            f"{result.perplexity_fp8:.4f} (fp8 KV, {scales}), {100 * result.perplexity_change:+.2f}% "
            f"(+-{100 * result.change_stderr:.2f}%) over {result.tokens_scored} tokens; greedy agreement "
            f"{result.greedy_agreement:.3f}, "
            f"{result.identical_completions}/{result.completions} completions identical")
    print(line)
    record_property(f"fp8_kv_accuracy_{cache}", line)
    assert result.perplexity_model_dtype < 50  # a trained model on English text
    assert abs(result.perplexity_change) <= (0.01 if cache == "fp8" else UNCALIBRATED_GUARD), line
