"""The CUDA executor runs an engine's cubins and matches the CPU executor on the same engine
(GPU only: `pytest -m gpu`).

Each engine is built here for ["cpu", this GPU's arch]; both executors then run the same
steps: a prefill step with every logit of one prompt (the GEMMs' prefill bucket), a mixed step
(a new prompt's prefill beside two decodes: small bucket, prefill attention over cached keys)
and pure decode steps (decode bucket; split-KV attention when the engine's max_seq_len gives
more than 256 keys per sequence; 3 sequences replay the CUDA graph captured for 4), then decode
steps of 2 and of 1 sequence (the CUDA GEMVs of bf16 engines). The tokens fed back come from the CPU's logits, so both
executors see identical inputs even where bf16 rounding would make greedy choices differ.
"""
from __future__ import annotations

import pytest
import torch

from gpu_build import build_cli
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step

pytestmark = pytest.mark.gpu

NUM_BLOCKS = 96
DECODE_STEPS = 6
# (family, dtype, max_seq_len, tolerance of max |gpu - cpu| / max |cpu|): 512 keys per
# sequence take the split-KV decode path, 256 the plain one. In bf16 both sides round every
# op's output (the GPU after fp32 accumulation, the CPU reference op by op), so they differ by
# the sum of two bf16 errors: up to about 2.2e-2 measured on an H200 (2026-11-29).
CASES = [("qwen3", "float32", 512, 1e-4), ("llama3", "bfloat16", 256, 3e-2), ("qwen3", "bfloat16", 512, 3e-2)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def steps(engine) -> tuple[list[list[int]], list[list[int]], int, int]:
    """The scenario's prompts and block tables, the engine's block size and blocks per sequence."""
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    g = torch.Generator().manual_seed(0)
    # The first step's 260 tokens take the GEMMs' prefill bucket (the TMA kernels on sm_90+).
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (200, 60, 20)]
    # Interleaved, out-of-order blocks so that paging is exercised.
    tables = [list(range(s, NUM_BLOCKS, 3))[::-1][:nb] for s in range(3)]
    return prompts, tables, bs, nb


def run_both(cpu: CpuExecutor, gpu, engine) -> list[tuple[str, float, torch.Tensor, torch.Tensor]]:
    """Run the scenario on both executors: (step name, relative error, gpu logits, cpu logits)."""
    prompts, tables, bs, nb = steps(engine)
    results = []

    def both(name, chunks):
        step = pack_step(chunks, bs, nb)
        want, got = cpu.run(step), gpu.run(step).cpu()
        results.append((name, rel_err(got, want), got, want))
        return want

    logits = both("prefill", [SequenceChunk(prompts[0], 0, tables[0]),
                              SequenceChunk(prompts[1], 0, tables[1], all_logits=True)])
    tokens = [prompts[0] + [int(logits[0].argmax())], prompts[1] + [int(logits[-1].argmax())], list(prompts[2])]
    logits = both("mixed", [SequenceChunk(tokens[0][-1:], len(tokens[0]) - 1, tables[0]),
                            SequenceChunk(tokens[1][-1:], len(tokens[1]) - 1, tables[1]),
                            SequenceChunk(prompts[2], 0, tables[2], all_logits=True)])
    for _ in range(DECODE_STEPS):
        tokens[0].append(int(logits[0].argmax()))
        tokens[1].append(int(logits[1].argmax()))
        tokens[2].append(int(logits[-1].argmax()))
        logits = both("decode", [SequenceChunk(t[-1:], len(t) - 1, table) for t, table in zip(tokens, tables)])
    # Two sequences, then one: the CUDA GEMVs' buckets (`linear.gemv`) on bf16 engines.
    for alive in (2, 2, 1, 1):
        for s in range(alive):
            tokens[s].append(int(logits[s].argmax()))
        logits = both(f"decode of {alive}", [SequenceChunk(t[-1:], len(t) - 1, table)
                                             for t, table in list(zip(tokens, tables))[:alive]])
    return results


@pytest.fixture(scope="module")
def engine_dir(factory, tmp_path_factory):
    """engine_dir(family, dtype, max_seq_len): an engine for ["cpu", this GPU], built once."""
    from kiln.runtime.cuda_driver import device_arch

    root, built = tmp_path_factory.mktemp("cuda-executor"), {}

    def get(family: str, dtype: str, max_seq_len: int):
        key = (family, dtype, max_seq_len)
        if key not in built:
            built[key] = root / f"{family}-{dtype}-{max_seq_len}"
            result = build_cli(factory.checkpoint(family), built[key], ["cpu", device_arch()], root / "cache",
                               dtype=dtype, max_seq_len=max_seq_len, max_num_tokens=320, max_batch_size=64)
            assert result.returncode == 0, result.stderr + result.stdout
        return built[key]
    return get


@pytest.mark.parametrize("family,dtype,max_seq_len,tol", CASES)
def test_cuda_executor_matches_cpu_executor(engine_dir, record_property, family, dtype, max_seq_len, tol):
    from kiln.runtime.cuda_executor import CudaExecutor

    engine = load_engine(engine_dir(family, dtype, max_seq_len))
    cpu, gpu = CpuExecutor(engine, NUM_BLOCKS), CudaExecutor(engine, NUM_BLOCKS)
    try:
        results = run_both(cpu, gpu, engine)
        report = ", ".join(f"{name} {err:.2e}" for name, err, _, _ in results)
        record_property("relative_errors", report)  # in the JUnit XML of a GPU run
        for name, err, got, want in results:
            assert got.shape == want.shape and got.dtype == torch.float32 and got.device.type == "cpu", name
            assert torch.isfinite(got).all(), name
            assert err < tol, f"{family} {dtype}: {report}"
        # The KV cache written by the kernels holds what the reference wrote.
        assert rel_err(gpu.kv_cache[:, :, :NUM_BLOCKS].float().cpu(), cpu.kv_cache.float()) < tol
        # Copy-on-write copies blocks on the device as on the CPU.
        src = steps(engine)[1][0][0]
        gpu.copy_blocks([(src, NUM_BLOCKS - 1)])
        assert torch.equal(gpu.kv_cache[:, :, NUM_BLOCKS - 1], gpu.kv_cache[:, :, src])
    finally:
        cpu.close()
        gpu.close()


def test_cuda_executor_refuses_step_beyond_bounds(engine_dir):
    from kiln.runtime.cuda_executor import CudaExecutor

    engine = load_engine(engine_dir("llama3", "bfloat16", 256))
    gpu = CudaExecutor(engine, NUM_BLOCKS)
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    too_many = engine.manifest.max_num_tokens + 1
    with pytest.raises(ValueError, match=f"step has {too_many} tokens"):
        # Two sequences: the engine's token bound is above its sequence bound.
        half = too_many // 2
        gpu.run(pack_step([SequenceChunk([5] * half, 0, list(range(nb))),
                           SequenceChunk([5] * (too_many - half), 0, list(range(nb, 2 * nb)))], bs, nb))
    gpu.close()


def test_session_on_cuda_generates_what_the_cpu_generates(engine_dir):
    """EngineCore picks the CUDA executor for device="cuda"; greedy fp32 tokens match the CPU's."""
    from kiln.runtime import SamplingParams, Session

    path = engine_dir("qwen3", "float32", 512)
    prompts = [[5, 17, 42, 99, 7, 3], [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        with Session(path, device=device) as session:
            outputs[device] = [o.outputs[0].token_ids for o in session.generate(prompt_token_ids=prompts,
                                                                               sampling_params=params)]
    assert outputs["cuda"] == outputs["cpu"]


def test_decode_graphs_equal_eager_launches(engine_dir):
    """A replayed decode graph, padded from 3 to 4 sequences, gives the eager launches' logits
    bit for bit, and its padding rows leave every real KV block alone."""
    from kiln.runtime.cuda_executor import CudaExecutor

    engine = load_engine(engine_dir("llama3", "bfloat16", 256))
    graphed, eager = CudaExecutor(engine, NUM_BLOCKS), CudaExecutor(engine, NUM_BLOCKS, cuda_graphs=False)
    try:
        assert sorted(graphed.graphs)[:4] == [1, 2, 4, 8] and not eager.graphs
        prompts, tables, bs, nb = steps(engine)
        for ex in (graphed, eager):
            ex.run(pack_step([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)], bs, nb))
        before = graphed.kv_cache[:, :, :NUM_BLOCKS].clone()
        decode = pack_step([SequenceChunk([7], len(p), t) for p, t in zip(prompts, tables)], bs, nb)
        got, want = graphed.run(decode), eager.run(decode)
        assert got.shape == want.shape == (3, want.shape[1]) and torch.equal(got, want)
        changed = (graphed.kv_cache[:, :, :NUM_BLOCKS] != before).flatten(3).any(-1).nonzero()[:, 2].unique()
        slots = decode.slot_mapping.tolist()
        assert sorted(changed.tolist()) == sorted({s // bs for s in slots})
        assert torch.equal(graphed.kv_cache[:, :, :NUM_BLOCKS], eager.kv_cache[:, :, :NUM_BLOCKS])
    finally:
        graphed.close()
        eager.close()


def test_overlapped_loop_on_cuda_matches_the_plain_loop_and_never_waits_for_the_gpu(engine_dir):
    """On the GPU the overlapped loop gives the plain loop's tokens, and scheduling, running and
    sampling a step wait for nothing the device does: torch's sync debug mode turns any implicit
    synchronisation there (`.item()`, `.tolist()`, a blocking copy) into an error. Only the
    settling of the step before waits, on its event."""
    from kiln.runtime.engine_core import EngineCore
    from kiln.runtime.sampling_params import SamplingParams

    path = engine_dir("qwen3", "float32", 512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 23)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=50, seed=4, n=3, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=2, stop_token_ids=[7, 11]),
              SamplingParams(temperature=0.7, min_p=0.1, seed=5, max_tokens=12)]
    outputs = {}
    for overlap in (False, True):
        core = EngineCore(path, device="cuda", overlap=overlap)
        if overlap:
            for name in ("_run", "_sample"):
                def no_sync(*args, _fn=getattr(core, name)):
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        return _fn(*args)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                setattr(core, name, no_sync)
        try:
            requests = [core.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
            while core.has_work():
                core.step()
            outputs[overlap] = [[s.output_ids for s in r.seqs] for r in requests]
            assert core.blocks.num_free == core.blocks.num_blocks
        finally:
            core.close()
    assert outputs[True] == outputs[False]
