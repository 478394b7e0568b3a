"""Session: streamed text, asyncio, and the engine thread's lifecycle."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)

# -- 6. streamed text ------------------------------------------------------------------------------

def test_streamed_text_is_incremental_across_multibyte_characters(session, tokenizer):
    held_back = []
    for prompt in ("The kiln was hot", "café au lait"):
        outs = list(session.stream(prompt, greedy(16)))
        assert outs[0].prompt_token_ids == tokenizer.encode(prompt).ids
        texts = [o.outputs[0].text for o in outs]
        for a, b in zip(texts, texts[1:]):
            assert b.startswith(a)
        assert not any(t.endswith("\ufffd") for t in texts[:-1])
        ids = outs[-1].outputs[0].token_ids
        assert texts[-1] == tokenizer.decode(ids)
        # Decoding each prefix naively would show a character's first bytes as '\ufffd' and
        # then take it back: these prompts really exercise holding back partial characters.
        naive = [tokenizer.decode(ids[:i]) for i in range(1, len(ids))]
        held_back.append(any(not texts[-1].startswith(t) for t in naive))
    assert all(held_back)


def test_stop_string_ends_the_text_before_it(session):
    [full] = session.generate("The kiln was hot", greedy(16))
    text = full.outputs[0].text
    # Two printable characters from the middle of the greedy text (here: multi-byte ones).
    middle = len(text) // 2
    at = next(i for i in sorted(range(1, len(text) - 1), key=lambda i: abs(i - middle))
              if all(c.isprintable() and c != "\ufffd" for c in text[i:i + 2]))
    stop = text[at:at + 2]
    [out] = session.generate("The kiln was hot", greedy(16, stop=[stop]))
    sample = out.outputs[0]
    assert sample.finish_reason == "stop"
    assert sample.text == text[:text.find(stop)]
    assert sample.token_ids == full.outputs[0].token_ids[:len(sample.token_ids)]
    assert len(sample.token_ids) < 16
    # Streamed, a stop string's first characters are held back: the text only ever grows.
    texts = [o.outputs[0].text for o in session.stream("The kiln was hot", greedy(16, stop=[stop]))]
    assert texts[-1] == sample.text
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


# -- 7. asyncio ------------------------------------------------------------------------------------

def test_asyncio_matches_generate(session):
    prompts = PROMPTS[32:40]
    params = [greedy(6 + i) if i % 2 else SamplingParams(temperature=0.9, seed=i, max_tokens=6 + i, ignore_eos=True)
              for i in range(8)]
    want = session.generate(prompt_token_ids=prompts, sampling_params=params)

    async def via_stream(prompt, p):
        outs = [out async for out in session.stream_async(prompt_token_ids=prompt, sampling_params=p)]
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, p.max_tokens + 1))
        return outs[-1]

    async def abandoned():
        async for out in session.stream_async(prompt_token_ids=prompts[0], sampling_params=greedy(50)):
            if len(out.outputs[0].token_ids) == 2:
                break  # the request is cancelled when the generator is closed

    async def main():
        return await asyncio.gather(abandoned(), *(
            session.generate_async(prompt_token_ids=prompt, sampling_params=p) if i % 2 else via_stream(prompt, p)
            for i, (prompt, p) in enumerate(zip(prompts, params))))

    got = asyncio.run(main())[1:]
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
    stats = session.stats
    assert (stats["kv_blocks_used"], stats["running"], stats["waiting"]) == (0, 0, 0)


# -- 8. lifecycle ----------------------------------------------------------------------------------

def test_callers_get_in_between_steps(session, monkeypatch):
    """Python's locks are not fair, yet a caller must not wait for more than the step in progress,
    or a cancel or close would only take effect once all the work is done."""
    steps = record_steps(session, monkeypatch)
    stream = session.stream(prompt_token_ids=[5, 6, 7], sampling_params=greedy(60))
    first = next(stream)
    waited = []
    for _ in range(5):
        before = len(steps)
        session.stats
        waited.append(len(steps) - before)
    session.cancel(first.request_id)
    assert list(stream)[-1].outputs[0].finish_reason == "cancelled"
    # Up to a few steps: the caller may also wait a GIL switch interval for its turn.
    assert max(waited) <= 10, waited


def test_close_cancels_requests_in_flight_and_stops_the_thread(engine_dir):
    before = engine_threads()
    with Session(engine_dir) as s:
        assert engine_threads() == before + 1 and s._thread.is_alive()
        blocked = []
        waiter = threading.Thread(target=lambda: blocked.extend(
            s.generate(prompt_token_ids=[8, 9], sampling_params=greedy(60))))
        waiter.start()
        deadline = time.monotonic() + 30
        while s.stats["running"] + s.stats["waiting"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        stream = s.stream(prompt_token_ids=[5, 6, 7], sampling_params=greedy(60))
        first = next(stream)
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 2
        waiter.join(10)
        rest = list(stream)
        assert not first.finished
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "cancelled"
        assert blocked[0].finished and blocked[0].outputs[0].finish_reason == "cancelled"
        with pytest.raises(RuntimeError, match="closed"):
            s.generate(prompt_token_ids=[5, 6], sampling_params=greedy(2))
    assert engine_threads() == before and s._thread not in threading.enumerate()
    s.close()  # closing twice is fine
