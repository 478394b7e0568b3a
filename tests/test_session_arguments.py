"""Session's arguments checked at the door (issue 20): each refusal is an `ArgumentError` naming
the argument, its value and what is allowed, raised before any work; the types callers plausibly
pass are accepted with a stated meaning or refused by name; an empty prompt is refused unless the
caller asks for the start-of-sequence token explicitly. And the KV pool each Session loads with."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_build import build_cli
from kiln.runtime.arguments import ArgumentError
from kiln.runtime.engine import load_engine
from kiln.runtime.kv_pool import host_memory_available, size_kv_pool
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)


def refused(argument: str, call, *args, **kwargs) -> str:
    with pytest.raises(ArgumentError) as info:
        call(*args, **kwargs)
    assert info.value.argument == argument and str(info.value).startswith(argument), str(info.value)
    return str(info.value)


# -- Session(...) options: checked before the engine is even looked at ------------------------------

@pytest.mark.parametrize("kwargs, argument, words", [
    (dict(kv_cache_fraction=2), "kv_cache_fraction", "must be in (0, 1]"),
    (dict(kv_cache_fraction=0), "kv_cache_fraction", "got 0"),
    (dict(kv_cache_fraction="half"), "kv_cache_fraction", "must be a number"),
    (dict(kv_cache_fraction=0.5, max_kv_tokens=64), "kv_cache_fraction", "give one of them"),
    (dict(max_kv_tokens=0), "max_kv_tokens", "must be >= 1, got 0"),
    (dict(max_kv_tokens=1.5), "max_kv_tokens", "must be an int"),
    (dict(policy="fifo"), "policy", "max_utilization, guaranteed_no_evict"),
    (dict(device="gpu"), "device", "'auto', 'cpu' or 'cuda'"),
    (dict(worker_timeout=0), "worker_timeout", "must be > 0"),
])
def test_bad_session_options_are_refused_before_loading(tmp_path, kwargs, argument, words):
    # The folder does not exist: the option's error comes first, so nothing was loaded.
    assert words in refused(argument, Session, tmp_path / "no-engine", **kwargs)


def test_a_pool_smaller_than_one_sequence_names_what_to_change(engine_dir):
    message = refused("max_kv_tokens", Session, engine_dir, max_kv_tokens=60)
    assert "max_seq_len 64" in message and "--max-kv-tokens 64 or more" in message and "--max-seq-len" in message
    # A fraction of the host's memory too small for one sequence of 64 tokens (16 blocks).
    with Session(engine_dir, max_kv_tokens=64) as s:
        per_block = s.kv_pool.bytes_per_block
    message = refused("kv_cache_fraction", Session, engine_dir, kv_cache_fraction=per_block / host_memory_available())
    assert "fewer than one sequence of the engine's max_seq_len 64 needs (16 blocks" in message
    assert "--kv-cache-fraction" in message and "--max-kv-tokens" in message and "--max-seq-len" in message


# -- the KV pool chosen at load --------------------------------------------------------------------

def test_default_pool_is_what_the_build_can_use_when_memory_allows(session):
    pool = session.kv_pool
    # 8 sequences of 64 tokens in 4-token blocks: far below 0.9 of any test machine's memory.
    assert (pool.num_blocks, pool.num_tokens) == (8 * 16, 8 * 64)
    assert "all that 8 sequences of 64 tokens can use" in pool.describe()
    stats = session.stats
    assert (stats["kv_blocks_total"], stats["kv_tokens_total"], stats["kv_cache_bytes"]) == \
        (pool.num_blocks, pool.num_tokens, pool.num_blocks * pool.bytes_per_block)


def test_default_pool_fits_the_memory_left_when_a_full_batch_would_not(factory):
    # The H200's out-of-memory on the CPU: a full batch of full-length sequences (2**17 of 8192
    # tokens, 2**30 tokens of KV cache) fits in no host, so the default takes 0.9 of the host's
    # available memory instead. Only the size is computed: nothing is allocated.
    engine = load_engine(factory.engine(factory.checkpoint("llama3", max_position_embeddings=8192), dtype="float32",
                                        max_batch_size=2**17, max_seq_len=8192))
    pool = size_kv_pool(engine, False, None, None)
    full_batch = 2**17 * engine.manifest.blocks_per_sequence
    assert pool.reason.startswith("kv_cache_fraction 0.9") and pool.num_blocks < full_batch
    assert engine.manifest.blocks_per_sequence <= pool.num_blocks and pool.nbytes <= 0.9 * host_memory_available()


def test_a_fraction_sizes_the_pool_from_memory_left(engine_dir):
    with Session(engine_dir, max_kv_tokens=64) as s:
        per_block = s.kv_pool.bytes_per_block
    fraction = 40 * per_block / host_memory_available()  # about 40 blocks, between one sequence and the cap
    with Session(engine_dir, kv_cache_fraction=fraction) as s:
        pool = s.kv_pool
        assert 16 <= pool.num_blocks < 8 * 16 and pool.reason.startswith(f"kv_cache_fraction {fraction}")
        out = s.generate(prompt_token_ids=PROMPTS[0], sampling_params=greedy(4))[0]
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.gpu
def test_gpu_pool_fits_the_free_memory_when_a_full_batch_would_not(factory, tmp_path):
    # 2**17 sequences of 8192 tokens at 256 bytes a token would want 275 GB of KV cache: sizing
    # the pool for a full batch (the old default) cannot even be allocated on one GPU.
    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    checkpoint = factory.checkpoint("llama3", max_position_embeddings=8192)
    engine = tmp_path / "engine"
    # Built in a fresh process: kernel test modules set TRITON_INTERPRET in this one (gpu_build.py).
    built = build_cli(checkpoint, engine, [arch], tmp_path / "cache", max_batch_size=2**17, max_seq_len=8192,
                      kv_block_size=4)
    assert built.returncode == 0, built.stderr
    free = torch.cuda.mem_get_info()[0]
    with Session(engine, device="cuda") as s:
        pool = s.kv_pool
        assert pool.reason.startswith("kv_cache_fraction 0.9") and pool.nbytes <= 0.9 * free
        assert 8192 // 4 <= pool.num_blocks < 2**17 * 8192 // 4
        out = s.generate(prompt_token_ids=PROMPTS[0], sampling_params=greedy(4))[0]
        assert out.outputs[0].finish_reason == "length"


# -- prompts ---------------------------------------------------------------------------------------

def test_an_empty_batch_is_an_empty_result(session):
    assert session.generate([]) == []
    assert session.generate(prompt_token_ids=[]) == []


def test_token_ids_are_taken_from_any_integer_sequence(session, alone):
    expected = alone(PROMPTS[1], greedy(4))
    for ids in (np.array(PROMPTS[1], dtype=np.int64), torch.tensor(PROMPTS[1]), tuple(PROMPTS[1])):
        assert session.generate(prompt_token_ids=[ids], sampling_params=greedy(4))[0].outputs[0].token_ids == expected
        assert list(session.stream(prompt_token_ids=ids, sampling_params=greedy(4)))[-1].outputs[0].token_ids == \
            expected


@pytest.mark.parametrize("call, kwargs, argument, words", [
    ("generate", dict(prompts=[[5, 6, 7]]), "prompts[0]", "pass token ids as prompt_token_ids"),
    ("generate", dict(prompts=[5, 6]), "prompts[0]", "pass token ids as prompt_token_ids"),
    ("generate", dict(prompts=3), "prompts", "must be a list"),
    ("generate", dict(prompt_token_ids="The kiln"), "prompt_token_ids", "got the text 'The kiln'"),
    ("generate", dict(prompt_token_ids=[[5, 6.5]]), "prompt_token_ids[0]", "must hold ints, got 6.5"),
    ("generate", dict(prompt_token_ids=[[5, True]]), "prompt_token_ids[0]", "must hold ints, got True"),
    ("generate", dict(prompts=["a", "b"], sampling_params=[SamplingParams()] * 3), "sampling_params", "3 entries"),
    ("generate", dict(prompts=["a", ""]), "prompt", "is empty"),
    ("generate", dict(), "prompts", "give exactly one"),
    ("stream", dict(prompt=["a", "b"]), "prompt", "use generate() for a batch"),
    ("stream", dict(prompt=[5, 6]), "prompt", "pass token ids as prompt_token_ids"),
    ("stream", dict(prompt="a", sampling_params=[SamplingParams()]), "sampling_params", "got list"),
    ("stream", dict(prompt="a", priority=1.5), "priority", "must be an int"),
])
def test_wrong_kinds_of_prompt_are_refused_by_name(session, call, kwargs, argument, words):
    before = session.stats
    assert words in refused(argument, getattr(session, call), **kwargs)
    assert session.stats["running"] == before["running"] and session.stats["waiting"] == before["waiting"]


def test_an_empty_prompt_is_refused_unless_bos_is_asked_for(session, tokenizer):
    bos = tokenizer.encode("").ids
    assert bos, "the llama3 tokenizer adds a start-of-sequence token"
    message = refused("prompt", session.stream, "", greedy(4))
    assert f"pass prompt_token_ids={bos}" in message
    assert "prompt is empty" in refused("prompt", session.generate, [""], greedy(4))
    # Asked for explicitly, generation from BOS alone runs.
    out = session.generate(prompt_token_ids=bos, sampling_params=greedy(4))[0]
    assert out.prompt_token_ids == bos and len(out.outputs[0].token_ids) == 4


def test_a_bad_prompt_in_a_batch_is_named_by_its_index(session):
    message = refused("prompt", session.generate, prompt_token_ids=[[5, 6], [5] * 65])
    assert "(prompt 1 of the batch)" in message and "65 tokens" in message
