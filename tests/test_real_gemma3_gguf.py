"""A real Gemma 3 GGUF from the package index (Gemma 3 270M, Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0
tensors, a SentencePiece vocabulary of 262,144 tokens) reads as transformers reads the same file:
the Hugging Face folder Kiln converts it to has transformers' config, exactly its tensors (norms
without llama.cpp's +1) and a tokenizer that encodes text to the same ids. Built with --target cpu
--dtype float32, its greedy completions of 16 chat prompts x 48 tokens are the ones transformers
generates loading the same GGUF in float32, and the engine built from the converted folder gives
the same as the GGUF's.

The index holds no instruction-tuned Gemma 3 GGUF, and this base model's file has no chat template,
so the prompts are rendered in Gemma's own turn format by `real_models.gemma_turn_prompts`."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from kiln.builder.build import build_engine
from kiln.builder.config import BuildConfig
from kiln.models.gguf import read_gguf
from parity_tools import kiln_generate
from real_models import CHAT_QUESTIONS, gemma_turn_prompts

MODEL = "gemma3-270m"
NUM_PROMPTS, MAX_TOKENS = 16, 48
# Prompts of 15-19 tokens and 48 generated ones, all 16 in flight.
BUILD = BuildConfig(dtype="float32", targets=("cpu",), max_batch_size=16, max_seq_len=96, max_num_tokens=256)
TEXTS = ["Hello, world!", "What is 12345 + 678?", "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
         "  spaces   and\ttabs\n\nnewlines", "Ünïcödé ✓ 日本語 🙂", "def f(x):\n    return x*2"]
# Keys of the two configs that may differ: where each came from, and what transformers adds on loading.
IGNORED_KEYS = {"_name_or_path", "_model_name_or_path", "architectures", "quantization_config", "unk_token_id",
                "transformers_version", "dtype", "torch_dtype"}


@pytest.fixture(scope="module")
def gemma(real_model):
    return real_model(MODEL)


@pytest.fixture(scope="module")
def hf_model(gemma):
    """transformers' model of the GGUF, dequantized by transformers itself, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma.gguf.parent, gguf_file=gemma.gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_engine(gemma, module_dir):
    out = module_dir / "gguf-engine"
    build_engine(gemma.gguf, out, BUILD)
    return out


@pytest.fixture(scope="module")
def prompts(gguf_engine) -> list[list[int]]:
    return gemma_turn_prompts(gguf_engine, CHAT_QUESTIONS[:NUM_PROMPTS])


@pytest.fixture(scope="module")
def gguf_tokens(gguf_engine, prompts) -> list[list[int]]:
    return kiln_generate(gguf_engine, "cpu", prompts, MAX_TOKENS)


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy completions of `prompts`, generated in one left-padded batch: exactly
    `max_tokens` each, as Kiln's ignore_eos gives them (no end token stops a sequence, and none is
    suppressed either, which min_new_tokens would do)."""
    width = max(len(p) for p in prompts)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=None, pad_token_id=pad)
    return out[:, width:].tolist()


def test_config_is_transformers(gemma):
    from transformers import AutoConfig

    want = AutoConfig.from_pretrained(gemma.gguf.parent, gguf_file=gemma.gguf.name).to_dict()
    got = AutoConfig.from_pretrained(gemma.hf).to_dict()
    # transformers keeps the float32 metadata value (9.99999997e-07); Kiln the decimal written (1e-06).
    assert np.float32(got.pop("rms_norm_eps")) == np.float32(want.pop("rms_norm_eps"))
    assert {k: v for k, v in got.items() if k not in IGNORED_KEYS} == {k: v for k, v in want.items()
                                                                        if k not in IGNORED_KEYS}
    assert got["architectures"] == ["Gemma3ForCausalLM"]


def test_tensors_are_transformers(gemma, hf_model):
    state = hf_model.state_dict()
    with safe_open(str(gemma.hf / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(state) - {"lm_head.weight"}  # tied to the embedding
        for name in names:
            assert torch.equal(f.get_tensor(name), state[name]), name


def test_tokenizer_is_transformers(gemma):
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(gemma.gguf.parent, gguf_file=gemma.gguf.name)
    got = Tokenizer.from_file(str(gemma.hf / "tokenizer.json"))
    for text in TEXTS:
        ids = want(text)["input_ids"]
        assert got.encode(text).ids == ids, text
        assert got.decode(ids, skip_special_tokens=False) == want.decode(ids)
    assert read_gguf(gemma.gguf).chat_template is None  # the base model's file has none


def test_greedy_turn_completions_match_transformers(hf_model, prompts, gguf_tokens):
    want = hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert [len(t) for t in want] == [MAX_TOKENS] * NUM_PROMPTS
    differ = {i: next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
              for i, (got, ref) in enumerate(zip(gguf_tokens, want)) if got != ref}
    assert not differ, f"completions differ from transformers' (prompt: first differing position): {differ}"


def test_hf_folder_engine_equals_gguf_engine(gemma, prompts, gguf_tokens, tmp_path):
    build_engine(gemma.hf, tmp_path / "hf-engine", BUILD)
    assert kiln_generate(tmp_path / "hf-engine", "cpu", prompts, MAX_TOKENS) == gguf_tokens
