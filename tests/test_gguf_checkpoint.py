"""A GGUF is read as the Hugging Face checkpoint it came from: a random checkpoint written the way
llama.cpp converts one (q/k rows permuted for llama, its names, its tokenizer as metadata) comes
back with the same config, the same tensors and a tokenizer that encodes the same; it builds an
engine whose logits equal the folder's; gguf-to-hf writes the folder. A GGUF Kiln cannot read (an
unsupported tensor type, architecture or tokenizer, a truncated file) is refused by build-engine
with a message naming the problem, and nothing is written."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gguf_files import gguf_from_hf, write_gguf
from gguf_reference import random_blocks
from kiln.builder.cli import build_engine
from kiln.models import read_chat_template, read_config
from kiln.models.gguf import convert_gguf, main as gguf_to_hf, read_gguf
from test_parity import run_engine

TEXTS = ["The kiln was hot", "def f(x): return x * 2  # 0123456789", "  spaces\tand\nnewlines  ", "Ünïcødé ✓"]
# conftest.SMALL_BUILD, as flags
BUILD = ["--dtype", "float32", "--target", "cpu", "--max-seq-len", "64", "--max-num-tokens", "64",
         "--max-batch-size", "32", "--kv-block-size", "4", "--quiet"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def converted(request, factory, tmp_path_factory):
    """(arch, the random HF folder, the GGUF llama.cpp would make of it)."""
    family = {"llama": "llama2", "qwen2": "qwen2"}[request.param]
    # Above every family's tokenizer (qwen2's has 386 tokens with its ChatML specials).
    hf = factory.checkpoint(family, vocab_size=448)
    path = gguf_from_hf(hf, tmp_path_factory.mktemp("gguf") / f"{family}.gguf", request.param)
    return request.param, hf, path


def test_tensors_come_back_as_the_checkpoints(converted):
    arch, hf, path = converted
    want = load_file(str(hf / "model.safetensors"))
    got = dict(read_gguf(path).tensors())
    assert set(got) == set(want)
    for name, tensor in want.items():
        # The llama q/k rows were permuted on the way in: equal only if the reader undid it.
        assert torch.equal(got[name], tensor.float()), name


def test_config_is_the_checkpoints(converted):
    _, hf, path = converted
    assert read_config(path) == read_config(hf)


def test_tokenizer_encodes_and_decodes_as_the_checkpoints(converted):
    _, hf, path = converted
    want = Tokenizer.from_file(str(hf / "tokenizer.json"))
    got = Tokenizer.from_str(read_gguf(path).files["tokenizer.json"])
    for text in TEXTS:
        ids = want.encode(text).ids
        assert got.encode(text).ids == ids, text
        assert got.decode(ids) == want.decode(ids)
    assert read_chat_template(path).startswith("{% for m in messages %}")


def test_gguf_engine_equals_the_folders(converted, factory, tmp_path):
    _, hf, path = converted
    result = CliRunner().invoke(build_engine, ["--checkpoint", str(path), "--output", str(tmp_path / "e"), *BUILD])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "e" / "chat_template.jinja").is_file() and (tmp_path / "e" / "tokenizer.json").is_file()
    prompts = [[5, 17, 33, 90, 101, 7, 250], [300, 12, 64]]
    tokens, logits = run_engine(tmp_path / "e", prompts)
    want_tokens, want_logits = run_engine(factory.engine(hf, dtype="float32"), prompts)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gguf_to_hf_writes_a_folder_transformers_loads(converted, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, hf, path = converted
    result = CliRunner().invoke(gguf_to_hf, [str(path), "--output", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = load_file(str(hf / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in want.items())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"
    again = CliRunner().invoke(gguf_to_hf, [str(path), "--output", str(tmp_path / "hf")])
    assert again.exit_code == 2 and "not an empty folder" in again.output


# -- refused files ------------------------------------------------------------------------------

def _bad_build(path, tmp_path) -> str:
    out = tmp_path / "engine"
    result = CliRunner().invoke(build_engine, ["--checkpoint", str(path), "--output", str(out), *BUILD])
    assert result.exit_code == 2, result.output
    assert not out.exists() and not list(tmp_path.glob(".engine*")), "a refused GGUF must write nothing"
    return " ".join(result.output.split())


def _llama_metadata(converted_hf) -> dict:
    cfg = json.loads((converted_hf / "config.json").read_text())
    return {"llama.block_count": cfg["num_hidden_layers"], "llama.embedding_length": cfg["hidden_size"]}


def test_unsupported_tensor_type_is_refused(converted, tmp_path):
    arch, hf, _ = converted
    path = write_gguf(tmp_path / "q2k.gguf", arch, _llama_metadata(hf),
                      {"token_embd.weight": (random_blocks("Q4_K", 4, 256), "Q4_K"),
                       "blk.0.attn_q.weight": (np.zeros((4, 84), np.uint8), "Q2_K")})
    message = _bad_build(path, tmp_path)
    assert "tensor type Q2_K is not supported" in message and "blk.0.attn_q.weight" in message


def test_unsupported_architecture_is_refused(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", "mamba", {"mamba.block_count": 1},
                      {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    message = _bad_build(path, tmp_path)
    assert "GGUF architecture 'mamba' is not supported" in message and "llama, qwen2, qwen3, gemma3" in message


def test_truncated_file_is_refused(converted, tmp_path):
    _, _, path = converted
    data = path.read_bytes()
    for keep in (len(data) - 1000, 64):  # inside the tensor data; inside the header
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        message = _bad_build(cut, tmp_path)
        assert "truncated" in message and "download it again" in message


def test_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    assert "is not a GGUF file" in _bad_build(path, tmp_path)


def test_unknown_pre_tokenizer_is_refused(converted, tmp_path):
    arch, hf, path = converted
    reread = tmp_path / "pre.gguf"
    from gguf import GGUFReader

    r = GGUFReader(path)
    metadata = {k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "general.architecture"))}
    metadata["tokenizer.ggml.pre"] = "some-new-model"
    write_gguf(reread, arch, metadata, {t.name: (np.array(t.data), None) for t in r.tensors})
    message = _bad_build(reread, tmp_path)
    assert "pre-tokenizer 'some-new-model'" in message


def test_convert_refuses_without_writing(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", "mamba", {}, {"x": (np.zeros((2, 2), np.float32), None)})
    result = CliRunner().invoke(gguf_to_hf, [str(path), "--output", str(tmp_path / "hf")])
    assert result.exit_code == 2 and "'mamba' is not supported" in result.output
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="not supported"):
        convert_gguf(path, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()
