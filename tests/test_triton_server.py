"""A real tritonserver serving a small float32 engine, driven with tritonclient: gRPC streaming
matches `Session.generate`, the token interface's options, HTTP generate and generate_stream on
the text interface, cancellation freeing every KV block, and bad requests refused one by one."""
from __future__ import annotations

import http.client
import itertools
import json
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tokenizers import Tokenizer

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session
from serving_metrics import kiln_samples
from triton_harness import (Stream, ended_since, metrics, post, run_server, server_engine, sse_events, token_request,
                            wait_for, wait_until_idle, word_list)

PROMPT = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def server(factory, tmp_path_factory):
    yield from run_server(factory, tmp_path_factory.mktemp("triton"))


@pytest.fixture(scope="module")
def session(factory):
    """The same engine in this process: what the server must reproduce."""
    with Session(server_engine(factory)) as s:
        yield s


def _expected(session: Session, prompt, **params) -> list[int]:
    return session.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(**params))[0].outputs[0].token_ids


def test_16_interleaved_grpc_streams_match_session_generate(server, session):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(2, 12))] for _ in range(16)]
    lengths = [rng.randint(4, 20) for _ in range(16)]
    options, params = [], []
    for i in range(16):
        logprobs = {"return_log_probs": True} if i % 4 == 1 else {}
        if i % 2:  # seeded sampling; 0.75 and 0.875 are exact in FP32, as the server receives them
            options.append({"temperature": 0.75, "runtime_top_p": 0.875, "random_seed": 1000 + i, **logprobs})
            params.append(SamplingParams(temperature=0.75, top_p=0.875, seed=1000 + i, max_tokens=lengths[i],
                                         logprobs=0 if logprobs else None))
        else:  # neither top-k nor top-p: greedy, as in TensorRT-LLM
            options.append(logprobs)
            params.append(SamplingParams(temperature=0, max_tokens=lengths[i], logprobs=0 if logprobs else None))
    expected = session.generate(prompt_token_ids=prompts, sampling_params=params)

    ids = [f"interleaved-{i}" for i in range(16)]
    with Stream(server.grpc_url) as stream:
        for i, rid in enumerate(ids):
            stream.send(rid, token_request(prompts[i], lengths[i], streaming=True, **options[i]))
        stream.wait_finished(ids, timeout=60)

    assert not stream.errors
    for i, rid in enumerate(ids):
        want = expected[i].outputs[0]
        responses = stream.responses[rid]
        assert stream.tokens(rid) == want.token_ids, f"request {i}"
        assert [r.final for r in responses] == [False] * (len(responses) - 1) + [True]
        # One response per token: streamed as generated, none lost or repeated.
        assert [len(r.tokens) for r in responses if r.tokens] == [1] * len(want.token_ids)
        if i % 4 == 1:
            logprobs = [float(r.outputs["output_log_probs"].reshape(-1)[0]) for r in responses if r.tokens]
            assert logprobs == pytest.approx([lp["logprob"] for lp in want.logprobs], abs=1e-4)
            cumulative = float(next(r for r in reversed(responses) if r.tokens).outputs["cum_log_probs"].reshape(-1)[0])
            assert cumulative == pytest.approx(sum(logprobs), abs=1e-3)
    # The requests really ran side by side: some request streamed while an earlier one had not finished. (Not
    # necessarily the first: on a loaded machine a short first request can finish before the next one arrives.)
    spans = sorted((stream.responses[r][0].at, stream.responses[r][-1].at) for r in ids)
    ends = itertools.accumulate((end for _, end in spans), max)
    assert any(start < end for (start, _), end in zip(spans[1:], ends)), f"no two requests overlapped: {spans}"


def test_non_streaming_returns_one_response_with_the_prompt(server, session):
    tokens = _expected(session, PROMPT, temperature=0, max_tokens=20)
    assert len(tokens) == 20
    with Stream(server.grpc_url) as stream:
        stream.send("whole", token_request(PROMPT, 20))
        stream.send("excluded", token_request(PROMPT, 20, exclude_input_in_output=True, streaming=False))
        stream.wait_finished(["whole", "excluded"], timeout=30)
    (whole,), (excluded,) = stream.responses["whole"], stream.responses["excluded"]
    assert whole.final and whole.tokens == PROMPT + tokens
    assert int(whole.outputs["sequence_length"].reshape(-1)[0]) == len(PROMPT) + 20
    assert excluded.final and excluded.tokens == tokens


def test_stop_words_bad_words_and_end_id(server, session):
    tokens = _expected(session, PROMPT, temperature=0, max_tokens=20)
    pair = tokens[5:7]
    first = next(e for e in range(2, 21) if tokens[e - 2:e] == pair)  # where the pair first ends
    cases = {
        # multi-token stop words are matched on the output ids; the output ends with the word
        "pair": ({"stop_words_list": word_list([pair])}, tokens[:first]),
        "padded": ({"stop_words_list": word_list([[tokens[9], 511, 511], pair])}, tokens[:first]),
        "single": ({"stop_words_list": word_list([[tokens[3]]])},
                   _expected(session, PROMPT, temperature=0, max_tokens=20, stop_token_ids=[tokens[3]])),
        "bad": ({"bad_words_list": word_list([[tokens[0]], [tokens[1], tokens[2]]])},
                _expected(session, PROMPT, temperature=0, max_tokens=20,
                          bad_words=[[tokens[0]], [tokens[1], tokens[2]]])),
        "end_id": ({"end_id": tokens[7]},
                   _expected(session, PROMPT, temperature=0, max_tokens=20, stop_token_ids=[tokens[7]],
                             ignore_eos=True)),
    }
    # end_id -1 is TensorRT-LLM's "no end token": refused before; now the output runs to
    # request_output_len, any eos generated like other tokens.
    cases["no_end"] = ({"end_id": -1}, _expected(session, PROMPT, temperature=0, max_tokens=20, ignore_eos=True))
    assert cases["bad"][1][0] != tokens[0] and cases["end_id"][1][-1] == tokens[7] and len(cases["no_end"][1]) == 20
    with Stream(server.grpc_url) as stream:
        for name, (options, _) in cases.items():
            stream.send(name, token_request(PROMPT, 20, streaming=True, **options))
        stream.wait_finished(list(cases), timeout=30)
    assert not stream.errors
    for name, (_, want) in cases.items():
        assert stream.tokens(name) == want, name
        assert stream.responses[name][-1].final


def test_http_generate_and_generate_stream_on_the_text_interface(server, session, factory):
    prompt = "The kiln was hot"
    text = session.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    status, body = post(server, "generate", {"text_input": prompt, "max_tokens": 12})
    assert status == 200 and json.loads(body)["text_output"] == text

    status, body = post(server, "generate_stream", {"text_input": prompt, "max_tokens": 12, "stream": True})
    assert status == 200 and "".join(e["text_output"] for e in sse_events(body)) == text
    # The token interface over HTTP streams one event per token (a one-element array arrives as a number).
    status, body = post(server, "generate_stream", {"input_ids": PROMPT, "request_output_len": 6, "streaming": True})
    events = [e for e in sse_events(body) if "output_ids" in e]
    assert status == 200 and [t for e in events for t in np.atleast_1d(e["output_ids"])] == _expected(
        session, PROMPT, temperature=0, max_tokens=6)
    assert len(events) == 6

    # Stop words as a list or as TensorRT-LLM's comma-separated string; bad words tokenized.
    stop = re.search(r'[^\ufffd\s,"]{2}', text[1:]).group()  # CSV-safe, and not where the text starts
    want = session.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop, "zzz"]))[0].outputs[0]
    for stop_words in ([stop, "zzz"], f"{stop},zzz"):
        status, body = post(server, "generate", {"text_input": prompt, "max_tokens": 12, "stop_words": stop_words})
        assert status == 200 and json.loads(body)["text_output"] == want.text
    tokenizer = Tokenizer.from_file(str(server_engine(factory) / "tokenizer.json"))
    first = session.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids
    bad = tokenizer.decode(first)
    bad_ids = [tokenizer.encode(bad, add_special_tokens=False).ids]
    want = session.generate(prompt, SamplingParams(temperature=0, max_tokens=12, bad_words=bad_ids))[0].outputs[0]
    status, body = post(server, "generate", {"text_input": prompt, "max_tokens": 12, "bad_words": [bad]})
    assert status == 200 and json.loads(body)["text_output"] == want.text != text


def test_cancelled_grpc_streams_return_every_kv_block(server):
    before = wait_until_idle(server)
    # 32 long requests: 16 run (the engine's batch), 16 wait; all are cancelled mid-way.
    ids = [f"cancel-{i}" for i in range(32)]
    with Stream(server.grpc_url) as stream:
        for i, rid in enumerate(ids):
            stream.send(rid, token_request([5 + i, 6, 7, 8], 58, min_length=58, streaming=True))
        # Cancel only once the model holds all 32: a request still in Triton's queue when its stream
        # is cancelled is dropped by Triton and never reaches the model, which then cannot count it.
        in_model = lambda m: m["running"] + m["waiting"] + sum(ended_since(before, m).values())  # noqa: E731
        assert wait_for(lambda: in_model(metrics(server)) == 32, 30), f"not all 32 reached the model: {metrics(server)}"
        assert metrics(server)["kv_used"] > 0, "the running requests hold no KV blocks"
        stream.close(cancel_requests=True)
    assert wait_for(lambda: sum(ended_since(before, metrics(server)).values()) == 32, 30), metrics(server)
    after = wait_until_idle(server)
    ended = ended_since(before, after)
    # The model sees a cancellation at its next poll of the client (every 0.1 s): a running request
    # whose last token came first ends by length, as it should. The 16 that waited for a slot
    # cannot finish that fast: each needs a running request to end, then 58 steps of its own.
    assert ended["cancelled"] + ended["length"] == 32 and ended["cancelled"] >= 16, ended


def test_http_client_gone_cancels_its_request(server):
    before = wait_until_idle(server)
    # 15 streams beside it fill the batch, so the HTTP request runs long enough to be cut short.
    ids = [f"beside-{i}" for i in range(15)]
    with Stream(server.grpc_url) as stream:
        for i, rid in enumerate(ids):
            stream.send(rid, token_request([9 + i, 6, 7, 8], 58, min_length=58, streaming=True))
        connection = http.client.HTTPConnection(server.host, server.ports.http, timeout=30)
        body = {"input_ids": [5, 6, 7, 8], "request_output_len": 58, "min_length": 58, "streaming": True}
        connection.request("POST", "/v2/models/kiln/generate_stream", json.dumps(body))
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data:")
        connection.close()
        stream.wait_finished(ids, timeout=60)
    after = wait_until_idle(server, finished_length=before.get("finished_length", 0) + 15)
    assert after["finished_cancelled"] - before.get("finished_cancelled", 0) == 1


def test_serving_metrics_on_the_metrics_port(server):
    """The same kiln: metrics as the OpenAI server's /metrics, from the same module."""
    def samples():
        with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
            return kiln_samples(r.read().decode(), "kiln")

    wait_until_idle(server)
    before = samples()
    with Stream(server.grpc_url) as stream:
        stream.send("counted", token_request(PROMPT, 8, min_length=8))
        stream.wait_finished(["counted"], timeout=30)
    assert len(stream.tokens("counted")) == len(PROMPT) + 8
    wait_until_idle(server)
    after = samples()
    delta = {name: after[name] - before[name] for name in after}
    assert delta["kiln:prompt_tokens_total"] == len(PROMPT) and delta["kiln:generation_tokens_total"] == 8
    assert delta["kiln:time_to_first_token_seconds_count"] == 1 and delta["kiln:e2e_request_latency_seconds_count"] == 1
    assert delta["kiln:inter_token_latency_seconds_count"] >= 1 and delta["kiln:e2e_request_latency_seconds_sum"] > 0
    assert wait_for(lambda: samples()["kiln:kv_cache_usage_perc"] == 0 and samples()["kiln:num_requests_running"] == 0,
                    5)


BAD_GRPC = {
    "missing-length": (lambda: token_request(PROMPT, 4)[:2], "request_output_len is missing"),
    "wrong-dtype": (lambda: token_request(PROMPT, 4, input_ids=np.array([PROMPT], np.float32)), "expects 'INT32'"),
    "batch-of-2": (lambda: token_request(PROMPT, 4, input_ids=np.array([PROMPT, PROMPT], np.int32),
                                         input_lengths=np.array([[4], [4]], np.int32),
                                         request_output_len=np.array([[4], [4]], np.int32)), "batch size 2"),
    "temperature": (lambda: token_request(PROMPT, 4, temperature=-1.0), "temperature must be >= 0"),
    "vocabulary": (lambda: token_request([5, 100000], 4), "input_ids holds token id 100000, outside the vocabulary"),
    "too-long": (lambda: token_request(PROMPT, 100), "request_output_len is 100: with the prompt's 4 tokens"),
    "mixed": (lambda: token_request(PROMPT, 4, max_tokens=4), "for the text interface"),
    "offsets": (lambda: token_request(PROMPT, 4, stop_words_list=np.array([[[5, 6], [3, -1]]], np.int32)),
                "end offsets"),
    "lengths": (lambda: token_request(PROMPT, 4, input_lengths=9), "input_lengths is 9"),
}


def test_bad_requests_get_invalid_arg_while_good_ones_complete(server, session):
    good = _expected(session, PROMPT, temperature=0, max_tokens=8)
    bad_http = [{"text_input": "hi", "max_tokens": 4, "top_p": 1.5}, {"text_input": "hi"},
                {"text_input": "hi", "max_tokens": 4, "stop_words": ["x"], "runtime_top_k": 2},
                {"text_input": "", "max_tokens": 4}]
    good_http = {"text_input": "The kiln was hot", "max_tokens": 8}
    good_ids = [f"good-{i}" for i in range(len(BAD_GRPC))]
    with Stream(server.grpc_url) as stream, ThreadPoolExecutor(8) as pool:
        for i, (name, (make, _)) in enumerate(BAD_GRPC.items()):
            stream.send(good_ids[i], token_request(PROMPT, 8, streaming=True))
            stream.send(name, make())
        replies = list(pool.map(lambda b: post(server, "generate", b), bad_http + [good_http] * 4))
        stream.wait_finished(good_ids + list(BAD_GRPC), timeout=60)

    for name, (_, message) in BAD_GRPC.items():
        assert len(stream.errors[name]) == 1 and message in stream.errors[name][0], (name, stream.errors[name])
        assert name not in stream.responses
    for rid in good_ids:
        assert stream.tokens(rid) == good and stream.responses[rid][-1].final and not stream.errors.get(rid)
    # Over HTTP the error code shows: INVALID_ARG is 400.
    assert [status for status, _ in replies[:4]] == [400, 400, 400, 400]
    assert "top_p" in replies[0][1] and "max_tokens is missing" in replies[1][1] and "token interface" in replies[2][1]
    assert "text_input is empty" in replies[3][1]
    text = session.generate("The kiln was hot", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert all(status == 200 and json.loads(body)["text_output"] == text for status, body in replies[4:])
    wait_until_idle(server)
