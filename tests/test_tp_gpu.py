"""Tensor parallelism on GPUs (GPU only: `pytest -m gpu`): a TP 2 engine, one NCCL rank per
GPU with its collectives inside the decode graphs (the all-reduces, and the all-gather of the
vocabulary-parallel LM head's logits), generates what the TP 1 engine generates (greedy, and
seeded samples drawn on rank 0's GPU), summing with the custom all-reduce for decode-sized
messages (the default) and with NCCL alone (KILN_ALL_REDUCE=nccl); and an engine with more
ranks than the machine has GPUs is refused by name."""
from __future__ import annotations

import pytest
import torch

from gpu_build import build_cli
from kiln.engines.format import read_engine_file
from kiln.runtime import SamplingParams, Session
from kiln.runtime.engine import EngineLoadError

pytestmark = pytest.mark.gpu


def _build(factory, tmp_path, tp_size: int):
    from kiln.runtime.cuda_driver import device_arch

    out = tmp_path / f"tp{tp_size}"
    args = [] if tp_size == 1 else ["--tp-size", str(tp_size)]
    result = build_cli(factory.checkpoint("llama3"), out, [device_arch()], tmp_path / "cache", dtype="float32",
                       max_seq_len=128, max_num_tokens=128, max_batch_size=16, extra=args)
    assert result.returncode == 0, result.stderr + result.stdout
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("all_reduce", ["auto", "nccl"])
def test_tp2_on_two_gpus_generates_what_tp1_generates(factory, tmp_path, monkeypatch, all_reduce):
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 7][: 2 + i % 4] for i in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # Rank 0 samples on its GPU with generators on that GPU, as TP 1 does on its own.
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, n=1 + i % 2, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    monkeypatch.setenv("KILN_ALL_REDUCE", all_reduce)
    outputs = {}
    for tp in (1, 2):
        engine = _build(factory, tmp_path, tp)
        heads = [op.attrs.get("all_gather", 0) for op in read_engine_file(engine / "rank0.engine").manifest.plan
                 if op.source == "lm_head"]
        assert heads == [0 if tp == 1 else 2]  # the TP 2 head keeps half the vocabulary and gathers the logits
        with Session(engine, device="cuda") as session:
            if tp == 2:
                assert session._core.executor.custom_all_reduce == (all_reduce == "auto")
            outputs[tp] = [[c.token_ids for c in o.outputs]
                           for params in (greedy, seeded)
                           for o in session.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert outputs[2] == outputs[1]


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="the test model's 4 heads allow at most 4 ranks")
def test_more_ranks_than_gpus_is_refused(factory, tmp_path):
    gpus = torch.cuda.device_count()
    ranks = 2 if gpus < 2 else 4
    with pytest.raises(EngineLoadError, match=f"{ranks} tensor-parallel ranks, one GPU each, but this machine has "
                                              f"{gpus} GPU"):
        Session(_build(factory, tmp_path, ranks), device="cuda")
