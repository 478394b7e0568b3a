"""The `Session` API end to end on a small float32 engine: batching, chunked prefill, preemption,
cancellation, sampling, validation, streaming text, asyncio and shutdown.

The engine takes at most 8 sequences and 32 tokens a step, so a batch of mixed requests is
really split into prefill chunks and decoded in flight. Greedy outputs are checked against the
same request run alone and against `transformers`.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from runtime.engine_core import EngineCore
from runtime.sampling_params import SamplingParams
from runtime.scheduler import POLICIES
from runtime.session import Session

MAX_SEQ_LEN, MAX_NUM_TOKENS, MAX_BATCH_SIZE = 64, 32, 8  # SMALL_BUILD's max_seq_len and 4-token blocks
VOCAB = 512  # the random checkpoint's embedding rows
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 380) for _ in range(_rng.randint(2, 20))] for _ in range(64)]
MAX_TOKENS = [_rng.randint(1, 16) for _ in range(64)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, **kw)


def engine_threads() -> int:
    return sum(t.name == "kiln-engine-loop" for t in threading.enumerate())


def run_threads(targets) -> None:
    """Run each callable on its own thread; re-raise the first failure here."""
    errors = []

    def guard(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a client thread hung"
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def checkpoint(factory):
    return factory.checkpoint("llama3")


@pytest.fixture(scope="module")
def engine_dir(factory, checkpoint):
    return factory.engine(checkpoint, dtype="float32", max_batch_size=MAX_BATCH_SIZE, max_num_tokens=MAX_NUM_TOKENS)


@pytest.fixture(scope="module")
def session(engine_dir):
    with Session(engine_dir) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(engine_dir):
    return Tokenizer.from_file(str(engine_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_greedy(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    cache: dict = {}

    def run(prompt: list[int], k: int) -> list[int]:
        if (tuple(prompt), k) not in cache:
            ids = torch.tensor([prompt])
            # eos_token_id=None: like ignore_eos, an eos neither stops nor is suppressed.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                                 do_sample=False, eos_token_id=None, pad_token_id=2)
            cache[tuple(prompt), k] = out[0, len(prompt):].tolist()
        return cache[tuple(prompt), k]
    return run


@pytest.fixture(scope="module")
def alone(session):
    """Token ids of a request run with nothing else in flight on the module's session."""
    cache: dict = {}

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            stats = session.stats
            assert stats["running"] == stats["waiting"] == 0
            cache[key] = session.generate(prompt_token_ids=[prompt], sampling_params=[params])[0].outputs[0].token_ids
        return cache[key]
    return run


def record_steps(session: Session, monkeypatch) -> list[list[tuple[int, int, int, int]]]:
    """Record each step's chunks as (seq_id, prompt length, tokens already cached, chunk tokens)."""
    scheduler = session._core.scheduler
    schedule = scheduler.schedule
    steps = []

    def recording():
        batch, copies = schedule()
        steps.append([(c.seq.seq_id, c.seq.num_prompt, c.seq.num_cached, c.num_tokens) for c in batch])
        return batch, copies
    monkeypatch.setattr(scheduler, "schedule", recording)
    return steps


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
def test_small_kv_pool_gives_the_same_outputs(engine_dir, alone, policy):
    prompts = PROMPTS[:16]
    params = [greedy(8 + i % 9) for i in range(16)]  # at most 20 + 16 tokens: 9 of the 12 blocks
    with Session(engine_dir, max_kv_tokens=48, policy=policy) as small:
        assert small.stats["kv_blocks_total"] == 12
        outs = small.generate(prompt_token_ids=prompts, sampling_params=params)
        stats = small.stats
    for out, prompt, p in zip(outs, prompts, params):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == alone(prompt, p)
    assert (stats["kv_blocks_used"], stats["running"], stats["waiting"]) == (0, 0, 0)
    if policy == "guaranteed_no_evict":
        assert stats["preemptions"] == 0
    else:
        assert stats["preemptions"] > 0


@pytest.fixture(params=[None, 64], ids=["default-pool", "16-block-pool"])
def any_pool_session(request, engine_dir, session):
    """The module's session, or one whose small KV pool makes requests preempt each other."""
    if request.param is None:
        yield session
    else:
        with Session(engine_dir, max_kv_tokens=request.param) as small:
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
     r"prompt \(60 tokens\) \+ max_tokens \(5\) exceeds the engine's max_seq_len 64"),
    (dict(prompt_token_ids=[]), "the prompt is empty"),
    (dict(prompt_token_ids=[5, VOCAB]), r"token id 512 is outside the vocabulary \(0..511\)"),
    (dict(prompt_token_ids=[5, -1]), r"token id -1 is outside the vocabulary"),
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


def test_requests_that_can_never_fit_the_kv_pool_are_refused(engine_dir, alone):
    with Session(engine_dir, max_kv_tokens=32) as small:  # 8 blocks
        finals, threads = in_flight(small, [PROMPTS[30]], 12)
        with pytest.raises(ValueError, match="needs up to 12 KV blocks but the pool has 8"):
            small.stream(prompt_token_ids=[5] * 6, sampling_params=SamplingParams(max_tokens=40))
        with pytest.raises(ValueError, match="needs up to 12 KV blocks but the pool has 8"):
            small.generate(prompt_token_ids=[5] * 4, sampling_params=SamplingParams(n=4, max_tokens=8))
        for t in threads:
            t.join(60)
        assert small.stats["kv_blocks_used"] == 0
    assert finals[0].outputs[0].token_ids == alone(PROMPTS[30], greedy(12))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n must"), (dict(beam_width=2), "unknown sampling parameter"),
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
    outs = core.snapshot(request).outputs
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
