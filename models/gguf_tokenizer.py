"""The tokenizer a GGUF file describes in its metadata, rebuilt as the files a Hugging Face folder
holds: `tokenizer.json` (which `tokenizers` loads), `tokenizer_config.json` and, where the file has
one, `chat_template.jinja`.

Two kinds, as `tokenizer.ggml.model` names them:
- `gpt2`: byte-level BPE with the file's merges (Llama 3, Qwen2, SmolLM). How text is split before
  the merges depends on the model (`tokenizer.ggml.pre`); the splits Kiln knows are below, and an
  unknown one is refused rather than guessed.
- `llama`: SentencePiece-style BPE over scores (Llama 2, Gemma): spaces become "▁", pieces merge
  best score first, and bytes missing from the vocabulary fall back to <0xNN> tokens. The file has
  no merges, so they are derived from the scores: every way of writing a token as two tokens is a
  merge, ranked by the token's score, which is the order llama.cpp's tokenizer merges in.
Tokens marked control become special added tokens and user-defined ones plain added tokens, so
each is matched whole in the text, as llama.cpp does.
"""
from __future__ import annotations

import json
from typing import Any

from kiln.models.config import CheckpointError
from kiln.models.gguf_file import GGUFFile

# llama.cpp's token types
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split each digit apart first, the split pattern)
_PRE_TOKENIZERS = {
    "default": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}


def tokenizer_files(f: GGUFFile) -> dict[str, str]:
    """File name -> text of the tokenizer files for the GGUF's tokenizer."""
    kind = f.require("tokenizer.ggml.model")
    tokens: list[str] = f.require("tokenizer.ggml.tokens")
    types: list[int] = f.metadata("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(f, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(f, tokens, types)
    else:
        raise CheckpointError(f"{f.path}: tokenizer {kind!r} is not supported; Kiln builds 'gpt2' (byte-level "
                              "BPE) and 'llama' (SentencePiece-style) tokenizers from GGUF")
    _add_tokens(tokenizer, tokens, types)
    specials = _special_tokens(f, tokens)
    add_bos = bool(f.metadata("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(f.metadata("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(tokenizer, specials, add_bos, add_eos)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
              "add_bos_token": add_bos, "add_eos_token": add_eos,
              "model_max_length": int(f.metadata(f"{f.architecture}.context_length", 0)) or None}
    files = {"tokenizer.json": tokenizer.to_str(),
             "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
    template = f.metadata("tokenizer.chat_template")
    if template:
        files["chat_template.jinja"] = template
    return files


def _byte_level_bpe(f: GGUFFile, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = f.metadata("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise CheckpointError(f"{f.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; Kiln knows "
                              f"{', '.join(_PRE_TOKENIZERS)}")
    digits, split = _PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in f.require("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) pair of ordinary tokens that spells an ordinary token, best-scoring
    result first; ties keep the vocabulary's order."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == _NORMAL}
    ranked = sorted(normal.items(), key=lambda kv: (-scores[kv[1]], kv[1]))
    merges = []
    for token, _ in ranked:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                merges.append((left, right))
    return merges


def _sentencepiece_bpe(f: GGUFFile, tokens: list[str], types: list[int]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = f.require("tokenizer.ggml.scores")
    unk = f.metadata("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab, sentencepiece_merges(tokens, scores, types), unk_token=None if unk is None else tokens[unk],
                       fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    prefix = bool(f.metadata("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def _add_tokens(tokenizer, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _USER_DEFINED])


def _special_tokens(f: GGUFFile, tokens: list[str]) -> dict[str, Any]:
    named = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}
    out = {}
    for name, key in named.items():
        token_id = f.metadata(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            out[name] = tokens[token_id]
    return out


def _set_post_processor(tokenizer, specials: dict[str, Any], add_bos: bool, add_eos: bool) -> None:
    from tokenizers import processors

    bos = specials.get("bos_token") if add_bos else None
    eos = specials.get("eos_token") if add_eos else None
    if bos is None and eos is None:
        return
    pieces = ([bos] if bos else []), ([eos] if eos else [])
    single = " ".join(pieces[0] + ["$A"] + pieces[1])
    pair = " ".join(pieces[0] + ["$A"] + pieces[1] + pieces[0] + ["$B:1"] + pieces[1])
    used = [t for t in (bos, eos) if t]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(used)])
