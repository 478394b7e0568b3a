"""Incremental detokenization: the text decoded a few tokens per step equals the full decode, a
step's decode work does not grow with the output, and stop strings and partial UTF-8 characters
are handled the way the engine streams them."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, normalizers, trainers
from tokenizers import models as tokenizer_models

from kiln.models.random_tokenizer import CORPUS, EOS_TOKEN, SPECIAL_TOKENS, train_tokenizer
from kiln.runtime.detokenizer import Detokenizer, find_stop, stop_prefix_len
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Request, Sequence

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)

WORDS = ("the kiln was hot", "café au lait", "naïve", "世界", "日本語のテキスト", "中文字符", "😀",
         "🔥🎉", "👩‍👩‍👧", "Ünïcödé", " ", "\n", "42.50 €", "—", "ok", "a", "aa")


class CountingTokenizer:
    """Counts the token ids every decode call is given."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.calls: list[int] = []

    def decode(self, ids, *args, **kwargs):
        self.calls.append(len(ids))
        return self.inner.decode(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" for spaces, <0xXX> byte-fallback tokens, and a decoder
    that strips the text's leading space, so a token's text depends on what comes before it."""
    tok = Tokenizer(tokenizer_models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def sp_tok():
    return sentencepiece_tokenizer()


def random_ids(tok, rng: random.Random, length: int, raw: bool = True) -> list[int]:
    """Real text (multi-byte characters included) with special tokens and unknown ids (an
    engine's embedding rows past the tokenizer's vocabulary) thrown in; `raw`: random tokens
    too, lone UTF-8 lead or continuation bytes among them."""
    ids: list[int] = []
    vocab = tok.get_vocab_size()
    while len(ids) < length:
        roll = rng.random()
        if roll < 0.6 or (roll >= 0.8 and not raw):
            ids += tok.encode(rng.choice(WORDS) + rng.choice(("", " ")), add_special_tokens=False).ids
        elif roll < 0.7:
            ids.append(rng.randrange(len(SPECIAL_TOKENS)))
        elif roll < 0.8:
            ids.append(rng.randrange(vocab, vocab + 128))
        else:
            ids.append(rng.randrange(vocab))
    return ids[:length]




def make_seq(ids_prompt: list[int], **params) -> Sequence:
    request = Request("r", list(ids_prompt), SamplingParams(**params))
    seq = Sequence(request, 0, list(ids_prompt), None)
    request.seqs.append(seq)
    return seq


# -- the stream alone ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_incremental_text_equals_full_decode_after_every_step(kind, tok, sp_tok):
    """Byte-level BPE: any ids. SentencePiece-style: valid text (see the test after this one);
    there a window that starts at a "▁" token gets its space stripped, so the context matters."""
    tok = tok if kind == "byte-level" else sp_tok
    detok = Detokenizer(tok)
    rng = random.Random(0)
    for trial in range(300):
        ids = random_ids(tok, rng, rng.randint(1, 60), raw=kind == "byte-level")
        stream, text, i, want = detok.stream(), "", 0, ""
        while i < len(ids):
            k = 1 if rng.random() < 0.8 else rng.randint(2, 5)  # now and then several at once
            text += stream.push(ids[i:i + k])
            i = min(i + k, len(ids))
            # The full decode of the output so far, unless it ends in a partial character: then
            # the text stays what it was at the last push whose full decode did not.
            full = tok.decode(ids[:i])
            want = want if full.endswith("\ufffd") else full
            assert text == want, (trial, ids[:i])
        full = tok.decode(ids)
        # Byte fallback shows a run of byte tokens cut short as one "\ufffd" per byte, even the
        # run's whole characters, which the stream has already emitted (see the next test).
        if kind == "byte-level" or not full.endswith("\ufffd"):
            assert text + stream.flush() == full, (trial, ids)


def test_byte_fallback_after_a_character_keeps_the_streamed_character(sp_tok):
    """Where the incremental text legitimately differs from a full decode: SentencePiece's
    byte-fallback decoder turns a run of byte tokens that is not valid UTF-8 as a whole into one
    "\ufffd" per byte, even a valid character at its start. Streamed, that character was already
    out (and a streamed text never shrinks), so the incremental text keeps it."""
    ids = sp_tok.encode("世", add_special_tokens=False).ids + [sp_tok.token_to_id("<0xFF>")]
    ids += sp_tok.encode("a", add_special_tokens=False).ids
    stream = Detokenizer(sp_tok).stream()
    text = "".join(stream.push([t]) for t in ids) + stream.flush()
    assert text == "世\ufffd\ufffd\ufffd a" and sp_tok.decode(ids) == "\ufffd" * 4 + " a"


def test_decode_work_per_step_does_not_grow_with_the_output(tok):
    """32 sequences x 1000 tokens: each step decodes a few tokens per sequence, at the start of
    the output as at its end (a full decode per step would pass 32 x 1000 at the end)."""
    counting = CountingTokenizer(tok)
    detok = Detokenizer(counting)
    rng = random.Random(1)
    outputs = [random_ids(tok, rng, 1000) for _ in range(32)]
    streams = [detok.stream() for _ in outputs]
    per_step, texts = [], [""] * 32
    for step in range(1000):
        counting.calls.clear()
        for s, (stream, ids) in enumerate(zip(streams, outputs)):
            texts[s] += stream.push(ids[step:step + 1])
        per_step.append(sum(counting.calls))
        assert max(counting.calls, default=0) <= 16  # tokens one decode call sees
    assert all(t + s.flush() == tok.decode(ids) for t, s, ids in zip(texts, streams, outputs))
    first, last = sum(per_step[:100]) / 100, sum(per_step[-100:]) / 100
    assert last < 8 * 32 and last < 1.5 * first + 32, (first, last)


def test_a_partial_character_waits_for_its_last_byte(tok):
    ids = tok.encode("a😀", add_special_tokens=False).ids
    assert len(ids) >= 3  # the emoji's 4 bytes come in more than one token
    stream = Detokenizer(tok).stream()
    assert stream.push(ids[:1]) == "a"
    assert [stream.push([t]) for t in ids[1:-1]] == [""] * (len(ids) - 2)
    assert stream.push(ids[-1:]) == "😀"
    # Flushed (the sequence ended), a partial character shows as a full decode shows it.
    stream = Detokenizer(tok).stream()
    assert stream.push(ids[:2]) == ""  # "a" waits with the partial character after it
    assert stream.flush() == tok.decode(ids[:2]) == "a\ufffd"


def test_special_and_unknown_ids_never_enter_the_window(tok):
    detok = Detokenizer(tok)
    stream = detok.stream()
    emoji = tok.encode("😀", add_special_tokens=False).ids
    ids = [emoji[0], 0, 1, 2, 500, 400, *emoji[1:]]  # the special/unknown ids inside a character
    out = "".join(stream.push([t]) for t in ids)
    assert out == tok.decode(ids) == "😀" and stream.fed == len(ids)
    # A random model whose vocabulary outgrows its tokenizer mostly samples ids that decode to
    # nothing: the window must not grow with them.
    stream = detok.stream()
    assert stream.push(tok.encode("hello", add_special_tokens=False).ids) == "hello"
    assert all(stream.push([t]) == "" for t in [*range(384, 512), 0, 1, 2] * 4)
    assert stream.window <= 4


def test_find_stop_and_stop_prefix_len():
    assert find_stop("abcXYdef", 0, ("XY",)) == 3
    assert find_stop("abcXYdef", 4, ("XY",)) == 3  # spans the searched/new boundary
    assert find_stop("abcXYdef", 5, ("XY",)) == -1  # searched already, found before
    assert find_stop("a stop, an end", 0, ("end", "stop")) == 2  # the earliest, not the first listed
    assert stop_prefix_len("hello wor", ("world", "x")) == 3
    assert stop_prefix_len("xaa", ("aa",)) == 1
    assert stop_prefix_len("hello", ("world",)) == 0


# -- a sequence's text, as the engine updates it ---------------------------------------------------

def run_seq(detok, seq: Sequence, ids: list[int], eos: int | None = None):
    """Append and update like EngineCore._check_finished; returns the streamed texts and whether,
    and after how many tokens, a stop string ended the sequence."""
    texts = []
    for n, t in enumerate(ids, 1):
        seq.token_ids.append(t)
        if t == eos:
            detok.update(seq, final=True, drop_last=True)
            return texts, ("eos", n)
        final = n == len(ids)
        if detok.update(seq, final=final):
            return texts, ("stop", n)
        texts.append(seq.text)
    return texts, ("length", len(ids))


def test_streamed_text_is_a_prefix_of_the_final_text(tok):
    """Over many random outputs: mid-stream text only grows and never ends in a partial
    character, and the final text (length or eos) is the full decode of the output."""
    detok = Detokenizer(tok)
    eos = tok.token_to_id(EOS_TOKEN)
    rng = random.Random(2)
    for trial in range(300):
        ids = [t for t in random_ids(tok, rng, rng.randint(1, 60)) if t != eos]
        if rng.random() < 0.3:
            ids.append(eos)
        seq = make_seq([0, 5, 6])
        texts, (reason, n) = run_seq(detok, seq, ids, eos)
        assert n == len(ids)
        final = seq.text
        assert final == tok.decode(ids[:-1] if reason == "eos" else ids), trial
        for a, b in zip(texts, texts[1:] + [final]):
            assert b.startswith(a), trial
        assert not any(t.endswith("\ufffd") for t in texts[:-1] if reason == "length")


def test_stop_string_spanning_tokens_and_steps(tok):
    text = "The kiln was hot and the fire burned for three days."
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = Detokenizer(tok)
    for stop in ("hot and the", "fire", "e d", "."):
        seq = make_seq([0], stop=[stop])
        texts, (reason, n) = run_seq(detok, seq, ids)
        assert reason == "stop" and seq.text == text[:text.find(stop)], stop
        # It stopped on the token that completed the stop string, not a step later.
        assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[:n - 1]), stop
        # Its first characters were held back, never streamed: the text only grew.
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:] + [seq.text]))


def test_stop_string_that_ends_with_its_own_start(tok):
    """"aa" ends with "a": the stop is found on the token that completes it, and at the
    sequence's last token too (before, it was searched in the held-back text and missed)."""
    ids = tok.encode("xaab", add_special_tokens=False).ids
    n_aa = next(n for n in range(1, len(ids) + 1) if "aa" in tok.decode(ids[:n]))
    seq = make_seq([0], stop=["aa"])
    _, (reason, n) = run_seq(Detokenizer(tok), seq, ids[:n_aa])  # the last token completes it
    assert (reason, n, seq.text) == ("stop", n_aa, "x")


def test_stop_string_inside_a_multibyte_character_run(tok):
    text = "日本語のテキスト"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text)  # characters really are split across tokens
    seq = make_seq([0], stop=["のテ"])
    texts, (reason, _) = run_seq(Detokenizer(tok), seq, ids)
    assert reason == "stop" and seq.text == "日本語"
    assert all(b.startswith(a) and "\ufffd" not in b for a, b in zip(texts, texts[1:] + [seq.text]))


def test_forked_sequence_catches_up(tok):
    """A sequence that already has output when it is first decoded gets it all in one go."""
    ids = tok.encode("café 😀 done", add_special_tokens=False).ids
    seq = make_seq([0, 7])
    seq.token_ids += ids
    assert Detokenizer(tok).update(seq, final=False) is False
    assert seq.text == tok.decode(ids) and seq.full_text == seq.text


def test_without_a_tokenizer_there_is_no_text():
    seq = make_seq([0], stop=["x"])
    seq.token_ids += [5, 6]
    assert not EngineCore._update_text(SimpleNamespace(detokenizer=None), seq, final=True)
    assert seq.text == "" and seq.full_text == ""


# -- through the engine ----------------------------------------------------------------------------

def test_sampled_streams_match_the_full_decode(session, tokenizer):
    """Random weights sampled at temperature 1: plenty of partial characters, special tokens and
    ids past the tokenizer's vocabulary. Streamed text grows; the final text is the decode."""
    for seed in range(6):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=seed % 2 == 0)
        outs = list(session.stream(prompt_token_ids=PROMPTS[seed], sampling_params=params))
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert not any(t.endswith("\ufffd") for t in texts[:-1])
        last = outs[-1].outputs[0]
        ids = last.token_ids[:-1] if last.finish_reason == "stop" else last.token_ids
        assert last.text == tokenizer.decode(ids)


def test_a_run_of_garbage_bytes_does_not_grow_the_window(tok):
    """A model emitting a byte that never completes a character (a lone continuation byte) for
    ever: the text still advances every MAX_PENDING tokens, so no decode sees more than those
    and the context before them, and the streamed text stays a prefix of the final one."""
    from kiln.runtime.detokenizer import MAX_PENDING

    byte = next(i for i in range(tok.get_vocab_size()) if tok.decode([i]) == "\ufffd")
    counter = CountingTokenizer(tok)
    stream = Detokenizer(counter).stream()
    text = "".join(stream.push([byte]) for _ in range(1000))
    assert max(counter.calls) <= 2 * MAX_PENDING
    assert text and (text + stream.flush()).startswith(text)
