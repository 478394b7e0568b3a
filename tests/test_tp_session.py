"""Tensor-parallel serving on the CPU: a Session over a TP engine starts one gloo worker per
rank, gives the same greedy tokens as TP=1 with in-flight batching, the same seeded samples
(every rank samples with the same sampler and generators), overlapped as on one device, and survives a worker that dies or
hangs by failing the requests in flight with an error naming the rank."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from kiln.runtime import SamplingParams, Session
from kiln.runtime.cli import run_engine
from kiln.runtime.tp_executor import TensorParallelExecutor

BUILD = dict(dtype="float32", max_batch_size=8, max_num_tokens=32)


@pytest.fixture(scope="module")
def checkpoint(factory):
    # 8 heads and 2 kv heads: TP=4 replicates kv heads, TP=2 splits them.
    return factory.checkpoint("qwen2", num_heads=8, num_kv_heads=2)


def test_unknown_all_reduce_mode_is_refused_naming_the_variable(factory, checkpoint, monkeypatch):
    monkeypatch.setenv("KILN_ALL_REDUCE", "fast")
    with pytest.raises(ValueError, match="KILN_ALL_REDUCE='fast' is not an all-reduce mode: use 'auto'"):
        Session(factory.engine(checkpoint, tp_size=2, **BUILD))


def mixed_requests(n: int = 32) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    # Prompts longer than a step's 32 tokens are prefilled in chunks: steps that pick no token.
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(2, 20) if i % 8 else rng.randrange(33, 50))]
               for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 12), ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def tp1_tokens(factory, checkpoint):
    prompts, params = mixed_requests()
    with Session(factory.engine(checkpoint, **BUILD)) as s:
        return [o.outputs[0].token_ids for o in s.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_engine_matches_tp1_with_inflight_batching(factory, checkpoint, tp1_tokens, tp):
    prompts, params = mixed_requests()
    with Session(factory.engine(checkpoint, tp_size=tp, **BUILD)) as s:
        outs = s.generate(prompt_token_ids=prompts, sampling_params=params)
        assert s.stats["kv_blocks_used"] == 0
    assert [o.outputs[0].token_ids for o in outs] == tp1_tokens


def test_tp_engine_overlapped_matches_its_plain_loop(factory, checkpoint):
    """The overlapped loop on a TP engine (each rank feeds the ids it sampled itself, replies
    pipelined one step behind) gives the plain loop's tokens, unseeded sampling included: the
    Session seeds every sequence so that the ranks draw alike."""
    prompts, params = mixed_requests(16)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=p.max_tokens, ignore_eos=True) if i % 2 else p
              for i, p in enumerate(params)]
    engine = factory.engine(checkpoint, tp_size=2, **BUILD)
    outs = {}
    for overlap in (True, False):
        with Session(engine, overlap=overlap) as s:
            outs[overlap] = [o.outputs[0].token_ids for o in s.generate(prompt_token_ids=prompts, sampling_params=params)]
            unseeded = s.generate(prompt_token_ids=prompts[:4], sampling_params=SamplingParams(
                temperature=1.0, max_tokens=12, n=2, ignore_eos=True))
            assert [len(c.token_ids) for o in unseeded for c in o.outputs] == [12] * 8
            assert s.stats["kv_blocks_used"] == 0
    assert outs[True] == outs[False]


def test_unseeded_sequences_get_one_seed_for_every_rank():
    from kiln.runtime.sampler import Picks
    from kiln.runtime.tp_executor import _seeded

    params = SamplingParams(temperature=1.0)
    picks = Picks([0, 1], [3, 4], [0, 0], [[], []], [[], []], {3: (params, None), 4: (params, 17)})
    seeded = _seeded(picks)
    assert seeded.new[4] == (params, 17) and isinstance(seeded.new[3][1], int)
    assert picks.new[3] == (params, None)  # the engine loop's record is left as it was
    assert _seeded(seeded) is seeded


def sampled_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Seeded draws with truncation, penalties and bad words, n > 1, logprobs, min_tokens."""
    prompts = [[5, 17, 200, 45], [9, 8, 7, 6, 5, 4], [300, 301], [42] * 11, [3, 30, 300]]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, min_p=0.01, seed=3, n=3, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                             bad_words=((17, 99), (120,)), seed=5, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.2, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, logprobs=2, min_tokens=4, max_tokens=6)]
    return prompts, params


def _samples(engine) -> list[list[tuple[list[int], list | None]]]:
    prompts, params = sampled_requests()
    with Session(engine) as s:
        outs = s.generate(prompt_token_ids=prompts, sampling_params=params)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def test_tp_engine_samples_what_tp1_samples(factory, checkpoint):
    """Seeded sampling happens on every rank with the generators TP 1 uses, so the tokens match;
    logprobs match up to the all-reduce's float rounding."""
    tp1, tp2 = _samples(factory.engine(checkpoint, **BUILD)), _samples(factory.engine(checkpoint, tp_size=2, **BUILD))
    assert [[ids for ids, _ in r] for r in tp2] == [[ids for ids, _ in r] for r in tp1]
    assert len(tp2[1]) == 3 and len({tuple(ids) for ids, _ in tp2[1]}) > 1  # n=3 forks draw differently
    for r1, r2 in zip(tp1, tp2):
        for (_, lp1), (_, lp2) in zip(r1, r2):
            if lp1 is None:
                assert lp2 is None
                continue
            assert [e["token"] for e in lp2] == [e["token"] for e in lp1]
            assert [e["logprob"] for e in lp2] == pytest.approx([e["logprob"] for e in lp1], abs=1e-4)
            assert [[t for t, _ in e["top"]] for e in lp2] == [[t for t, _ in e["top"]] for e in lp1]


def _alive(procs) -> list[int]:
    return [p.pid for p in procs if p.poll() is None]


def _start_long_stream(session: Session):
    it = session.stream(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(temperature=0, max_tokens=40,
                                                                                   ignore_eos=True))
    next(it)
    return it


def test_killed_worker_fails_requests_naming_the_rank(factory, checkpoint):
    session = Session(factory.engine(checkpoint, tp_size=2, **BUILD))
    procs = list(session._core.executor.procs)
    try:
        it = _start_long_stream(session)
        os.kill(procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 died"):
            for _ in it:
                pass
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="session failed"):
            session.generate(prompt_token_ids=[[5, 6]])
    finally:
        session.close()
    assert _alive(procs) == []


def test_killed_rank0_which_samples_is_named_and_every_worker_reaped(factory, checkpoint):
    """Rank 0 holds the sampling state and maps the shared inputs buffer: its death (here
    between two requests, so no race with a stream that ends first) fails the next request
    naming it, and every worker is reaped."""
    session = Session(factory.engine(checkpoint, tp_size=2, **BUILD))
    procs = list(session._core.executor.procs)
    seeded = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    try:
        assert len(session.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=seeded)[0].outputs[0].token_ids) == 8
        os.kill(procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 0 died"):
            session.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=seeded)
        assert time.monotonic() - start < 30
    finally:
        session.close()
    assert _alive(procs) == []


def test_an_error_after_a_peer_died_names_the_dead_rank():
    """The race behind the test above when it failed one CI run: rank 1's all-reduce lost rank 0
    and rank 1's error arrived before rank 0's pipe closed. The dead rank is named (with what
    rank 1 said after it); with no dead rank, the erring one is."""
    dead = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    executor = TensorParallelExecutor.__new__(TensorParallelExecutor)   # its failure reports only
    try:
        executor.procs = [dead, alive]
        error = executor._root_failure(1, "error", "Traceback ...\nRuntimeError: Connection reset by peer", "running a step")
        assert str(error) == ("tensor-parallel rank 0 died while running a step (exit code -9) "
                              "(then rank 1 failed: RuntimeError: Connection reset by peer)")
        executor.procs = [alive, alive]
        error = executor._root_failure(1, "error", "ValueError: bad", "running a step")
        assert str(error) == "tensor-parallel rank 1 failed while running a step:\nValueError: bad"
    finally:
        alive.kill()
        alive.wait()


def test_hung_worker_is_reported_within_the_timeout(factory, checkpoint):
    session = Session(factory.engine(checkpoint, tp_size=2, **BUILD), worker_timeout=3)
    procs = list(session._core.executor.procs)
    try:
        it = _start_long_stream(session)
        os.kill(procs[1].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 did not answer within 3 s .*\(rank 0 waiting"):
            for _ in it:
                pass
        assert time.monotonic() - start < 15
    finally:
        session.close()  # SIGKILL reaps a stopped process; SIGTERM at exit would not
    assert _alive(procs) == []


def test_run_engine_takes_tp_engines_without_extra_flags(factory, checkpoint):
    tp1 = CliRunner().invoke(run_engine, ["--engine", str(factory.engine(checkpoint, **BUILD)),
                                          "--prompt", "The kiln", "--max-tokens", "6"])
    tp2 = CliRunner().invoke(run_engine, ["--engine", str(factory.engine(checkpoint, tp_size=2, **BUILD)),
                                          "--prompt", "The kiln", "--max-tokens", "6"])
    assert tp1.exit_code == 0 and tp2.exit_code == 0, tp2.output
    assert tp2.stdout == tp1.stdout  # stdout only: stderr carries the per-run timing


def test_tp_session_from_a_script_on_stdin_needs_no_main_guard(factory, checkpoint, tp1_tokens):
    """Workers are fresh interpreters, so a script without `if __name__ == "__main__":` (here
    fed on standard input, as `python - <<EOF` does) opens a TP Session and gets TP 1's tokens."""
    prompts, params = mixed_requests()
    script = f"""
import json
from kiln import Session, SamplingParams
prompts = {prompts!r}
params = [SamplingParams(temperature=0, max_tokens=p, ignore_eos=True) for p in {[p.max_tokens for p in params]!r}]
with Session({str(factory.engine(checkpoint, tp_size=2, **BUILD))!r}) as s:
    outs = s.generate(prompt_token_ids=prompts, sampling_params=params)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300,
                          cwd=factory.root)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == tp1_tokens
