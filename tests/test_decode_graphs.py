"""Padding decode steps to a captured graph's batch size (runtime/decode_graphs.py), checked
with the CPU executor: the padded step gives the real rows' logits unchanged and writes KV only
to the spare block, so graph replay on the GPU can pad freely."""
from __future__ import annotations

import torch

from kiln.runtime.decode_graphs import decode_batch_limit, graph_batch_sizes, is_pure_decode, pad_decode, padding_step
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    # No decode batch needs more than 7 padding rows beyond 8.
    assert all(next(s for s in sizes if s >= n) - n <= 7 for n in range(9, 257))
    # Engines of up to 2048 sequences: fewer graphs, padding under 1/16 of the batch.
    sizes = graph_batch_sizes(2048)
    assert sizes[-1] == 2048 and len(sizes) == 83 and sizes[:35] == graph_batch_sizes(256)
    assert all(next(s for s in sizes if s >= n) - n < n / 16 for n in range(257, 2049))


def test_pure_decode_is_one_token_and_one_logit_row_per_sequence():
    decode = pack_step([SequenceChunk([5], 3, [0]), SequenceChunk([6], 7, [1, 2])], 4, 2)
    prefill = pack_step([SequenceChunk([5, 6], 0, [0])], 4, 2)
    all_logits = pack_step([SequenceChunk([5], 3, [0], all_logits=True), SequenceChunk([6, 7], 0, [1])], 4, 2)
    assert is_pure_decode(decode)
    assert not is_pure_decode(prefill) and not is_pure_decode(all_logits)


def test_padding_rows_point_at_the_spare_block():
    step = pack_step([SequenceChunk([5], 3, [2]), SequenceChunk([6], 7, [0, 1])], 4, 3)
    padded = pad_decode(step, 4, pad_block=9, block_size=4)
    assert padded.input_ids.tolist() == [5, 6, 0, 0]
    assert padded.slot_mapping.tolist() == step.slot_mapping.tolist() + [36, 36]
    assert padded.block_tables[2:].tolist() == [[9, 9, 9], [9, 9, 9]]
    assert padded.query_lens.tolist() == [1, 1, 1, 1] and padded.context_lens.tolist() == [4, 8, 1, 1]
    assert padded.logits_indices.tolist() == [0, 1, 2, 3]
    assert all(t.dtype == torch.int32 for t in padded.as_dict().values())
    assert padding_step(3, 9, 4, 3).slot_mapping.tolist() == [36, 36, 36]


def test_a_padded_step_keeps_real_logits_and_caches(factory):
    engine = load_engine(factory.engine(factory.checkpoint("llama3"), dtype="float32"))
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    blocks, spare = 24, 24
    prompts = [[5, 17, 42, 99, 7], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9]]
    tables = [list(range(s * 8, s * 8 + 8))[:nb] for s in range(3)]
    results = []
    for pad in (False, True):
        ex = CpuExecutor(engine, blocks + 1)  # as the CUDA executor: one spare block past the pool
        ex.run(pack_step([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)], bs, nb))
        before = ex.kv_cache[:, :, :blocks].clone()
        step = pack_step([SequenceChunk([21], len(p), t) for p, t in zip(prompts, tables)], bs, nb)
        logits = ex.run(pad_decode(step, 8, spare, bs) if pad else step)
        changed = (ex.kv_cache[:, :, :blocks] != before).flatten(3).any(-1).nonzero()[:, 2].unique().tolist()
        results.append((logits[:3], changed, ex.kv_cache[:, :, :blocks].clone(), bool(ex.kv_cache[:, :, spare].any())))
    (plain, plain_changed, plain_cache, plain_spare), (padded, padded_changed, padded_cache, padded_spare) = results
    assert padded_spare and not plain_spare  # the padding rows wrote there, and only they did
    assert torch.allclose(padded, plain, rtol=1e-5, atol=1e-5)
    assert padded_changed == plain_changed == sorted({s // bs for s in step.slot_mapping.tolist()})
    # Real blocks hold the same KV (batch size changes only the float rounding on the CPU).
    assert torch.allclose(padded_cache, plain_cache, rtol=1e-5, atol=1e-6)


def test_no_decode_step_holds_more_sequences_than_the_pool_has_blocks(factory):
    """What lets the CUDA executor skip graphs above `decode_batch_limit`: with forked samples
    sharing a partly filled prompt block, and more requests than the pool can hold at once."""
    from kiln.runtime.engine_core import EngineCore
    from kiln.runtime.sampling_params import SamplingParams

    # Sequences of at most 16 tokens, so a pool of 4 blocks of 4 still holds one.
    core = EngineCore(factory.engine(factory.checkpoint("llama3"), dtype="float32", max_seq_len=16), device="cpu",
                      max_kv_tokens=4 * 4)
    assert core.blocks.num_blocks == 4 and decode_batch_limit(core.engine.manifest.max_num_tokens, core.engine.manifest.max_batch_size, 4) == 4
    decode_rows, run = [], core.executor.run

    def recorded(step, copies=(), feed=None):
        if is_pure_decode(step):
            decode_rows.append(step.num_tokens)
        return run(step, copies, feed)
    core.executor.run = recorded
    core.add_request("forked", [5, 6, 7], SamplingParams(n=4, max_tokens=1, temperature=1.0, seed=1))
    for i in range(6):
        core.add_request(f"r{i}", [8 + i, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    while core.has_work():
        core.step()
    assert decode_rows and max(decode_rows) <= 4
