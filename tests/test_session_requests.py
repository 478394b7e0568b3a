"""Session: sampling independent of the batch, refused requests, and parallel samples that share
the prompt's KV blocks."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from kiln.runtime.engine_core import EngineCore
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)

# -- 3. sampling ------------------------------------------------------------------------------------

def test_seeded_sampling_is_independent_of_the_batch(session, alone):
    prompt = PROMPTS[40]
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    rng = random.Random(3)
    others = [SamplingParams(temperature=rng.choice((0, 0.7, 1.0, 1.3)), top_k=rng.choice((0, 1, 20)),
                             top_p=rng.choice((1.0, 0.8)), seed=rng.choice((None, rng.randrange(10**6))),
                             max_tokens=rng.randint(4, 16), ignore_eos=True) for _ in range(20)]
    other_prompts = [PROMPTS[i] for i in range(41, 61)]

    want = alone(prompt, target)
    assert want != alone(prompt, greedy(12))  # really sampled
    # All at once, the seeded request in the middle of the batch...
    outs = session.generate(prompt_token_ids=other_prompts[:10] + [prompt] + other_prompts[10:],
                            sampling_params=others[:10] + [target] + others[10:])
    assert outs[10].outputs[0].token_ids == want
    # ...and joining a batch already in flight.
    started = threading.Event()
    got = []

    def busy():
        for out in session.stream(prompt_token_ids=other_prompts[0], sampling_params=others[0]):
            started.set()
        session.generate(prompt_token_ids=other_prompts[1:], sampling_params=others[1:])

    def seeded():
        assert started.wait(30)
        got.append(session.generate(prompt_token_ids=[prompt], sampling_params=[target])[0])

    run_threads([busy, seeded])
    assert got[0].outputs[0].token_ids == want


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p=1e-6"])
def test_degenerate_sampling_equals_greedy(session, alone, params):
    prompts = PROMPTS[:6]
    outs = session.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=1.0, max_tokens=10, ignore_eos=True, **params))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == alone(prompt, greedy(10))


# -- 4. refused requests --------------------------------------------------------------------------

def in_flight(session: Session, prompts: list[list[int]], max_tokens: int):
    """Stream each prompt from a thread of its own; returns once every one has its first token,
    with the dict its final outputs will be put in and the threads to join."""
    started, finals = [threading.Event() for _ in prompts], {}

    def client(i: int):
        for out in session.stream(prompt_token_ids=prompts[i], sampling_params=greedy(max_tokens)):
            started[i].set()
        finals[i] = out

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started)
    return finals, threads


def request_ids(session: Session) -> set[str]:
    with session._locked():
        return set(session._core.requests)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_token_ids=[5] * (MAX_SEQ_LEN + 1)), "prompt has 65 tokens; the engine's max_seq_len is 64"),
    (dict(prompt_token_ids=[5] * 60, sampling_params=SamplingParams(max_tokens=5)),
     r"max_tokens is 5: with the prompt's 60 tokens that exceeds the engine's max_seq_len 64: lower it to 4"),
    (dict(prompt_token_ids=[]), "prompt_token_ids is empty"),
    (dict(prompt_token_ids=[5, VOCAB]), r"prompt_token_ids holds token id 512, outside the vocabulary \(0..511\)"),
    (dict(prompt_token_ids=[5, -1]), r"prompt_token_ids holds token id -1, outside the vocabulary"),
    (dict(prompt_token_ids=[5, 6], sampling_params={"max_tokens": 3}), "must be a SamplingParams, got dict"),
])
def test_bad_requests_are_refused_while_others_run(session, alone, kwargs, message):
    prompts = PROMPTS[28:30]
    finals, threads = in_flight(session, prompts, 30)
    before = request_ids(session)

    with pytest.raises(ValueError, match=message):
        session.stream(**kwargs)
    batch = dict(kwargs, prompt_token_ids=[[7, 8, 9], kwargs["prompt_token_ids"]])
    if "sampling_params" in kwargs:
        batch["sampling_params"] = [SamplingParams(max_tokens=3), kwargs["sampling_params"]]
    with pytest.raises(ValueError, match=message):
        session.generate(**batch)
    # Refused before anything runs: not even the good request of the batch was submitted.
    assert request_ids(session) <= before

    for t in threads:
        t.join(60)
    for i, prompt in enumerate(prompts):
        assert finals[i].outputs[0].token_ids == alone(prompt, greedy(30))


def test_requests_that_can_never_fit_the_kv_pool_are_refused(short_engine_dir, alone):
    with Session(short_engine_dir, max_kv_tokens=48) as small:  # 12 blocks: one sequence of max_seq_len
        finals, threads = in_flight(small, [PROMPTS[30]], 12)
        with pytest.raises(ValueError, match="n is 4: 4 samples of up to 16 tokens need up to 16 KV blocks but the "
                                             "pool has 12"):
            small.stream(prompt_token_ids=[5] * 4, sampling_params=SamplingParams(n=4, max_tokens=12))
        with pytest.raises(ValueError, match="need up to 15 KV blocks but the pool has 12"):
            small.generate(prompt_token_ids=[5] * 4, sampling_params=SamplingParams(n=5, max_tokens=8))
        for t in threads:
            t.join(60)
        assert small.stats["kv_blocks_used"] == 0
    assert finals[0].outputs[0].token_ids == alone(PROMPTS[30], greedy(12))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n must"),
    (dict(beam_width=2), "beam_width is not a sampling parameter"),
])
def test_invalid_sampling_params_raise_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# -- 5. parallel samples share the prompt's blocks -----------------------------------------------

def test_n_samples_share_the_prompt_blocks(engine_dir, session):
    core = EngineCore(engine_dir)
    rng = random.Random(2)
    prompt = [rng.randrange(3, 380) for _ in range(10)]  # 2 full blocks and 2 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    request = core.add_request("r", prompt, params)
    while len(request.seqs) < 4:
        core.step()
    blocks = core.blocks
    tables = [blocks.table(s.seq_id) for s in request.seqs]
    assert tables == [tables[0]] * 4 and len(tables[0]) == 3
    assert [blocks.ref_count(b) for b in tables[0]] == [4, 4, 4]
    assert blocks.used_blocks() == 3  # one sequence's worth, not 4 x 3

    core.step()  # each sample writes its first token: the shared partial block is copied
    tables = [blocks.table(s.seq_id) for s in request.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert [blocks.ref_count(b) for b in tables[0][:2]] == [4, 4]
    tails = [t[2] for t in tables]
    assert len(set(tails)) == 4 and all(blocks.ref_count(b) == 1 for b in tails)
    assert blocks.used_blocks() == 2 + 4 < 4 * 3
    # The copies kept the prompt's keys and values (slots 0 and 1 of the block).
    kv = core.executor.kv_cache
    for b in tails[1:]:
        assert torch.equal(kv[:, :, b, :2], kv[:, :, tails[0], :2])

    while core.has_work():
        core.step()
    assert request.finished and blocks.used_blocks() == 0
    outs = request.snapshot().outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) == 4
    # Sample i draws from seed + i, so it is the n=1 request with that seed.
    singles = session.generate(prompt_token_ids=[prompt] * 4, sampling_params=[
        SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8, ignore_eos=True) for i in range(4)])
    assert [o.token_ids for o in outs] == [s.outputs[0].token_ids for s in singles]

    # Through the Session, the same request gives the same four samples.
    [out] = session.generate(prompt_token_ids=[prompt], sampling_params=params)
    assert [(o.index, o.token_ids, o.finish_reason) for o in out.outputs] == \
        [(o.index, o.token_ids, "length") for o in outs]
    assert session.stats["kv_blocks_used"] == 0
