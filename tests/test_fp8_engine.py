"""FP8 engines end to end on the CPU: `build-engine --quantization fp8`, the sm_80 refusal, the
manifest field, and pre-quantized compressed-tensors and ModelOpt checkpoints written by
make-checkpoint, which give the same engine bytes and tokens as quantizing the same weights."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kiln.builder.build import build_engine
from kiln.builder.cli import build_engine as build_cli
from kiln.builder.cli import inspect_engine
from kiln.builder.config import BuildConfig
from kiln.engines.format import read_engine_file
from kiln.models import CheckpointError, load
from kiln.models.random_checkpoint import main as make_checkpoint
from kiln.models.random_checkpoint import write_random_checkpoint
from kiln.plugins.fp8 import FP8
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step

BUILD = dict(dtype="bfloat16", max_seq_len=64, max_num_tokens=64, max_batch_size=4, kv_block_size=4)
SMALL = ["--dtype", "bfloat16", "--max-seq-len", "64", "--max-num-tokens", "64", "--max-batch-size", "4",
         "--kv-block-size", "4", "--quiet"]
PROMPT = list(range(3, 40))


def invoke(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random qwen2 weights (q/k/v biases) in bf16, and written pre-quantized."""
    root = tmp_path_factory.mktemp("fp8")
    kw = dict(dtype="bfloat16", hidden_size=64, num_layers=2, seed=3)
    return {fmt: write_random_checkpoint(root / (fmt or "bf16"), "qwen2", fp8_format=fmt, **kw)
            for fmt in (None, "compressed-tensors", "modelopt")}


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-engines")
    out = {"bf16": root / "bf16", "fp8": root / "fp8"}
    build_engine(checkpoints[None], out["bf16"], BuildConfig(**BUILD))
    build_engine(checkpoints[None], out["fp8"], BuildConfig(**BUILD, quantization="fp8"))
    for fmt in ("compressed-tensors", "modelopt"):
        out[fmt] = root / fmt
        build_engine(checkpoints[fmt], out[fmt], BuildConfig(**BUILD, quantization="fp8"))
    return out


def logits(engine_dir) -> torch.Tensor:
    engine = load_engine(engine_dir)
    ex = CpuExecutor(engine, num_kv_blocks=32)
    table = list(range(engine.manifest.blocks_per_sequence))
    return ex.run(pack_step([SequenceChunk(PROMPT, 0, table)], 4, len(table)))


def greedy(engine_dir, n: int = 12) -> list[int]:
    from kiln import SamplingParams, Session
    with Session(engine_dir) as s:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return s.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids


def test_fp8_engine_stores_e4m3_weights_and_runs_w8a8_on_the_cpu(engines):
    ef = read_engine_file(engines["fp8"] / "rank0.engine")
    assert ef.manifest.quantization == "fp8"
    fp8 = sorted(n for n, w in ef.weights.items() if w.dtype == FP8)
    assert len(fp8) == 2 * 4  # qkv, o, gate/up, down per layer; not the LM head or the embedding
    for name in fp8:
        scale = ef.weights[f"{name.removesuffix('.interleaved')}_scale" + (".interleaved" if name.endswith(".interleaved") else "")]
        assert scale.dtype == torch.float32 and scale.shape == (ef.weights[name].shape[0],)
    assert ef.weights["lm_head.weight"].dtype == torch.bfloat16
    fp8_logits, bf16_logits = logits(engines["fp8"]), logits(engines["bf16"])
    assert not torch.equal(fp8_logits, bf16_logits)  # the references did run in FP8
    # Random weights amplify e4m3 rounding; test_fp8_accuracy measures it on a trained model.
    assert ((fp8_logits - bf16_logits).norm() / bf16_logits.norm()).item() < 0.25
    assert "quantization=fp8" in invoke(inspect_engine, [engines["fp8"]]).output
    assert "quantization=none" in invoke(inspect_engine, [engines["bf16"]]).output


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_a_prequantized_checkpoint_gives_the_same_engine_as_quantizing_its_weights(engines, fmt):
    ours, theirs = read_engine_file(engines["fp8"] / "rank0.engine"), read_engine_file(engines[fmt] / "rank0.engine")
    assert set(ours.weights) == set(theirs.weights)
    for name, w in ours.weights.items():
        assert w.dtype == theirs.weights[name].dtype
        assert torch.equal(w.view(torch.uint8), theirs.weights[name].view(torch.uint8)), name
    assert torch.equal(logits(engines[fmt]), logits(engines["fp8"]))
    assert greedy(engines[fmt]) == greedy(engines["fp8"])


def test_per_tensor_scales_are_broadcast_to_every_channel(tmp_path, checkpoints):
    path = write_random_checkpoint(tmp_path / "ct", "qwen2", dtype="bfloat16", hidden_size=64, num_layers=2, seed=3,
                                   fp8_format="compressed-tensors", fp8_strategy="tensor")
    model, cfg = load(path, "bfloat16")
    q = model.model.layers[0].self_attn.q_proj
    assert cfg.quantization == "fp8" and q.weight.dtype == FP8
    assert q.weight_scale.shape == (q.weight.shape[0],) and len(set(q.weight_scale.tolist())) == 1
    dense, _ = load(checkpoints[None], "bfloat16")
    w = dense.model.layers[0].self_attn.q_proj.weight.float()
    back = q.weight.float() * q.weight_scale[:, None]
    assert ((back - w).norm() / w.norm()).item() < 0.06


def test_building_fp8_for_sm_80_is_refused_before_anything_is_written(checkpoints, tmp_path):
    out = tmp_path / "out"
    result = invoke(build_cli, ["--checkpoint", checkpoints[None], "--output", out, *SMALL,
                                "--target", "sm_90", "--target", "sm_80", "--quantization", "fp8"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "sm_80" in result.output and all(t in result.output for t in ("sm_89", "sm_90", "sm_100"))
    assert not out.exists()


@pytest.mark.parametrize("flags,words", [
    (["--quantization", "none"], ["holds fp8 weights", "--quantization fp8"]),
    (["--quantize-lm-head", "--quantization", "none"], ["holds fp8 weights"]),
])
def test_usage_errors_name_the_flag(checkpoints, tmp_path, flags, words):
    result = invoke(build_cli, ["--checkpoint", checkpoints["modelopt"], "--output", tmp_path / "o", *SMALL,
                                "--target", "cpu", *flags])
    assert result.exit_code == 2 and all(w in result.output for w in words), result.output


def test_quantize_lm_head_needs_fp8_and_quantizes_the_head(checkpoints, tmp_path):
    result = invoke(build_cli, ["--checkpoint", checkpoints[None], "--output", tmp_path / "a", *SMALL,
                                "--target", "cpu", "--quantize-lm-head"])
    assert result.exit_code == 2 and "--quantize-lm-head needs --quantization fp8" in result.output
    result = invoke(build_cli, ["--checkpoint", checkpoints[None], "--output", tmp_path / "b", *SMALL,
                                "--target", "cpu", "--quantization", "fp8", "--quantize-lm-head"])
    assert result.exit_code == 0, result.output
    assert "fp8 GEMMs (per-token activation scales)" in result.output
    weights = read_engine_file(tmp_path / "b" / "rank0.engine").weights
    assert weights["lm_head.weight"].dtype == FP8 and "lm_head.weight_scale" in weights


def _edit_config(folder, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("fmt,edit,words", [
    ("compressed-tensors", lambda q: q.update(quant_method="gptq"), ["'gptq' is not supported", "--quantization fp8"]),
    ("compressed-tensors", lambda q: q.update(quant_method="awq"), ["'awq' is not supported"]),
    ("compressed-tensors", lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"),
     ["strategy 'block' is not supported"]),
    ("compressed-tensors", lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"),
     ["8-bit int", "8-bit float"]),
    ("modelopt", lambda q: q.update(quant_algo="NVFP4"), ["quant_algo 'NVFP4' is not supported"]),
])
def test_unsupported_quantization_is_refused_clearly(checkpoints, tmp_path, fmt, edit, words):
    import shutil
    folder = tmp_path / "ck"
    shutil.copytree(checkpoints[fmt], folder)
    _edit_config(folder, edit)
    result = invoke(build_cli, ["--checkpoint", folder, "--output", tmp_path / "o", *SMALL, "--target", "cpu"])
    assert result.exit_code == 2 and all(w in result.output for w in words), result.output
    with pytest.raises(CheckpointError):
        load(folder)


def test_make_checkpoint_writes_both_formats(tmp_path):
    for fmt, marker in (("compressed-tensors", "config.json"), ("modelopt", "hf_quant_config.json")):
        result = invoke(make_checkpoint, ["--output", tmp_path / fmt, "--fp8-format", fmt, "--dtype", "bfloat16"])
        assert result.exit_code == 0, result.output
        assert (tmp_path / fmt / marker).is_file()
        config = json.loads((tmp_path / fmt / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == fmt


def test_calibration_prompts_give_o_proj_and_down_static_activation_scales(checkpoints, engines, tmp_path):
    """The ops whose input another kernel writes get a static scale (and that kernel hands them their
    input in e4m3); the ones that RMSNorm their input keep per-token scales."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is Paris.\n\nWrite a haiku about autumn leaves.\nWhat is 17 times 23?\n")
    out = tmp_path / "static"
    result = invoke(build_cli, ["--checkpoint", checkpoints[None], "--output", out, *SMALL, "--target", "cpu",
                                "--quantization", "fp8", "--calibration-prompts", prompts,
                                "--activation-scales", "static"])
    assert result.exit_code == 0, result.output
    assert "fp8 GEMMs (static activation scales)" in result.output
    ef = read_engine_file(out / "rank0.engine")
    static = {n: w for n, w in ef.weights.items() if n.endswith(".input_scale")}
    assert len(static) == 2 * 2 and all(w.shape == (1,) and w.dtype == torch.float32 for w in static.values())
    for op in ef.manifest.plan:
        if op.op in ("norm_qkv_rope", "attention_o_proj", "norm_swiglu", "linear_residual"):
            given = any(k.endswith("_input_scale") and v for k, v in op.inputs.items())
            assert given == (op.op in ("attention_o_proj", "linear_residual")), op.op
    # Each down projection takes its input in e4m3 from norm_swiglu, quantized with the down's scale.
    plan = ef.manifest.plan
    downs = [(producer, op) for producer, op in zip(plan, plan[1:]) if op.op == "linear_residual"
             and op.inputs["x"] == producer.output]
    assert len(downs) == sum(op.op == "norm_swiglu" for op in plan) == 2 and all(p.op == "norm_swiglu" for p, _ in downs)
    assert all(p.inputs["out_scale"] == d.inputs["weight_input_scale"] and d.attrs["fp8_handoff"] for p, d in downs)
    static_logits, bf16_logits = logits(out), logits(engines["bf16"])
    assert not torch.equal(static_logits, logits(engines["fp8"]))
    assert ((static_logits - bf16_logits).norm() / bf16_logits.norm()).item() < 0.25


@pytest.mark.parametrize("content,flags,words", [
    ("a prompt\n", [], ["--calibration-prompts needs --quantization fp8 or --kv-cache-dtype fp8"]),
    ("\n  \n", ["--quantization", "fp8", "--gptq"], ["--calibration-prompts", "holds no prompts"]),
    ("a prompt\n", ["--quantization", "fp8"], ["--calibration-prompts measures nothing", "--gptq",
                                              "--activation-scales static"]),
    ("a prompt\n", ["--activation-scales", "static"], ["--activation-scales static needs --quantization fp8"]),
])
def test_calibration_prompts_errors(checkpoints, tmp_path, content, flags, words):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(content)
    result = invoke(build_cli, ["--checkpoint", checkpoints[None], "--output", tmp_path / "o", *SMALL,
                                "--target", "cpu", "--calibration-prompts", prompts, *flags])
    assert result.exit_code == 2 and all(w in result.output for w in words), result.output
    assert not (tmp_path / "o").exists()


def test_a_checkpoints_static_input_scales_are_used_and_shared_inputs_take_the_largest(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    folder = tmp_path / "mo"
    shutil.copytree(checkpoints["modelopt"], folder)
    given = {"q_proj": 0.01, "k_proj": 0.03, "v_proj": 0.02, "o_proj": 0.05, "gate_proj": 0.04, "up_proj": 0.06,
             "down_proj": 0.07}
    for path in folder.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in [n for n in tensors if n.endswith("_proj.weight")]:
            proj = name.split(".")[-2]
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(given[proj])
        save_file(tensors, str(path), metadata={"format": "pt"})
    out = tmp_path / "engine"
    build_engine(folder, out, BuildConfig(**BUILD, quantization="fp8"))
    weights = read_engine_file(out / "rank0.engine").weights
    layer = "model.layers.0"
    assert weights[f"{layer}.self_attn.qkv_proj.input_scale"].tolist() == [pytest.approx(0.03)]
    assert weights[f"{layer}.mlp.gate_up_proj.input_scale"].tolist() == [pytest.approx(0.06)]
    assert weights[f"{layer}.self_attn.o_proj.input_scale"].tolist() == [pytest.approx(0.05)]
    assert weights[f"{layer}.mlp.down_proj.input_scale"].tolist() == [pytest.approx(0.07)]
    assert torch.isfinite(logits(out)).all()


@pytest.mark.parametrize("suffix,value", [("input_scale", 0.0), ("input_scale", float("nan")),
                                          ("input_scale", -0.02), ("weight_scale", float("inf"))])
def test_a_damaged_scale_in_a_checkpoint_is_refused_by_name(suffix, value, checkpoints, tmp_path):
    """Activations are divided by a static input scale, and a weight scale multiplies every product:
    a zero, negative or non-finite one would give NaN logits, so the build stops and names it."""
    import shutil

    from safetensors.torch import load_file, save_file
    folder = tmp_path / "mo"
    shutil.copytree(checkpoints["modelopt"], folder)
    target = "model.layers.1.mlp.down_proj"
    for path in folder.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in [n for n in tensors if n.endswith("_proj.weight")]:
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
        if f"{target}.weight_scale" in tensors:
            scale = tensors[f"{target}.{suffix}"] if suffix == "weight_scale" else torch.tensor(0.05)
            scale = scale.clone()
            scale.view(-1)[0] = value
            tensors[f"{target}.{suffix}"] = scale
        save_file(tensors, str(path), metadata={"format": "pt"})
    out = tmp_path / "o"
    result = invoke(build_cli, ["--checkpoint", folder, "--output", out, *SMALL, "--target", "cpu"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    for words in (f"{target}.{suffix}", "damaged", "--quantization fp8"):
        assert words in result.output, result.output
    assert not out.exists()


def test_a_plugin_without_fp8_kernels_for_a_target_is_refused(checkpoints, tmp_path, monkeypatch):
    from kiln.plugins import get_plugin
    monkeypatch.setattr(get_plugin("norm_qkv_rope").module("kernels"), "FP8_TARGETS", ("sm_89",))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "out"
    result = invoke(build_cli, ["--checkpoint", checkpoints[None], "--output", out, *SMALL, "--target", "sm_90",
                                "--quantization", "fp8"])
    assert result.exit_code == 2 and "'norm_qkv_rope' has no FP8 GPU kernels for sm_90" in result.output, \
        result.output
    assert not out.exists()


def test_an_engine_from_before_fp8_still_loads_and_runs(engines, tmp_path):
    """Format 2: no `quantization` in the manifest, no scale inputs in the plan."""
    import shutil
    import struct
    import zlib

    from kiln.engines.format import READS_VERSIONS
    old = tmp_path / "old"
    shutil.copytree(engines["bf16"], old)
    path = old / "rank0.engine"
    data = bytearray(path.read_bytes())
    _, _, _, m_off, m_len, _, _ = struct.unpack_from("<8sIIQQQI", data)
    manifest = json.loads(data[m_off:m_off + m_len])
    del manifest["quantization"]
    for op in manifest["plan"]:
        op["inputs"] = {k: v for k, v in op["inputs"].items() if not k.endswith("_scale")}
    body = json.dumps(manifest).encode().ljust(m_len, b" ")
    data[m_off:m_off + m_len] = body
    struct.pack_into("<I", data, 8, 2)
    struct.pack_into("<I", data, 40, zlib.crc32(body))
    path.write_bytes(bytes(data))
    assert 2 in READS_VERSIONS
    ef = read_engine_file(path)
    assert ef.manifest.quantization == "none"
    assert torch.equal(logits(old), logits(engines["bf16"]))
