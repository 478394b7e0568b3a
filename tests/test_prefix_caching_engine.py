"""Prefix caching end to end on the CPU engine: the tokens are those of the same workload with
caching off (greedy, seeded, n > 1), under chunked prefill and under preemption, and the hit
counts are what the workload implies.

Two workloads: conversations whose every turn's prompt extends the previous turn's prompt and
output, and requests that share one system prompt.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kiln.runtime.arguments import ArgumentError
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)

BLOCK = 4  # the test engines' KV block size
# The preemption tests admit by free blocks: projected_peak admits too carefully to preempt in them.
POLICY = "max_utilization"


@dataclass
class Conversation:
    """A first prompt, then user turns: turn k's prompt is turn k-1's prompt, its first
    sample's output, and the user's tokens."""

    first: list[int]
    users: list[list[int]]
    params: list[SamplingParams]


def conversations(count: int, first_len: int, user_len: tuple[int, int], turns: int, max_tokens: int,
                  n2_turns: tuple[int, ...], seed: int) -> list[Conversation]:
    """Turns alternate greedy and seeded sampling; the turns in `n2_turns` draw two samples.
    Each conversation's first token is its own, so conversations share no block."""
    rng = random.Random(seed)
    convs = []
    for c in range(count):
        params = []
        for t in range(turns):
            n = 2 if t in n2_turns else 1
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n) if (c + t) % 2
                          else SamplingParams(temperature=0.8, seed=100 * c + t, max_tokens=max_tokens,
                                              ignore_eos=True, n=n))
        first = [3 + c] + [rng.randrange(3, 380) for _ in range(first_len - 1)]
        users = [[rng.randrange(3, 380) for _ in range(rng.randint(*user_len))] for _ in range(turns)]
        convs.append(Conversation(first, users, params))
    return convs


def run_conversations(engine_dir, convs: list[Conversation], caching: bool, **core_kw):
    """Every conversation's turns, in flight together; returns the outputs (per conversation, per
    turn, per sample), each turn's prompt, and the core (closed)."""
    core = EngineCore(engine_dir, device="cpu", prefix_caching=caching, **core_kw)
    try:
        history = [[] for _ in convs]
        turn = [0] * len(convs)
        outputs: list[list] = [[] for _ in convs]
        prompts: list[list] = [[] for _ in convs]
        live = {}
        steps = 0
        while any(t < len(c.users) for t, c in zip(turn, convs)) or core.has_work():
            for c, conv in enumerate(convs):
                if c not in live and turn[c] < len(conv.users):
                    prompt = (history[c] or conv.first) + conv.users[turn[c]]
                    prompts[c].append(prompt)
                    live[c] = core.add_request(f"c{c}-t{turn[c]}", prompt, conv.params[turn[c]])
            core.step()
            steps += 1
            assert steps < 3000, "the loop did not finish"
            for c, request in list(live.items()):
                if request.finished:
                    samples = [s.output_ids for s in sorted(request.seqs, key=lambda s: s.index)]
                    outputs[c].append(samples)
                    history[c] = request.prompt_ids + samples[0]
                    turn[c] += 1
                    del live[c]
        assert core.blocks.used_blocks() == 0, "KV blocks leaked"
    finally:
        core.close()
    return outputs, prompts, core


def multi_turn_hits(prompts: list[list[list[int]]], outputs: list[list]) -> int:
    """Tokens a turn finds cached, with nothing evicted: every full block of the previous turn's
    computed tokens (its prompt and output but the last token, whose KV no step computed)."""
    hits = 0
    for conv_prompts, conv_outputs in zip(prompts, outputs):
        for prompt, samples in zip(conv_prompts, conv_outputs[:-1]):
            hits += (len(prompt) + len(samples[0]) - 1) // BLOCK * BLOCK
    return hits


@pytest.fixture(scope="module")
def chunked_engine_dir(factory, checkpoint):
    """The session tests' model with 8 tokens a step, so most prompts are prefilled in chunks."""
    return factory.engine(checkpoint, dtype="float32", max_batch_size=MAX_BATCH_SIZE, max_num_tokens=8)


@pytest.mark.parametrize("engine", ["engine_dir", "chunked_engine_dir"])
def test_multi_turn_conversations_give_the_same_tokens_and_hit_their_history(engine, request):
    engine_dir = request.getfixturevalue(engine)
    convs = conversations(4, first_len=10, user_len=(3, 6), turns=3, max_tokens=7, n2_turns=(1,), seed=1)
    want, prompts, off = run_conversations(engine_dir, convs, caching=False)
    got, prompts_on, on = run_conversations(engine_dir, convs, caching=True)
    assert got == want and prompts_on == prompts
    assert any(len(set(map(tuple, samples))) > 1 for conv in got for samples in conv)  # seeded n=2 differ
    assert on.scheduler.num_preemptions == 0
    assert on.blocks.cache_queries == sum(len(p) for conv in prompts for p in conv)
    assert on.blocks.cache_hits == multi_turn_hits(prompts, got) > 0
    assert (off.blocks.cache_queries, off.blocks.cache_hits) == (0, 0)


def test_multi_turn_conversations_under_preemption(short_engine_dir):
    # 12 KV blocks for four conversations of up to 8 blocks each: sequences are preempted, and
    # cached blocks evicted, all along.
    convs = conversations(4, first_len=8, user_len=(3, 3), turns=3, max_tokens=5, n2_turns=(0,), seed=2)
    want, _, off = run_conversations(short_engine_dir, convs, caching=False, max_kv_tokens=48, policy=POLICY)
    got, _, on = run_conversations(short_engine_dir, convs, caching=True, max_kv_tokens=48, policy=POLICY)
    assert got == want
    assert off.scheduler.num_preemptions > 0 and on.scheduler.num_preemptions > 0
    assert on.blocks.cache_hits > 0


def shared_prompt_requests(system_len: int, count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """`count` requests: one system prompt and a user part of their own (whose first token is
    theirs alone), greedy and seeded, some with n = 2."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 380) for _ in range(system_len)]
    requests = []
    for i in range(count):
        user = [400 + i] + [rng.randrange(3, 380) for _ in range(rng.randint(3, 5))]
        params = (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True, n=1 + (i % 4 == 0)))
        requests.append((system + user, params))
    return requests


def run_together(engine_dir, requests, caching: bool, **core_kw) -> tuple[list, EngineCore]:
    """The requests submitted at once and run to the end; their samples' token ids, and the core (closed)."""
    core = EngineCore(engine_dir, device="cpu", prefix_caching=caching, **core_kw)
    try:
        handles = [core.add_request(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
        while core.has_work():
            core.step()
        assert core.blocks.used_blocks() == 0, "KV blocks leaked"
    finally:
        core.close()
    return [[s.output_ids for s in sorted(r.seqs, key=lambda s: s.index)] for r in handles], core


@pytest.mark.parametrize("engine", ["engine_dir", "chunked_engine_dir"])
def test_a_shared_system_prompt_is_computed_once(engine, request):
    engine_dir = request.getfixturevalue(engine)
    requests = shared_prompt_requests(system_len=13, count=6, seed=3)
    want, off = run_together(engine_dir, requests, caching=False)
    got, on = run_together(engine_dir, requests, caching=True)
    assert got == want
    # The first request admitted computes the system prompt; every other one finds its three
    # full blocks (12 tokens), in the same step or a later one. The 13th token shares its block
    # with the request's own tokens.
    assert on.blocks.cache_queries == sum(len(p) for p, _ in requests)
    assert on.blocks.cache_hits == 5 * 12
    computed = {name: sum(len(p) for p, _ in requests) - core.blocks.cache_hits for name, core in
                (("off", off), ("on", on))}
    assert computed["on"] == computed["off"] - 60


def test_a_shared_system_prompt_under_preemption(short_engine_dir):
    # 12 KV blocks; each request holds up to 6 per sample.
    requests = shared_prompt_requests(system_len=9, count=6, seed=4)
    want, off = run_together(short_engine_dir, requests, caching=False, max_kv_tokens=48, policy=POLICY)
    got, on = run_together(short_engine_dir, requests, caching=True, max_kv_tokens=48, policy=POLICY)
    assert got == want
    assert off.scheduler.num_preemptions > 0 and on.scheduler.num_preemptions > 0 and on.blocks.cache_hits > 0


def test_a_repeated_prompt_recomputes_only_its_last_token(engine_dir):
    # Whole blocks only: the second time, every token is cached, and the last block is copied so
    # its last token can be computed again for the logits.
    prompts = [PROMPTS[i][:4] * 3 for i in range(40, 44) if len(PROMPTS[i]) >= 4][:3]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, n=2),
              SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True)][:len(prompts)]
    with Session(engine_dir, device="cpu", prefix_caching=False) as plain:
        want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    with Session(engine_dir, device="cpu") as session:
        for _ in range(2):
            got = session.generate(prompt_token_ids=prompts, sampling_params=params)
            assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
        assert session.stats["prefix_cache_hits"] == sum(len(p) - 1 for p in prompts)


def test_identical_prompts_admitted_in_one_step_copy_no_unwritten_block(engine_dir):
    # Whole blocks, four times in one step: the first computes them, and the others find them
    # cached but not yet written, so they cannot copy the last one; they recompute that block.
    prompt = PROMPTS[50][:2] * 4
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 4
    want, _ = run_together(engine_dir, [(prompt, p) for p in params], caching=False)
    got, core = run_together(engine_dir, [(prompt, p) for p in params], caching=True)
    assert got == want
    assert core.blocks.cache_hits == 3 * 4  # the first block each: the second is the one being written


def test_session_reports_the_prefix_cache_and_an_idle_pool(engine_dir):
    requests = shared_prompt_requests(system_len=13, count=3, seed=5)
    prompts, params = [p for p, _ in requests], [p for _, p in requests]
    with Session(engine_dir, device="cpu") as session:
        first = session.generate(prompt_token_ids=prompts[:1], sampling_params=params[:1])
        rest = session.generate(prompt_token_ids=prompts[1:], sampling_params=params[1:])
        stats = session.stats
    with Session(engine_dir, device="cpu", prefix_caching=False) as plain:
        want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
        plain_stats = plain.stats
    assert [[c.token_ids for c in o.outputs] for o in first + rest] == [[c.token_ids for c in o.outputs] for o in want]
    assert stats["prefix_cache_queries"] == sum(map(len, prompts)) and stats["prefix_cache_hits"] == 2 * 12
    # Idle: no block is held; the cached ones count as free for admission.
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_cached"] > 0
    assert (plain_stats["prefix_cache_queries"], plain_stats["prefix_cache_hits"],
            plain_stats["kv_blocks_cached"], plain_stats["kv_blocks_used"]) == (0, 0, 0, 0)


def test_prefix_caching_must_be_a_bool(engine_dir):
    with pytest.raises(ArgumentError, match="prefix_caching must be True or False, got 'no'"):
        Session(engine_dir, device="cpu", prefix_caching="no")
