"""A bounded load test of the Triton backend: 200 concurrent streaming requests over four gRPC
streams on a small CPU engine all complete with the right tokens, none lost or duplicated, and
every KV block is free afterwards. Prints the server's throughput and latency."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session
from triton_harness import Stream, run_server, server_engine, token_request, wait_until_idle

REQUESTS, STREAMS, OUTPUT_LEN = 200, 4, 8


@pytest.fixture(scope="module")
def server(factory, tmp_path_factory):
    yield from run_server(factory, tmp_path_factory.mktemp("triton-load"))


def test_200_concurrent_streaming_requests(server, factory, capsys):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(2, 16))] for _ in range(10)]
    # min_length = request_output_len: every request streams exactly OUTPUT_LEN tokens.
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, min_tokens=OUTPUT_LEN)
    with Session(server_engine(factory)) as session:
        expected = [o.outputs[0].token_ids for o in session.generate(prompt_token_ids=prompts, sampling_params=params)]
    before = wait_until_idle(server)

    streams = [Stream(server.grpc_url) for _ in range(STREAMS)]
    owner = {}
    start = time.perf_counter()
    try:
        for i in range(REQUESTS):
            rid, stream = f"load-{i}", streams[i % STREAMS]
            owner[rid] = stream
            stream.send(rid, token_request(prompts[i % 10], OUTPUT_LEN, min_length=OUTPUT_LEN, streaming=True))
        for stream in streams:
            left = 120 - (time.perf_counter() - start)  # the whole test's bound
            stream.wait_finished([r for r in owner if owner[r] is stream], timeout=max(1.0, left))
        wall = time.perf_counter() - start
    finally:
        for stream in streams:
            stream.close()

    ttft, latency = [], []
    for i, (rid, stream) in enumerate(owner.items()):
        responses = stream.responses[rid]
        assert not stream.errors.get(rid), stream.errors[rid]
        assert [r.final for r in responses] == [False] * (len(responses) - 1) + [True], rid
        assert [len(r.tokens) for r in responses if r.tokens] == [1] * OUTPUT_LEN, rid  # none lost or repeated
        assert stream.tokens(rid) == expected[i % 10], rid
        ttft.append(next(r.at for r in responses if r.tokens) - stream.sent_at[rid])
        latency.append(responses[-1].at - stream.sent_at[rid])
    assert sum(len(s.responses) for s in streams) == REQUESTS and not any(s.errors for s in streams)
    after = wait_until_idle(server, finished_length=before.get("finished_length", 0) + REQUESTS)
    assert after["kv_used"] == 0 and after["finished_length"] - before.get("finished_length", 0) == REQUESTS

    p = lambda values, q: 1000 * float(np.percentile(values, q))  # noqa: E731
    report = (f"\nTriton load test: {REQUESTS} streaming requests x {OUTPUT_LEN} tokens over {STREAMS} gRPC streams "
              f"in {wall:.2f} s: {REQUESTS * OUTPUT_LEN / wall:.0f} tokens/s, {REQUESTS / wall:.1f} requests/s; "
              f"TTFT p50 {p(ttft, 50):.0f} ms p99 {p(ttft, 99):.0f} ms; latency p50 {p(latency, 50):.0f} ms "
              f"p99 {p(latency, 99):.0f} ms; KV blocks peak {after['kv_peak']:.0f}/{after['kv_total']:.0f}")
    with capsys.disabled():  # shown in every run, not only with -s
        print(report)
