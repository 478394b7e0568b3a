"""The overlapped engine loop (runtime/overlap.py) gives the plain loop's outputs token for token:
greedy, seeded sampling, penalties, stop strings and ids, max_tokens, n > 1, logprobs,
cancellation mid-stream and preemption; it leaks no KV block and really runs a step ahead."""
from __future__ import annotations

import random

import pytest

from kiln.runtime.engine_core import EngineCore
from kiln.runtime.overlap import pace_delay
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)


def _core(engine_dir, overlap: bool, **kw) -> tuple[EngineCore, list]:
    """A CPU EngineCore, and the feeds its executor was given (one entry per step)."""
    core = EngineCore(engine_dir, device="cpu", overlap=overlap, **kw)
    feeds, run = [], core.executor.run

    def recorded(step, copies=(), feed=None):
        feeds.append(feed)
        return run(step, copies, feed)
    core.executor.run = recorded
    return core, feeds


def _drive(core: EngineCore, requests: list[tuple[list[int], SamplingParams]], cancel_after: dict[int, int] = {},
           arrive_at: dict[int, int] = {}) -> list[list[tuple]]:
    """Run requests to the end: request i joins at step arrive_at[i] (0 by default) and is
    cancelled once its first sample has cancel_after[i] tokens. Returns per request, per sample:
    (token ids, text, finish reason, logprobs)."""
    handles: dict[int, object] = {}
    step = 0
    while len(handles) < len(requests) or core.has_work():
        for i, (prompt, params) in enumerate(requests):
            if i not in handles and arrive_at.get(i, 0) <= step:
                handles[i] = core.add_request(f"r{i}", prompt, params)
        core.step()
        step += 1
        for i, k in cancel_after.items():
            request = handles.get(i)
            if request is not None and not request.finished and len(request.seqs[0].output_ids) >= k:
                core.cancel(f"r{i}")
        assert step < 2000, "the loop did not finish"
    assert core.blocks.num_free == core.blocks.num_blocks, "KV blocks leaked"
    assert not core.requests and not core.scheduler.running and not core.scheduler.waiting
    return [[(s.output_ids, s.text, s.finish_reason, s.logprobs) for s in sorted(handles[i].seqs, key=lambda s: s.index)]
            for i in range(len(requests))]


def _both(engine_dir, requests, core_kw: dict | None = None, **drive_kw) -> tuple[list, list, EngineCore, list]:
    """The outputs of the plain and the overlapped loop, the overlapped core and its feeds."""
    plain_core, plain_feeds = _core(engine_dir, False, **(core_kw or {}))
    plain = _drive(plain_core, requests, **drive_kw)
    assert not any(plain_feeds)  # the plain loop never schedules ahead of its tokens
    core, feeds = _core(engine_dir, True, **(core_kw or {}))
    return plain, _drive(core, requests, **drive_kw), core, feeds


def _assert_same(plain: list, overlapped: list) -> None:
    for i, (a, b) in enumerate(zip(plain, overlapped)):
        for (ids_a, text_a, why_a, lp_a), (ids_b, text_b, why_b, lp_b) in zip(a, b):
            assert (ids_b, text_b, why_b) == (ids_a, text_a, why_a), f"request {i}"
            assert [lp["token"] for lp in lp_b] == [lp["token"] for lp in lp_a]
            assert [lp["logprob"] for lp in lp_b] == pytest.approx([lp["logprob"] for lp in lp_a], abs=1e-4)


def _stop_string(engine_dir, prompt: list[int], params: SamplingParams) -> str:
    """Two characters from the middle of what `params` generates, so the stop really hits."""
    core, _ = _core(engine_dir, False)
    [[(_, text, _, _)]] = _drive(core, [(prompt, params)])
    middle = text.strip()[len(text.strip()) // 2:][:2]
    assert len(middle) == 2, text
    return middle


def test_greedy_decoding_computes_exactly_the_plain_loops_tokens(engine_dir):
    requests = [(p, greedy(k)) for p, k in zip(PROMPTS[:24], MAX_TOKENS)]
    plain, overlapped, core, feeds = _both(engine_dir, requests, arrive_at={i: i % 7 for i in range(24)})
    _assert_same(plain, overlapped)
    # Decode steps ran ahead of their tokens: their input ids were fed on the device...
    assert sum(len(f.rows) for f in feeds if f is not None) > 100
    # ...and no token was computed beyond max_tokens: a sequence whose pending token is its last
    # is not scheduled again. (Fresh cores: `core` would find the prompts in its prefix cache.)
    counted = {"plain": 0, "overlap": 0}
    for name, c in (("plain", _core(engine_dir, False)[0]), ("overlap", _core(engine_dir, True)[0])):
        run = c.executor.run

        def counting(step, copies=(), feed=None, run=run, name=name):
            counted[name] += step.num_tokens
            return run(step, copies, feed)
        c.executor.run = counting
        _drive(c, requests)
    assert counted["overlap"] == counted["plain"]


def test_every_sampling_mode_matches_the_plain_loop(engine_dir):
    stop = _stop_string(engine_dir, PROMPTS[5], greedy(16))
    seeded = dict(temperature=0.9, max_tokens=14, ignore_eos=True)
    requests = [
        (PROMPTS[0], greedy(12)),
        (PROMPTS[1], SamplingParams(seed=7, **seeded)),
        (PROMPTS[2], SamplingParams(seed=8, top_k=20, top_p=0.8, **seeded)),
        (PROMPTS[3], SamplingParams(seed=9, min_p=0.05, **seeded)),
        (PROMPTS[4], SamplingParams(seed=10, n=3, **seeded)),  # n > 1: forked after the prompt
        (PROMPTS[5], greedy(16, stop=[stop])),  # a stop string
        (PROMPTS[6], greedy(14, logprobs=3)),
        (PROMPTS[7], SamplingParams(seed=11, logprobs=2, **seeded)),
        # Rows that read their token history (their steps settle first), with penalties strong
        # enough that leaving out the last token changes what they pick.
        (PROMPTS[8], greedy(14, repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=2.0)),
        (PROMPTS[9], SamplingParams(seed=12, repetition_penalty=5.0, **seeded)),
        (PROMPTS[10], greedy(14, presence_penalty=-2.0, frequency_penalty=-1.0)),
        (PROMPTS[12], greedy(14, bad_words=[[t] for t in PROMPTS[12][:3]])),
        (PROMPTS[11], SamplingParams(temperature=0, max_tokens=16, seed=3, n=2)),  # eos may stop it
    ]
    plain, overlapped, _, feeds = _both(engine_dir, requests, arrive_at={i: (3 * i) % 8 for i in range(13)})
    _assert_same(plain, overlapped)
    assert plain[5][0][2] == "stop" and stop not in plain[5][0][1]
    assert len(overlapped[4]) == 3 and len({tuple(s[0]) for s in overlapped[4]}) > 1
    assert all(len(s[3]) == len(s[0]) for s in overlapped[6][0:1] + overlapped[7][0:1])


def test_rows_without_history_overlap_in_every_sampling_mode(engine_dir):
    seeded = dict(temperature=0.9, max_tokens=14, ignore_eos=True)
    requests = [(PROMPTS[1], SamplingParams(seed=7, top_k=20, top_p=0.8, min_tokens=3, **seeded)),
                (PROMPTS[2], SamplingParams(seed=8, n=2, **seeded)), (PROMPTS[3], greedy(14, logprobs=1))]
    plain, overlapped, _, feeds = _both(engine_dir, requests)
    _assert_same(plain, overlapped)
    # Every decode step but the first (a prefill went before it) took its input ids on the device.
    assert sum(f is not None for f in feeds) == 13 and sum(len(f.rows) for f in feeds if f) == 4 * 13


def test_stop_token_ids_and_min_tokens_match_the_plain_loop(engine_dir):
    # Stop at a token the greedy output holds; min_tokens masks it for the first few tokens.
    core, _ = _core(engine_dir, False)
    [[(ids, *_)], [(ids2, *_)]] = _drive(core, [(PROMPTS[20], greedy(16)), (PROMPTS[21], greedy(16))])
    requests = [(PROMPTS[20], greedy(16, stop_token_ids=[ids[5]])),
                (PROMPTS[21], greedy(16, stop_token_ids=[ids2[1]], min_tokens=4)),
                (PROMPTS[22], SamplingParams(seed=5, temperature=1.0, max_tokens=16, stop_token_ids=[ids[3]],
                                             min_tokens=2))]
    plain, overlapped, _, _ = _both(engine_dir, requests)
    _assert_same(plain, overlapped)
    assert plain[0][0][2] == "stop" and len(plain[0][0][0]) <= 6


def test_cancellation_mid_stream_matches_the_plain_loop(engine_dir):
    # Eight sequences, so every step decodes all of them and the two samples of request 6 are
    # cancelled with as many tokens each, whichever loop runs.
    requests = [(p, greedy(16)) for p in PROMPTS[30:36]] + [(PROMPTS[38], SamplingParams(seed=4, n=2, max_tokens=16,
                                                                                          temperature=1.0))]
    cancel_after = {0: 1, 2: 3, 5: 7, 6: 4}
    plain, overlapped, _, _ = _both(engine_dir, requests, cancel_after=cancel_after)
    _assert_same(plain, overlapped)
    for i, k in cancel_after.items():
        assert overlapped[i][0][2] == "cancelled" and len(overlapped[i][0][0]) == k


def test_preemption_matches_the_plain_loop(short_engine_dir):
    # 48 KV tokens for up to 8 sequences of up to 36 tokens: running sequences get preempted.
    rng = random.Random(5)
    requests = [(PROMPTS[i], greedy(rng.randint(8, 16)) if i % 2 else
                 SamplingParams(seed=i, temperature=0.8, max_tokens=rng.randint(8, 16), ignore_eos=True))
                for i in range(40, 52)]
    # max_utilization: the projected_peak policy admits too carefully to preempt here.
    plain_core, _ = _core(short_engine_dir, False, max_kv_tokens=48, policy="max_utilization")
    plain = _drive(plain_core, requests)
    core, _ = _core(short_engine_dir, True, max_kv_tokens=48, policy="max_utilization")
    overlapped = _drive(core, requests)
    _assert_same(plain, overlapped)
    assert plain_core.scheduler.num_preemptions > 0 and core.scheduler.num_preemptions > 0


def test_a_finished_sequences_extra_token_is_never_emitted(engine_dir):
    # The stop id ends the sequence at step N; step N+1 was already launched for it.
    core, _ = _core(engine_dir, False)
    [[(ids, *_)]] = _drive(core, [(PROMPTS[25], greedy(16))])
    core, feeds = _core(engine_dir, True)
    request = core.add_request("r", PROMPTS[25], greedy(16, stop_token_ids=[ids[4]]))
    outputs = []
    while core.has_work():
        if request in core.step():
            outputs.append(list(request.seqs[0].output_ids))
    stop_at = ids.index(ids[4]) + 1
    assert outputs == [ids[:k] for k in range(1, stop_at + 1)]
    assert request.seqs[0].pending == 0 and core.blocks.num_free == core.blocks.num_blocks
    assert sum(f is not None for f in feeds) == stop_at  # the step after the stop ran, its token dropped


def test_session_overlap_flag_gives_the_same_outputs(engine_dir):
    params = [greedy(k) for k in MAX_TOKENS[:8]] + [SamplingParams(seed=2, temperature=0.7, max_tokens=9, n=2)]
    with Session(engine_dir, device="cpu", overlap=False) as plain:
        want = plain.generate(prompt_token_ids=PROMPTS[:9], sampling_params=params)
    with Session(engine_dir, device="cpu") as overlapped:
        assert overlapped._core.in_flight.overlap
        got = overlapped.generate(prompt_token_ids=PROMPTS[:9], sampling_params=params)
        assert overlapped.stats["kv_blocks_used"] == 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]


def test_pacing_schedules_the_next_step_a_lead_before_the_one_in_flight_ends():
    settled = [99.98, 99.99, 100.0]  # steps of 10 ms, the last settled at t = 100 s
    # The step in flight should end at 100.010: schedule the next a quarter of a step before.
    assert pace_delay(settled, [0.001], now=100.0) == pytest.approx(0.0075)
    assert pace_delay(settled, [0.001], now=100.005) == pytest.approx(0.0025)
    # Host work of 4 ms a step (the longest recent) asks for that much lead.
    assert pace_delay(settled, [0.001, 0.004, 0.002], now=100.0) == pytest.approx(0.006)
    # Short steps keep a floor of 0.3 ms.
    assert pace_delay([99.998, 99.999, 100.0], [0.0], now=100.0) == pytest.approx(0.0007)
    # A long (prefill) step among recent ones: the shortest interval judges.
    assert pace_delay([99.95, 99.99, 100.0], [0.0], now=100.0) == pytest.approx(0.0075)
    # Past due, or nothing to judge by: no wait.
    assert pace_delay(settled, [0.0], now=100.02) == 0.0
    assert pace_delay([100.0], [0.0], now=100.0) == 0.0


def test_a_step_that_has_finished_is_never_waited_for(engine_dir):
    # The CPU executor runs each step before returning it: the loop never has a running step,
    # so an overlapped Session on the CPU never paces, however regular its steps.
    core, _ = _core(engine_dir, True)
    for i in range(4):
        core.add_request(f"r{i}", PROMPTS[i], greedy(12))
    paces = []
    while core.has_work():
        core.step()
        paces.append(core.pace())
    assert len(paces) > 10 and set(paces) == {0.0}
