"""Engines built from every supported family match `transformers` on the CPU in float32:
a batched prefill of two prompts and 8 decode steps after it, within 1e-4 relative error."""
from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from kiln.builder.cli import inspect_engine
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step

FAMILIES = ["llama2", "llama3", "llama3.2", "llama-linear-rope", "mistral", "qwen2", "qwen3"]
DECODE_STEPS = 8


def run_engine(engine_dir, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill all prompts in one step (logits of every prompt token), then decode greedily in
    batched steps. Returns the full token lists and, per sequence, logits for every position."""
    engine = load_engine(engine_dir)
    ex = CpuExecutor(engine, num_kv_blocks=64)
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    # Interleaved, out-of-order blocks so paging is really exercised.
    tables = [list(range(s, 64, len(prompts)))[::-1][:nb] for s in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    logits = ex.run(pack_step([SequenceChunk(p, 0, t, all_logits=True) for p, t in zip(prompts, tables)], bs, nb))
    per_seq = list(logits.split([len(p) for p in prompts]))
    for _ in range(DECODE_STEPS):
        nxt = [int(seq_logits[-1].argmax()) for seq_logits in per_seq]
        chunks = [SequenceChunk([t], len(toks), table) for t, toks, table in zip(nxt, tokens, tables)]
        for toks, t in zip(tokens, nxt):
            toks.append(t)
        step = ex.run(pack_step(chunks, bs, nb))
        per_seq = [torch.cat([s, step[i:i + 1]]) for i, s in enumerate(per_seq)]
    return tokens, per_seq


def reference_logits(checkpoint, tokens: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def check_against_transformers(checkpoint, engine_dir) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (11, 6)]
    tokens, logits = run_engine(engine_dir, prompts)
    for toks, got in zip(tokens, logits):
        # Teacher-forced: transformers sees the engine's own greedy tokens.
        want = reference_logits(checkpoint, toks)
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(factory, family):
    ckpt = factory.checkpoint(family)
    check_against_transformers(ckpt, factory.engine(ckpt, dtype="float32"))


def test_sliding_window_matches_transformers(factory, tmp_path):
    ckpt = factory.checkpoint("mistral")
    windowed = tmp_path / "mistral-window"
    windowed.mkdir()
    for f in ckpt.iterdir():
        (windowed / f.name).write_bytes(f.read_bytes())
    config = json.loads((windowed / "config.json").read_text())
    config["sliding_window"] = 5
    (windowed / "config.json").write_text(json.dumps(config))
    engine = factory.engine(windowed, dtype="float32")
    assert {op.attrs["window"] for op in load_engine(engine).plan if "window" in op.attrs} == {5}
    check_against_transformers(windowed, engine)


def test_sharded_bfloat16_checkpoint(factory):
    """Several safetensors shards with an index, stored in bf16, built as a float32 engine."""
    ckpt = factory.checkpoint("llama3", dtype="bfloat16", max_shard_size="40KB")
    assert (ckpt / "model.safetensors.index.json").is_file()
    assert len(list(ckpt.glob("*.safetensors"))) > 1
    check_against_transformers(ckpt, factory.engine(ckpt, dtype="float32"))


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_shows_fused_ops_in_every_layer(factory, family):
    ckpt = factory.checkpoint(family)
    result = CliRunner().invoke(inspect_engine, [str(factory.engine(ckpt, dtype="float32"))])
    assert result.exit_code == 0, result.output
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    plan_lines = re.findall(r"^\s+\d+ (\w+)\s+-> (\S+)", result.output, re.M)
    for layer in range(layers):
        ops = {op for op, out in plan_lines if f"layers.{layer}." in out}
        assert {"norm_qkv_rope", "attention_o_proj", "norm_swiglu"} <= ops, (layer, ops)
    assert "memory plan: arena" in result.output and "targets  cpu" in result.output


def test_bfloat16_engine_tracks_float32(factory):
    """A bf16 engine on the CPU stays close to the float32 one (bf16 rounding only)."""
    ckpt = factory.checkpoint("qwen3")
    prompts = [[5, 17, 33, 90, 4, 8, 250]]
    _, f32 = run_engine(factory.engine(ckpt, dtype="float32"), prompts)
    _, b16 = run_engine(factory.engine(ckpt, dtype="bfloat16"), prompts)
    assert rel_err(b16[0][:len(prompts[0])], f32[0][:len(prompts[0])]) < 5e-2
