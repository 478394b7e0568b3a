"""A real Gemma 3 GGUF from the package index (Gemma 3 270M, Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0
tensors, a SentencePiece vocabulary of 262,144 tokens) reads as transformers reads the same file:
the Hugging Face folder Kiln converts it to has transformers' config, exactly its tensors (norms
without llama.cpp's +1) and a tokenizer that encodes text to the same ids."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from kiln.models.gguf import read_gguf

MODEL = "gemma3-270m"
TEXTS = ["Hello, world!", "What is 12345 + 678?", "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
         "  spaces   and\ttabs\n\nnewlines", "Ünïcödé ✓ 日本語 🙂", "def f(x):\n    return x*2"]
# Keys of the two configs that may differ: where each came from, and what transformers adds on loading.
IGNORED_KEYS = {"_name_or_path", "_model_name_or_path", "architectures", "quantization_config", "unk_token_id",
                "transformers_version", "dtype", "torch_dtype"}


@pytest.fixture(scope="module")
def gemma(real_model):
    return real_model(MODEL)


def test_config_is_transformers(gemma):
    from transformers import AutoConfig

    want = AutoConfig.from_pretrained(gemma.gguf.parent, gguf_file=gemma.gguf.name).to_dict()
    got = AutoConfig.from_pretrained(gemma.hf).to_dict()
    # transformers keeps the float32 metadata value (9.99999997e-07); Kiln the decimal written (1e-06).
    assert np.float32(got.pop("rms_norm_eps")) == np.float32(want.pop("rms_norm_eps"))
    assert {k: v for k, v in got.items() if k not in IGNORED_KEYS} == {k: v for k, v in want.items()
                                                                        if k not in IGNORED_KEYS}
    assert got["architectures"] == ["Gemma3ForCausalLM"]


def test_tensors_are_transformers(gemma):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma.gguf.parent, gguf_file=gemma.gguf.name, dtype=torch.float32)
    state = model.state_dict()
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

