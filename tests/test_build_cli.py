"""build-engine and inspect-engine as a user meets them: bad flags and bad checkpoints give a
usage error (no traceback) and leave nothing behind; good builds print a summary."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from kiln.builder.cli import build_engine, inspect_engine
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step

SMALL = ["--dtype", "float32", "--max-seq-len", "64", "--max-num-tokens", "64", "--max-batch-size", "4",
         "--kv-block-size", "4", "--target", "cpu", "--quiet"]


def invoke(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args])


def assert_nothing_left(parent, name="out"):
    leftovers = [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.tmp")]
    assert leftovers == []


def test_build_prints_summary_and_inspect_shows_plan(factory, tmp_path):
    ckpt = factory.checkpoint("qwen2")
    out = tmp_path / "out"
    result = invoke(build_engine, ["--checkpoint", ckpt, "--output", out, *SMALL])
    assert result.exit_code == 0, result.output
    for word in ("fused ops per layer", "norm_qkv_rope x1", "weights", "arena", "targets cpu", "time"):
        assert word in result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["rank0.engine", "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "chat_template.jinja"]
        + [p.name for p in ckpt.glob("generation_config.json")])
    shown = invoke(inspect_engine, [out])
    assert shown.exit_code == 0, shown.output
    assert "plan (" in shown.output and "memory plan: arena" in shown.output and "kv cache:" in shown.output
    as_json = json.loads(invoke(inspect_engine, [out, "--json"]).output)
    assert as_json["limits"]["max_seq_len"] == 64 and as_json["targets"] == ["cpu"]


def test_rebuild_replaces_previous_engine(factory, tmp_path):
    ckpt = factory.checkpoint("llama2")
    out = tmp_path / "out"
    assert invoke(build_engine, ["--checkpoint", ckpt, "--output", out, *SMALL]).exit_code == 0
    result = invoke(build_engine, ["--checkpoint", ckpt, "--output", out, *SMALL, "--tp-size", "2"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("*.engine")) == ["rank0.engine", "rank1.engine"]


@pytest.mark.parametrize("args, message", [
    (["--tp-size", "0"], "--tp-size must be a positive integer"),
    (["--kv-block-size", "6"], "--kv-block-size must be a power of two"),
    (["--max-seq-len", "-5"], "--max-seq-len must be a positive integer"),
    (["--max-seq-len", "0"], "--max-seq-len must be a positive integer, got 0"),
    (["--target", "sm_75"], "'sm_75' is not one of"),
    (["--dtype", "int8"], "'int8' is not one of"),
    (["--tp-size", "3"], "cannot be split over --tp-size 3"),
])
def test_bad_flags_are_usage_errors(factory, tmp_path, args, message):
    ckpt = factory.checkpoint("llama2")
    result = invoke(build_engine, ["--checkpoint", ckpt, "--output", tmp_path / "out", *SMALL, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert_nothing_left(tmp_path)


def _broken_checkpoint(factory, tmp_path, how):
    src = factory.checkpoint("llama2")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    if how == "architecture":
        config["architectures"] = ["GPT2LMHeadModel"]
    elif how == "missing key":
        del config["hidden_size"]
    elif how == "no weights":
        for f in ckpt.glob("*.safetensors"):
            f.unlink()
    elif how == "truncated weights":
        f = next(ckpt.glob("*.safetensors"))
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "wrong shape":
        config["intermediate_size"] += 8
    elif how == "no config":
        (ckpt / "config.json").unlink()
        return ckpt
    elif how == "rope":
        config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


@pytest.mark.parametrize("how, message", [
    ("architecture", "architecture 'GPT2LMHeadModel' is not supported; Kiln builds LlamaForCausalLM"),
    ("missing key", "missing required key 'hidden_size'"),
    ("no weights", "no *.safetensors files"),
    ("truncated weights", "cannot read"),
    ("wrong shape", "config.json implies"),
    ("no config", "has no config.json"),
    ("rope", "rope type 'yarn' is not supported"),
])
def test_bad_checkpoint_is_a_usage_error_and_leaves_nothing(factory, tmp_path, how, message):
    ckpt = _broken_checkpoint(factory, tmp_path, how)
    result = invoke(build_engine, ["--checkpoint", ckpt, "--output", tmp_path / "out", *SMALL])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert_nothing_left(tmp_path)


def test_missing_checkpoint_folder(tmp_path):
    result = invoke(build_engine, ["--checkpoint", tmp_path / "nope", "--output", tmp_path / "out", *SMALL])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_refuses_non_engine_output_folder(factory, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = invoke(build_engine, ["--checkpoint", factory.checkpoint("llama2"), "--output", out, *SMALL])
    assert result.exit_code == 2 and "not empty and holds no engine" in result.output
    assert (out / "notes.txt").read_text() == "keep me"


def test_inspect_missing_engine(tmp_path):
    result = invoke(inspect_engine, [tmp_path])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_help_teaches(factory):
    text = invoke(build_engine, ["--help"]).output
    for flag in ("--checkpoint", "--tp-size", "--max-num-tokens", "--kv-block-size", "--target", "Example"):
        assert flag in text


def test_no_fuse_keeps_the_traced_plan_and_its_answer(factory, tmp_path):
    ckpt = factory.checkpoint("qwen3")
    result = invoke(build_engine, ["--checkpoint", ckpt, "--output", tmp_path / "out", *SMALL, "--no-fuse"])
    assert result.exit_code == 0, result.output
    assert "fused ops per layer: none" in result.output
    unfused, fused = load_engine(tmp_path / "out"), load_engine(factory.engine(ckpt, dtype="float32"))
    ops = {op.spec.name for op in unfused.plan}
    assert not any(op.spec.fused for op in unfused.plan) and {"rope", "silu_mul", "attention"} <= ops
    step = pack_step([SequenceChunk(list(range(3, 14)), 0, [2, 0, 1])], 4, unfused.manifest.blocks_per_sequence)
    logits = [CpuExecutor(e, num_kv_blocks=4).run(step) for e in (unfused, fused)]
    assert torch.allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)

    # Only the fused plan has GPU kernels: the error names the first op without one.
    result = invoke(build_engine, ["--checkpoint", ckpt, "--output", tmp_path / "gpu", *SMALL, "--no-fuse",
                                   "--target", "sm_90"])
    assert result.exit_code == 2 and "op 'head_rms_norm'" in result.output and "has no GPU kernel" in result.output
    assert_nothing_left(tmp_path, "gpu")
