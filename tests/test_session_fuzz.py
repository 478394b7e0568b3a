"""Session under random mixes of requests (hypothesis): valid ones with sampling parameters at their
edges, stop strings, cancellations mid-stream, and invalid ones of every kind, all at once on the CPU
engine. Every valid request completes (or ends as cancelled), every invalid one is a `ValueError`
naming its argument, no KV block leaks, and the engine keeps serving.

The run is deterministic (a fixed seed, no example database) with a fixed budget; a failure prints
the seed and the falsifying example. KILN_FUZZ_SEED and KILN_FUZZ_EXAMPLES explore further.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st

from kiln.runtime.arguments import ArgumentError
from kiln.runtime.sampling_params import SamplingParams

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)

SEED = int(os.environ.get("KILN_FUZZ_SEED", "20261130"))
EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "300"))
WORDS = ["The kiln", " was hot", " café", " 火", " once", " upon", " a", " time", "\n", "!"]


@dataclass(frozen=True)
class Valid:
    kwargs: dict  # for Session.stream
    params: SamplingParams
    cancel_after: int | None  # outputs read before the client gives up; None: read to the end


@dataclass(frozen=True)
class Invalid:
    call: str  # "stream", "generate" or "params"
    kwargs: dict
    argument: str  # the argument the error must name


def edge(*values):
    return st.sampled_from(values)


@st.composite
def sampling(draw, prompt_len: int) -> dict:
    room = MAX_SEQ_LEN - prompt_len
    max_tokens = draw(st.integers(1, min(room, 12)))
    return dict(
        n=draw(edge(1, 1, 2, 3)), temperature=draw(edge(0.0, 1e-4, 0.7, 1.0, 2.0)),
        top_k=draw(edge(0, 1, 2, VOCAB - 1, VOCAB + 10)), top_p=draw(edge(1e-6, 0.5, 1.0)),
        min_p=draw(edge(0.0, 0.3, 1.0)), repetition_penalty=draw(edge(1e-3, 0.5, 1.0, 1.3, 50.0)),
        presence_penalty=draw(edge(-2.0, 0.0, 2.0)), frequency_penalty=draw(edge(-2.0, 0.0, 2.0)),
        seed=draw(edge(None, 0, 7, 2**63 - 1)), max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
        stop=draw(st.lists(edge("a", "e ", "火", "the", "\n"), max_size=2)),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        bad_words=draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2), max_size=2)),
        ignore_eos=draw(st.booleans()), logprobs=draw(edge(None, 0, 3)),
    )


@st.composite
def valid(draw) -> Valid:
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))
        kwargs, prompt_len = {"prompt_token_ids": ids}, len(ids)
    else:
        text = "".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6)))
        kwargs, prompt_len = {"prompt": text}, 30  # the tokenizer's length is checked by the engine; 30 bounds it
    params = SamplingParams(**draw(sampling(prompt_len)))
    return Valid(kwargs, params, draw(st.one_of(st.none(), st.integers(0, 3))))


# Each: how to call, with what, and the argument the ValueError must name.
INVALID = [
    Invalid("params", dict(temperature=-1.0), "temperature"),
    Invalid("params", dict(temperature=float("nan")), "temperature"),
    Invalid("params", dict(top_p=0.0), "top_p"),
    Invalid("params", dict(top_k=-1), "top_k"),
    Invalid("params", dict(min_p=1.5), "min_p"),
    Invalid("params", dict(n=0), "n"),
    Invalid("params", dict(max_tokens=0), "max_tokens"),
    Invalid("params", dict(max_tokens=4, min_tokens=5), "min_tokens"),
    Invalid("params", dict(presence_penalty=2.5), "presence_penalty"),
    Invalid("params", dict(repetition_penalty=0.0), "repetition_penalty"),
    Invalid("params", dict(logprobs=-1), "logprobs"),
    Invalid("params", dict(seed=True), "seed"),
    Invalid("params", dict(stop=[""]), "stop"),
    Invalid("params", dict(stop_token_ids=[-3]), "stop_token_ids"),
    Invalid("params", dict(bad_words=[[]]), "bad_words"),
    Invalid("params", dict(beam_width=4), "beam_width"),
    Invalid("stream", dict(prompt_token_ids=[5] * (MAX_SEQ_LEN + 1)), "prompt"),
    Invalid("stream", dict(prompt_token_ids=[5] * 60, sampling_params=SamplingParams(max_tokens=10)), "max_tokens"),
    Invalid("stream", dict(prompt_token_ids=[5, VOCAB]), "prompt_token_ids"),
    Invalid("stream", dict(prompt_token_ids=[5, -1]), "prompt_token_ids"),
    Invalid("stream", dict(prompt_token_ids=[]), "prompt_token_ids"),
    Invalid("stream", dict(prompt_token_ids="The kiln"), "prompt_token_ids"),
    Invalid("stream", dict(prompt_token_ids=[5, 6.0]), "prompt_token_ids"),
    Invalid("stream", dict(prompt=""), "prompt"),
    Invalid("stream", dict(prompt=[5, 6, 7]), "prompt"),
    Invalid("stream", dict(prompt=["a", "b"]), "prompt"),
    Invalid("stream", dict(prompt="a", prompt_token_ids=[5]), "prompt"),
    Invalid("stream", dict(prompt="a", sampling_params={"max_tokens": 3}), "sampling_params"),
    Invalid("stream", dict(prompt="a", priority="high"), "priority"),
    Invalid("stream", dict(prompt_token_ids=[5] * 4, sampling_params=SamplingParams(n=40, max_tokens=50)), "n"),
    Invalid("generate", dict(prompts=["fine", ""]), "prompt"),
    Invalid("generate", dict(prompts=[[5, 6]]), "prompts[0]"),
    Invalid("generate", dict(prompt_token_ids=[[5], [6, VOCAB]]), "prompt_token_ids"),
    Invalid("generate", dict(prompts=["a", "b"], sampling_params=[SamplingParams()]), "sampling_params"),
]


def refuse(session, bad: Invalid) -> None:
    with pytest.raises(ValueError) as info:
        if bad.call == "params":
            SamplingParams(**bad.kwargs)
        elif bad.call == "stream":
            session.stream(**bad.kwargs)
        else:
            session.generate(**bad.kwargs)
    assert isinstance(info.value, ArgumentError), repr(info.value)
    assert info.value.argument == bad.argument and str(info.value).startswith(bad.argument), str(info.value)


def run(session, request: Valid, results: dict, key: int) -> None:
    outs = []
    try:
        for out in session.stream(**request.kwargs, sampling_params=request.params):
            outs.append(out)
            if request.cancel_after is not None and len(outs) > request.cancel_after:
                session.cancel(out.request_id)
    except Exception as e:  # noqa: BLE001 - raised in the test's thread by check_completed
        results[key] = e
        return
    results[key] = outs


def check_completed(request: Valid, outs: list | Exception) -> None:
    if isinstance(outs, Exception):
        raise AssertionError(f"a valid request failed: {outs!r}") from outs
    final = outs[-1]
    assert final.finished and len(final.outputs) == request.params.n
    for c in final.outputs:
        assert len(c.token_ids) <= request.params.max_tokens
        if request.cancel_after is None:
            assert c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "length":
            assert len(c.token_ids) == request.params.max_tokens or \
                len(final.prompt_token_ids) + len(c.token_ids) == MAX_SEQ_LEN
        if c.finish_reason == "stop" and request.params.stop:
            assert not any(s in c.text for s in request.params.stop), (c.text, request.params.stop)
        if request.params.logprobs is not None:
            assert len(c.logprobs) == len(c.token_ids)


@pytest.fixture(scope="module")
def canary(session):
    """A greedy request whose output is known: the engine still serves it the same way."""
    params = greedy(8)
    expected = session.generate(prompt_token_ids=PROMPTS[0], sampling_params=params)[0].outputs[0].token_ids
    return params, expected


@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests=st.lists(st.one_of(valid(), st.sampled_from(INVALID)), min_size=1, max_size=6))
def test_random_request_mixes(session, canary, requests):
    note(f"hypothesis seed {SEED} (rerun with KILN_FUZZ_SEED={SEED})")
    results: dict[int, list] = {}
    threads = []
    for i, request in enumerate(requests):
        if isinstance(request, Invalid):
            refuse(session, request)  # refused at once, while the valid ones run
            continue
        thread = threading.Thread(target=run, args=(session, request, results, i))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a request never finished"
    for i, request in enumerate(requests):
        if isinstance(request, Valid):
            check_completed(request, results[i])

    stats = session.stats
    assert (stats["kv_blocks_used"], stats["running"], stats["waiting"]) == (0, 0, 0), stats
    params, expected = canary
    assert session.generate(prompt_token_ids=PROMPTS[0], sampling_params=params)[0].outputs[0].token_ids == expected
