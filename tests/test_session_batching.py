"""Session: batching is invisible in the outputs (against each request alone and `transformers`),
and a small KV pool still serves everything, by preemption or by admission control; cancelled
requests free their blocks."""
from __future__ import annotations

import random
import time

import pytest

from kiln.runtime.scheduler import POLICIES
from kiln.runtime.session import Session

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)

# -- 1. batching is invisible in the outputs ---------------------------------------------------------

def test_batch_at_once_matches_alone_and_transformers(session, alone, hf_greedy, monkeypatch):
    steps = record_steps(session, monkeypatch)
    params = [greedy(k) for k in MAX_TOKENS]
    outs = session.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    batch_steps = list(steps)

    for out, prompt, p in zip(outs, PROMPTS, params):
        assert out.finished and out.prompt_token_ids == prompt
        [sample] = out.outputs
        assert (sample.index, sample.finish_reason, len(sample.token_ids)) == (0, "length", p.max_tokens)
        assert sample.token_ids == alone(prompt, p)
        assert sample.token_ids == hf_greedy(prompt, p.max_tokens)

    for chunks in batch_steps:
        assert sum(n for *_, n in chunks) <= MAX_NUM_TOKENS and len(chunks) <= MAX_BATCH_SIZE
    assert max(len(chunks) for chunks in batch_steps) == MAX_BATCH_SIZE
    # Chunked prefill: some prompt was cut where a step's token budget ran out...
    assert any(cached + n < prompt for chunks in batch_steps for _, prompt, cached, n in chunks)
    # ...and in-flight batching: some step decodes one sequence while prefilling another.
    assert any({cached >= prompt for _, prompt, cached, _ in chunks} == {True, False} for chunks in batch_steps)


def test_prompt_longer_than_the_token_budget_is_split(session, alone, hf_greedy, monkeypatch):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 380) for _ in range(45)]
    steps = record_steps(session, monkeypatch)
    tokens = alone(prompt, greedy(12))
    assert [(cached, n) for chunks in steps for _, _, cached, n in chunks][:3] == [(0, 32), (32, 13), (45, 1)]
    assert tokens == hf_greedy(prompt, 12)


def test_staggered_threads_match_alone(session, alone, hf_greedy):
    results: dict[int, list[int]] = {}

    def streamer(t: int):
        rng = random.Random(t)
        for i in range(t, 64, 4):
            time.sleep(rng.uniform(0, 0.004))
            outs = list(session.stream(prompt_token_ids=PROMPTS[i], sampling_params=greedy(MAX_TOKENS[i])))
            # One output per new token; only the last is finished.
            assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, MAX_TOKENS[i] + 1))
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            results[i] = outs[-1].outputs[0].token_ids

    def generator(t: int):
        rng = random.Random(t)
        mine = list(range(t, 64, 4))
        while mine:
            k = rng.randint(1, 4)
            take, mine = mine[:k], mine[k:]
            time.sleep(rng.uniform(0, 0.004))
            outs = session.generate(prompt_token_ids=[PROMPTS[i] for i in take],
                                    sampling_params=[greedy(MAX_TOKENS[i]) for i in take])
            results.update((i, o.outputs[0].token_ids) for i, o in zip(take, outs))

    run_threads([lambda t=t: (streamer if t % 2 == 0 else generator)(t) for t in range(4)])
    assert sorted(results) == list(range(64))
    for i, tokens in results.items():
        assert tokens == alone(PROMPTS[i], greedy(MAX_TOKENS[i])), f"request {i}"
        assert tokens == hf_greedy(PROMPTS[i], MAX_TOKENS[i]), f"request {i}"


# -- 2. a small KV pool: preemption, and cancellation ------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_small_kv_pool_gives_the_same_outputs(short_engine_dir, alone, policy):
    prompts = PROMPTS[:16]
    params = [greedy(8 + i % 9) for i in range(16)]  # at most 20 + 16 tokens: 9 of the 12 blocks
    with Session(short_engine_dir, max_kv_tokens=48, policy=policy) as small:
        assert small.stats["kv_blocks_total"] == 12
        outs = small.generate(prompt_token_ids=prompts, sampling_params=params)
        stats = small.stats
    for out, prompt, p in zip(outs, prompts, params):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == alone(prompt, p)
    assert (stats["kv_blocks_used"], stats["running"], stats["waiting"]) == (0, 0, 0)
    # projected_peak may preempt here or not: its guesses come from the requests that finished.
    if policy == "guaranteed_no_evict":
        assert stats["preemptions"] == 0
    elif policy == "max_utilization":
        assert stats["preemptions"] > 0


@pytest.fixture(params=[None, 64], ids=["default-pool", "16-block-pool"])
def any_pool_session(request, engine_dir, session):
    """The module's session, or one whose small KV pool makes requests preempt each other."""
    if request.param is None:
        yield session
    else:
        with Session(engine_dir, max_kv_tokens=request.param, policy="max_utilization") as small:
            yield small


def test_cancel_mid_stream_frees_every_block(any_pool_session, alone):
    session = any_pool_session
    max_tokens = 40  # far more than the 2 tokens after which a client gives up
    prompts = PROMPTS[16:28]
    finals: dict[int, list] = {}

    def client(i: int):
        outs = []
        for out in session.stream(prompt_token_ids=prompts[i], sampling_params=greedy(max_tokens)):
            outs.append(out)
            if len(outs) == 2 and i % 3 == 0:
                break  # closing the stream cancels the request
            if len(outs) == 2 and i % 3 == 1:
                session.cancel(out.request_id)
        finals[i] = outs

    run_threads([lambda i=i: client(i) for i in range(len(prompts))])
    for i, outs in finals.items():
        last = outs[-1].outputs[0]
        full = alone(prompts[i], greedy(max_tokens))
        if i % 3 == 0:
            assert len(outs) == 2 and not outs[-1].finished
        elif i % 3 == 1:
            assert outs[-1].finished and last.finish_reason == "cancelled"
            assert 2 <= len(last.token_ids) < max_tokens and last.token_ids == full[:len(last.token_ids)]
        else:
            assert last.finish_reason == "length" and last.token_ids == full
    stats = session.stats
    assert (stats["kv_blocks_used"], stats["running"], stats["waiting"]) == (0, 0, 0)
    # In the small pool, requests were also cancelled while preempted or sharing the pool tightly.
    assert (stats["preemptions"] > 0) == (stats["kv_blocks_total"] == 16)
    with session._locked():
        assert session._core.requests == {} and session._sinks == {}
    session.cancel("req-unknown")  # a finished or unknown id is a no-op
