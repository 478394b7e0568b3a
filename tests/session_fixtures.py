"""Shared pieces of the Session tests: a small float32 engine (at most 8 sequences and 32
tokens a step, so mixed requests really are chunked and batched in flight), its Session, the
`transformers` reference and the outputs of requests run alone."""
from __future__ import annotations

import random
import threading

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

MAX_SEQ_LEN, MAX_NUM_TOKENS, MAX_BATCH_SIZE = 64, 32, 8  # SMALL_BUILD's max_seq_len and 4-token blocks
SHORT_SEQ_LEN = 48  # the short engine's: a pool of 12 blocks holds one sequence of it
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
def short_engine_dir(factory, checkpoint):
    """The same model with shorter sequences, so a KV pool of a few blocks still holds one."""
    return factory.engine(checkpoint, dtype="float32", max_batch_size=MAX_BATCH_SIZE, max_num_tokens=MAX_NUM_TOKENS,
                          max_seq_len=SHORT_SEQ_LEN)


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
