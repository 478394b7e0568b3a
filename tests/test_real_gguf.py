"""A real trained model from the package index (SmolLM2-135M-Instruct, a Llama-architecture GGUF
in Q4_1 with a Q8_0 embedding) built with --target cpu --dtype float32 from its GGUF: its greedy
completions of 16 chat prompts x 48 tokens are the ones transformers gives loading the same GGUF
in float32, and the engine built from the converted Hugging Face folder gives the same as the
GGUF's."""
from __future__ import annotations

import pytest
import torch

from kiln import Session
from kiln.builder.build import build_engine
from kiln.builder.config import BuildConfig
from kiln.models import read_chat_template
from parity_tools import kiln_generate
from real_models import CHAT_QUESTIONS, chat_prompts

MODEL = "smollm2-135m"
NUM_PROMPTS, MAX_TOKENS = 16, 48
BUILD = BuildConfig(dtype="float32", targets=("cpu",), max_batch_size=16, max_seq_len=160, max_num_tokens=256)


@pytest.fixture(scope="module")
def smollm(real_model):
    return real_model(MODEL)


@pytest.fixture(scope="module")
def gguf_engine(smollm, module_dir):
    out = module_dir / "gguf-engine"
    build_engine(smollm.gguf, out, BUILD)
    return out


@pytest.fixture(scope="module")
def prompts(smollm, gguf_engine) -> list[list[int]]:
    with Session(gguf_engine) as session:  # the GGUF's template reached the engine
        assert session.chat_template == read_chat_template(smollm.gguf) and "<|im_start|>" in session.chat_template
    return chat_prompts(gguf_engine, CHAT_QUESTIONS[:NUM_PROMPTS])


@pytest.fixture(scope="module")
def gguf_tokens(gguf_engine, prompts) -> list[list[int]]:
    return kiln_generate(gguf_engine, "cpu", prompts, MAX_TOKENS)


def hf_greedy_agrees(model, prompt: list[int], tokens: list[int]) -> bool:
    """Whether transformers' greedy completion of `prompt` is `tokens`: one forward pass over the
    prompt and the tokens, each token the argmax of the logits before it. Greedy decoding agrees
    up to the first position where this fails and no further, so this is the same comparison as
    generating (EOS included, as ignore_eos does), at the cost of one pass."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        predicted = model(ids).logits[0, len(prompt) - 1:].argmax(dim=-1)
    return predicted.tolist() == tokens


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm, gguf_engine, prompts):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm.gguf.parent, gguf_file=smollm.gguf.name)
    with Session(gguf_engine) as session:
        for ids in prompts:
            text = session.tokenizer.decode(ids, skip_special_tokens=False)
            assert hf(text, add_special_tokens=False)["input_ids"] == ids


def test_greedy_chat_completions_match_transformers(smollm, prompts, gguf_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm.gguf.parent, gguf_file=smollm.gguf.name,
                                                 dtype=torch.float32).eval()
    mismatched = [i for i, (p, t) in enumerate(zip(prompts, gguf_tokens)) if not hf_greedy_agrees(model, p, t)]
    assert not mismatched, f"prompts {mismatched} differ from transformers"


def test_hf_folder_engine_equals_gguf_engine(smollm, prompts, gguf_tokens, tmp_path):
    build_engine(smollm.hf, tmp_path / "hf-engine", BUILD)
    assert kiln_generate(tmp_path / "hf-engine", "cpu", prompts, MAX_TOKENS) == gguf_tokens
