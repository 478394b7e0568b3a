"""The OpenAI-compatible server, driven with the official `openai` client and with plain HTTP:
its greedy output equals the Session's, streamed and not, completions and chat, n = 2, logprobs,
usage and finish reasons; errors in OpenAI's shape with the right status, each failing alone;
503 while the engine loads; a client that disconnects frees its KV blocks; the metrics page; the
serve-engine command."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session
from kiln.runtime.openai.app import ServerState
from kiln.runtime.openai.cli import serve_engine
from openai_harness import MODEL, RunningServer, request, serve, wait_idle
from serving_metrics import kiln_samples

PROMPTS = ["The kiln was hot", "Once upon a time"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a kiln?"}]


@pytest.fixture(scope="module")
def engine(factory):
    return factory.engine(factory.checkpoint("llama3"), dtype="float32")


@pytest.fixture(scope="module")
def server(engine):
    with serve(lambda: Session(engine)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _generate(session: Session, prompt, **params):
    return session.generate(prompt, SamplingParams(**params))[0]


def _chat(session: Session, messages, **params):
    return session.chat(messages, SamplingParams(**params))[0]


def test_completions_greedy_equal_session_generate(server, client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    prompt_tokens = completion_tokens = 0
    for prompt, choice in zip(PROMPTS, response.choices):
        want = _generate(server.session, prompt, temperature=0, max_tokens=12)
        assert choice.text == want.outputs[0].text and choice.finish_reason == want.outputs[0].finish_reason
        prompt_tokens += len(want.prompt_token_ids)
        completion_tokens += len(want.outputs[0].token_ids)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert response.usage.total_tokens == prompt_tokens + completion_tokens
    assert response.model == MODEL and response.object == "text_completion"

    # Token ids as the prompt, and the default max_tokens of 16.
    ids = server.session.tokenizer.encode(PROMPTS[0]).ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0)
    assert by_ids.choices[0].text == _generate(server.session, PROMPTS[0], temperature=0, max_tokens=16).outputs[0].text


def test_completions_stream_the_same_text(server, client):
    want = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0).choices[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text and len(text) > 0
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == want.finish_reason and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_equals_session_chat_streamed_or_not(server, client):
    want = _chat(server.session, CHAT, temperature=0, max_tokens=16).outputs[0]
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason and response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(server.session.apply_chat_template(CHAT, tokenize=True))
    assert response.usage.completion_tokens == len(want.token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason and chunks[-1].object == "chat.completion.chunk"


def test_chat_without_max_tokens_may_fill_the_engine(server, client):
    prompt = len(server.session.apply_chat_template(CHAT, tokenize=True))
    response = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == server.session.max_seq_len - prompt
    assert response.choices[0].finish_reason == "length"


def test_n_2_seeded_samples_equal_the_sessions(server, client):
    options = dict(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=10)
    want = _generate(server.session, PROMPTS[0], **options)
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], **options)
    assert [c.text for c in response.choices] == [c.text for c in want.outputs]
    assert response.choices[0].text != response.choices[1].text
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)

    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **options):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    chat = _chat(server.session, CHAT, **options)
    assert [texts[0], texts[1]] == [c.text for c in chat.outputs]


def test_logprobs_equal_the_sessions(server, client):
    want = _generate(server.session, PROMPTS[0], temperature=0, max_tokens=6, logprobs=2).outputs[0]
    legacy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                       logprobs=2).choices[0].logprobs
    assert legacy.token_logprobs == pytest.approx([e["logprob"] for e in want.logprobs], abs=1e-5)
    tokenizer = server.session.tokenizer
    assert legacy.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert all(len(top) >= 1 for top in legacy.top_logprobs) and len(legacy.text_offset) == 6

    wanted = _chat(server.session, CHAT, temperature=0, max_tokens=6, logprobs=3).outputs[0].logprobs
    content = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                             top_logprobs=3).choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([e["logprob"] for e in wanted], abs=1e-5)
    assert [t.logprob for e in content for t in e.top_logprobs] == pytest.approx(
        [lp for e in wanted for _, lp in e["top"]], abs=1e-5)
    assert all(len(e.top_logprobs) == 3 for e in content)
    assert all(bytes(e.bytes).decode() == e.token for e in content)

    streamed = [e.logprob for chunk in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True)
        for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == pytest.approx([e["logprob"] for e in wanted], abs=1e-5)


def test_stop_strings_end_with_finish_reason_stop(server, client):
    full = _generate(server.session, PROMPTS[0], temperature=0, max_tokens=16).outputs[0].text
    stop = full[4:6]
    want = _generate(server.session, PROMPTS[0], temperature=0, max_tokens=16, stop=[stop]).outputs[0]
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                       stop=stop).choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, "stop") and stop not in choice.text


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert request(server, "GET", "/health") == (200, {"status": "ok"})


CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
BAD_REQUESTS = [
    # path, body, status, param, words of the message
    (COMPLETIONS_PATH, {"prompt": "x", "n": "2"}, 400, "n", "n must be an int, got '2'"),
    (COMPLETIONS_PATH, {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    (COMPLETIONS_PATH, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1]"),
    (COMPLETIONS_PATH, {"prompt": "x", "max_tokens": 500}, 400, "max_tokens", "exceeds the engine's max_seq_len"),
    (COMPLETIONS_PATH, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "must be in [-2, 2]"),
    (COMPLETIONS_PATH, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "must be in [0, 20]"),
    (COMPLETIONS_PATH, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed with stream: true"),
    (COMPLETIONS_PATH, {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "not a parameter this endpoint knows"),
    (COMPLETIONS_PATH, {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
    (COMPLETIONS_PATH, {"prompt": ["x", ""]}, 400, "prompt", "(prompt 1)"),
    (COMPLETIONS_PATH, {"prompt": [5, 100000]}, 400, "prompt", "outside the vocabulary"),
    (COMPLETIONS_PATH, {"prompt": [[5], "x"]}, 400, "prompt", "do not mix them"),
    (COMPLETIONS_PATH, {"max_tokens": 4}, 400, "prompt", "prompt is missing"),
    (COMPLETIONS_PATH, {"prompt": "x", "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist"),
    (CHAT_PATH, {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "max_completion_tokens must be >= 1"),
    (CHAT_PATH, {"messages": CHAT, "max_completion_tokens": 60}, 400, "max_completion_tokens",
     "exceeds the engine's max_seq_len"),
    (CHAT_PATH, {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    (CHAT_PATH, {"messages": CHAT, "logprobs": "yes"}, 400, "logprobs", "must be a bool"),
    (CHAT_PATH, {"messages": []}, 400, "messages", "messages is empty"),
    (CHAT_PATH, {"messages": [{"role": "tool", "content": "4"}]}, 400, "messages",
     "refused by the engine's chat template: Conversation roles must be system, user or assistant"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "word " * 80}]}, 400, "messages",
     "the engine's max_seq_len is 64"),
    (CHAT_PATH, {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    (CHAT_PATH, {"messages": CHAT, "n": 40, "max_tokens": 10}, 400, "n", "lower n or max_tokens"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD_REQUESTS,
                         ids=[f"{p.split('/v1/')[1]}-{w[:30]}" for p, _, _, _, w in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_naming_the_parameter(server, path, body, status, param, words):
    got, answer = request(server, "POST", path, {"model": MODEL, **body} if status != 404 else body)
    assert got == status, answer
    error = answer["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}


def test_malformed_bodies_and_unknown_routes(server):
    status, answer = request(server, "POST", COMPLETIONS_PATH, raw=b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer = request(server, "POST", CHAT_PATH, body=[1, 2])
    assert status == 400 and "must be a JSON object, got list" in answer["error"]["message"]
    status, answer = request(server, "GET", "/v1/engines")
    assert status == 404 and "no route GET /v1/engines" in answer["error"]["message"]


def test_a_bad_request_fails_alone(server, client):
    """Good requests in flight beside bad ones all complete, and the pool is whole afterwards."""
    want = _generate(server.session, PROMPTS[0], temperature=0, max_tokens=12).outputs[0].text
    results = {}

    def good(i):
        results[i] = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)

    threads = [threading.Thread(target=good, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    bad = [request(server, "POST", path, {"model": MODEL, **body}) for path, body, *_ in BAD_REQUESTS[:6]]
    for t in threads:
        t.join(60)
    assert all(status == 400 for status, _ in bad)
    assert [results[i].choices[0].text for i in range(4)] == [want] * 4
    wait_idle(server.session)


def test_503_while_the_engine_loads_then_200(engine):
    release = threading.Event()

    def load():
        release.wait(30)
        return Session(engine)

    with serve(load, wait_loaded=False) as loading:
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", COMPLETIONS_PATH)):
            status, answer = request(loading, method, path, {"model": MODEL, "prompt": "x"})
            assert status == 503 and answer["error"]["code"] == "engine_loading", (path, answer)
        release.set()
        deadline = time.monotonic() + 60
        while request(loading, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, answer = request(loading, "POST", COMPLETIONS_PATH, {"prompt": "x", "max_tokens": 2})
        assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_a_failed_load_is_a_500_naming_why(tmp_path):
    reported = []
    with serve(lambda: Session(tmp_path), on_load_failure=reported.append) as failed:
        status, answer = request(failed, "GET", "/health")
    assert status == 500 and answer["error"]["code"] == "engine_failed"
    message = answer["error"]["message"]
    assert message.startswith("the engine failed to load:") and reported == [message]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(server, stream):
    """31 long requests beside it fill the batch; once its client hangs up, the request leaves the
    batch while they still run (left running, it would end with them)."""
    session = server.session
    wait_idle(session)
    long = SamplingParams(temperature=0, max_tokens=58, min_tokens=58)
    beside = [session.stream(prompt_token_ids=[9 + i, 6, 7], sampling_params=long) for i in range(31)]
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    # logprobs: every token makes a chunk, whatever text it decodes to
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 58, "min_tokens": 58, "logprobs": 0, "stream": stream}
    connection.request("POST", COMPLETIONS_PATH, json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    deadline = time.monotonic() + 30
    while session.stats["running"] < 32:
        assert time.monotonic() < deadline, session.stats
        time.sleep(0.002)
    connection.close()
    while (running := session.stats["running"]) == 32:
        assert time.monotonic() < deadline, session.stats
        time.sleep(0.002)
    assert running == 31
    assert all(len(list(outputs)[-1].outputs[0].token_ids) == 58 for outputs in beside)
    wait_idle(session)


def test_metrics_page_counts_what_was_served(server, client):
    wait_idle(server.session)
    before = kiln_samples(request(server, "GET", "/metrics")[1], MODEL)
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, temperature=0, n=2,
                                              extra_body={"min_tokens": 7})
    wait_idle(server.session)
    after = kiln_samples(request(server, "GET", "/metrics")[1], MODEL)
    delta = {name: after[name] - before[name] for name in after}
    assert delta["kiln:generation_tokens_total"] == 14 == response.usage.completion_tokens
    assert delta["kiln:prompt_tokens_total"] == response.usage.prompt_tokens
    assert delta["kiln:time_to_first_token_seconds_count"] == 1 and delta["kiln:e2e_request_latency_seconds_count"] == 1
    assert delta["kiln:inter_token_latency_seconds_count"] >= 6
    assert after["kiln:num_requests_running"] == 0 and after["kiln:kv_cache_usage_perc"] == 0
    assert after["kiln:prefix_cache_queries_total"] >= after["kiln:prefix_cache_hits_total"] >= 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_engine_command(engine):
    port = _free_port()
    command = [str(Path(sys.executable).parent / "serve-engine"), "--engine", str(engine), "--port", str(port),
               "--model-name", MODEL]
    at = RunningServer("127.0.0.1", port, ServerState())
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                status, _ = request(at, "GET", "/health")
                if status == 200:
                    break
            except ConnectionError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
            time.sleep(0.2)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused") as client:
            answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens <= 4 and answer.choices[0].message.content is not None
    finally:
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=60)[0]
    assert process.returncode == 0, output


def test_serve_engine_refuses_a_taken_port_before_loading(engine):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(serve_engine, ["--engine", str(engine), "--port", str(port)])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output
    result = CliRunner().invoke(serve_engine, ["--engine", str(engine), "--max-kv-tokens", "0"])
    assert result.exit_code == 2 and "--max-kv-tokens" in result.output and "must be >= 1" in result.output
