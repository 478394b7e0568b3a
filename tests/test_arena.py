"""The one-allocation arena executors carve their buffers from: aligned, disjoint regions and
exact typed views; the CPU executor's activations and KV pool live in it."""
from __future__ import annotations

import pytest
import torch

from kiln.runtime.arena import ALIGN, Arena
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor, InputRegion
from kiln.runtime.step import SequenceChunk, pack_step


def test_regions_are_aligned_disjoint_and_typed():
    arena = Arena({"a": 10, "b": 0, "c": 4 * 6, "d": 2 * 3})
    starts = {n: start for n, (start, _) in arena.offsets.items()}
    assert all(s % ALIGN == 0 for s in starts.values())
    assert starts == {"a": 0, "b": ALIGN, "c": ALIGN, "d": 2 * ALIGN}
    assert arena.nbytes == 3 * ALIGN and arena.buffer.numel() == arena.nbytes
    c = arena.view("c", torch.float32, (2, 3))
    d = arena.view("d", torch.bfloat16, (3,))
    c.fill_(1.5)
    d.fill_(-2)
    assert torch.equal(arena.bytes("a"), torch.zeros(10, dtype=torch.uint8))
    assert c.data_ptr() == arena.buffer.data_ptr() + ALIGN and float(c.sum()) == 9.0 and float(d.sum()) == -6.0
    with pytest.raises(ValueError, match="region 'c' holds 24 bytes, not 20"):
        arena.view("c", torch.float32, (5,))
    with pytest.raises(ValueError, match="negative"):
        Arena({"x": -1})


def test_cpu_executor_keeps_activations_and_kv_pool_in_one_arena(factory):
    engine = load_engine(factory.engine(factory.checkpoint("llama3"), dtype="float32"))
    ex = CpuExecutor(engine, 12)
    base, end = ex.memory.buffer.data_ptr(), ex.memory.buffer.data_ptr() + ex.memory.nbytes
    for t in (ex.arena, ex.kv_cache):
        assert base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end
    assert ex.kv_cache.shape[2] == 12 and ex.arena.numel() == engine.manifest.arena_bytes
    ex.close()


def test_input_region_packs_a_step_where_the_arena_holds_it_and_unpacks_it(factory):
    """The one layout a step's inputs travel in (the CUDA executor's staging buffer, a
    tensor-parallel engine's shared buffer) is the arena's: unpacking gives the step back."""
    engine = load_engine(factory.engine(factory.checkpoint("llama3"), dtype="float32"))
    ex = CpuExecutor(engine, num_kv_blocks=16)
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    step = pack_step([SequenceChunk([5, 6, 7], 0, [3, 1]), SequenceChunk([9], 4, [2, 0], all_logits=True)], bs, nb)
    region = InputRegion(engine)
    buffer = torch.zeros(region.nbytes, dtype=torch.uint8)
    used = region.pack(step, buffer)
    back = region.unpack(buffer, step.sizes)
    assert all(torch.equal(getattr(back, name), value) for name, value in step.as_dict().items())
    # What the CUDA executor copies: through the block tables' two rows, which the memory plan puts last.
    offset = region.slots["block_tables"][0] - region.start
    assert used == offset + step.block_tables.numel() * 4 < region.nbytes
    assert back.block_tables.data_ptr() + back.block_tables.numel() * 4 == buffer.data_ptr() + used
    ex._stage_inputs(step, ex._dims(step))  # a fresh arena, zeros elsewhere like the buffer
    assert torch.equal(ex.arena[region.start:region.end], buffer)


def test_dims_count_a_mixed_steps_leading_decode_rows(factory):
    """D, the decode rows attention runs apart: the leading one-token sequences only (a
    one-token chunk behind a prompt is not one of them), and every sequence of a decode step."""
    engine = load_engine(factory.engine(factory.checkpoint("llama3"), dtype="float32"))
    ex = CpuExecutor(engine, num_kv_blocks=16)
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    a, b, c, d = (SequenceChunk([5], 3, [0]), SequenceChunk([6], bs + 2, [1, 2]), SequenceChunk([7, 8, 9], 0, [3]),
                  SequenceChunk([4], 2, [4]))
    mixed, decode, prefill = (pack_step(chunks, bs, nb) for chunks in ([a, b, c, d], [a, b], [c, d]))
    assert [ex._dims(s)["D"] for s in (mixed, decode, prefill)] == [2, 2, 0]
