"""`--kv-cache-dtype fp8` end to end on the CPU: the engine contract (the manifest's KV spec, its
scales weight, old engines still loading), the pool holding twice the tokens in the same bytes,
what the executor writes into the cache, the scales a checkpoint carries or calibration gives, tensor-parallel
ranks' scales, and prefix caching, copy-on-write and preemption on an e4m3 cache."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kiln.builder.build import build_engine
from kiln.builder.cli import build_engine as build_cli, inspect_engine
from kiln.builder.config import BuildConfig
from kiln.engines.format import read_engine_file
from kiln.engines.manifest import Manifest, ManifestError
from kiln.models import CheckpointError, read_config, read_kv_scales
from kiln.plugins.fp8 import FP8, to_e4m3
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session
from kiln.runtime.step import SequenceChunk, pack_step

from session_fixtures import *  # noqa: F401,F403 (fixtures and helpers)
from test_prefix_caching_engine import conversations, run_conversations

LAYERS, KV_HEADS = 2, 2  # the random checkpoints'


@pytest.fixture(scope="module")
def fp8_engine_dir(factory, checkpoint):
    return factory.engine(checkpoint, dtype="float32", max_batch_size=MAX_BATCH_SIZE, max_num_tokens=MAX_NUM_TOKENS,
                          kv_cache_dtype="fp8")


def test_manifest_records_the_cache_dtype_and_its_scales(fp8_engine_dir, engine_dir):
    ef = read_engine_file(fp8_engine_dir / "rank0.engine")
    kv = ef.manifest.kv
    assert (kv.dtype, kv.scales, kv.scale_granularity) == ("float8_e4m3fn", "kv_scales", "tensor")
    assert torch.equal(ef.weights["kv_scales"], torch.ones(LAYERS, 2, KV_HEADS))  # no calibration: 1.0
    assert ef.manifest.tensors["kv_cache"].dtype == "float8_e4m3fn"
    # Every op that writes or reads the cache takes the scales.
    cache_ops = [p for p in ef.manifest.plan if "kv_cache" in p.inputs]
    assert cache_ops and all(p.inputs["kv_scales"] == "kv_scales" for p in cache_ops)
    plain = read_engine_file(engine_dir / "rank0.engine").manifest
    assert "scales" not in plain.to_json()["kv_cache"]  # written as engines before the field were
    assert plain.kv.bytes_per_token == 2 * kv.bytes_per_token * 2  # float32 against e4m3
    shown = CliRunner().invoke(inspect_engine, [str(fp8_engine_dir)])
    assert "float8_e4m3fn" in shown.output and "tensor scales in weight kv_scales" in shown.output


def test_a_manifest_whose_fp8_cache_has_no_scales_is_refused(fp8_engine_dir):
    data = read_engine_file(fp8_engine_dir / "rank0.engine").manifest.to_json()
    Manifest.from_json(data)
    for change, message in (({"scales": None}, "must name a float32 weight"),
                            ({"scales": "lm_head.weight"}, "must name a float32 weight of shape"),
                            ({"scale_granularity": "row"}, "scale_granularity must be one of")):
        bad = json.loads(json.dumps(data))
        bad["kv_cache"].update(change)
        with pytest.raises(ManifestError, match=message):
            Manifest.from_json(bad)
    plain = json.loads(json.dumps(data))
    plain["kv_cache"]["dtype"] = "float32"
    with pytest.raises(ManifestError, match="a float32 cache has no scales"):
        Manifest.from_json(plain)


def test_an_engine_from_before_kv_scales_loads_and_runs(engine_dir, tmp_path):
    """An older plan names no kv_scales input: the loader gives the ops None in its place."""
    engine = load_engine(engine_dir)
    for op in engine.plan:
        if "kv_cache" in op.inputs:
            assert list(op.inputs) == op.spec.input_names and op.inputs["kv_scales"] is None
    ex = CpuExecutor(engine, num_kv_blocks=32)
    logits = ex.run(pack_step([SequenceChunk([5, 6, 7], 0, [0, 1])], 4, engine.manifest.blocks_per_sequence))
    assert torch.isfinite(logits).all()


def test_the_same_memory_holds_twice_the_tokens(factory, checkpoint):
    bf16 = factory.engine(checkpoint, dtype="bfloat16")
    fp8 = factory.engine(checkpoint, dtype="bfloat16", kv_cache_dtype="fp8")
    pools = []
    for engine in (bf16, fp8):
        with Session(engine, device="cpu", max_kv_tokens=256) as session:
            pools.append(session.kv_pool)
            assert session.stats["kv_blocks_total"] == session.kv_pool.num_blocks
    assert pools[0].bytes_per_block == 2 * pools[1].bytes_per_block
    assert pools[0].nbytes == 2 * pools[1].nbytes  # the same tokens in half the bytes
    # Given the bytes the bf16 pool takes, the e4m3 one fits twice the tokens.
    from kiln.runtime.kv_pool import size_kv_pool
    engine = load_engine(fp8)
    budget = pools[0].nbytes
    assert budget // engine.manifest.kv.bytes_per_block * engine.manifest.kv.block_size == 2 * pools[0].num_tokens
    assert size_kv_pool(engine, False, None, 2 * pools[0].num_tokens).nbytes == budget


def test_the_executor_writes_each_token_as_e4m3_of_its_value_over_the_scale(factory, checkpoint, engine_dir):
    """Layer 0's k and v are the same in both engines (nothing quantized comes before them), so
    the e4m3 engine's layer-0 cache is exactly to_e4m3 of the float32 engine's, v's blocks
    transposed to [kv_heads, head_dim, block_size]; fused and --no-fuse plans write the same bytes."""
    fp8_dirs = [factory.engine(checkpoint, dtype="float32", max_batch_size=MAX_BATCH_SIZE,
                               max_num_tokens=MAX_NUM_TOKENS, kv_cache_dtype="fp8", fuse=fuse) for fuse in (True, False)]
    prompt, table = list(range(3, 30)), list(range(10))
    caches = []
    for engine_path in [engine_dir, *fp8_dirs]:
        engine = load_engine(engine_path)
        ex = CpuExecutor(engine, num_kv_blocks=16)
        ex.run(pack_step([SequenceChunk(prompt, 0, table)], 4, engine.manifest.blocks_per_sequence))
        caches.append(ex.kv_cache.clone())
    plain, fused, unfused = caches
    assert fused.dtype == FP8
    want = to_e4m3(plain[0], 1.0).view(torch.uint8)
    got = fused[0].view(torch.uint8)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].flatten(), want[1].permute(0, 2, 3, 1).flatten())
    assert torch.equal(unfused.view(torch.uint8), fused.view(torch.uint8))


def with_kv_scales(src, dst, names: dict[int, tuple[str, str]], values: torch.Tensor, config_extra: dict):
    """A copy of checkpoint folder `src` whose safetensors also hold per-layer scale tensors
    (names[layer] = (k name, v name)) and whose config.json gains `config_extra`."""
    import shutil
    shutil.copytree(src, dst)
    (path,) = dst.glob("*.safetensors")
    tensors = load_file(path)
    for layer, (k_name, v_name) in names.items():
        tensors[k_name], tensors[v_name] = values[layer, 0].clone(), values[layer, 1].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.update(config_extra)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


COMPRESSED_TENSORS = {"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {
    "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}}


@pytest.mark.parametrize("style", ["compressed-tensors", "compressed-tensors-old", "modelopt", "per-head"])
def test_scales_from_a_checkpoint_reach_the_engine(factory, checkpoint, tmp_path, style):
    per_head = style == "per-head"
    values = 0.01 + torch.rand(LAYERS, 2, KV_HEADS if per_head else 1, generator=torch.Generator().manual_seed(3))
    if not per_head:
        values = values[..., 0]
    pattern = {"compressed-tensors": ("self_attn.k_scale", "self_attn.v_scale"),
               "per-head": ("self_attn.k_scale", "self_attn.v_scale"),
               "compressed-tensors-old": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
               "modelopt": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")}[style]
    names = {i: tuple(f"model.layers.{i}.{p}" for p in pattern) for i in range(LAYERS)}
    ckpt = with_kv_scales(checkpoint, tmp_path / "ckpt", names, values, COMPRESSED_TENSORS)
    want = values if per_head else values[..., None].expand(-1, -1, KV_HEADS)
    assert torch.equal(read_kv_scales(ckpt, read_config(ckpt)), want)
    summary = build_engine(ckpt, tmp_path / "engine", BuildConfig(dtype="float32", max_seq_len=64, kv_block_size=4,
                                                                  kv_cache_dtype="fp8"))
    assert "with the checkpoint's scales" in summary.render()
    ef = read_engine_file(tmp_path / "engine" / "rank0.engine")
    assert torch.equal(ef.weights["kv_scales"], want)
    assert ef.manifest.kv.scale_granularity == ("head" if per_head else "tensor")
    # Without fp8 the scales are not model weights, and the build says they are there.
    summary = build_engine(ckpt, tmp_path / "plain", BuildConfig(dtype="float32", max_seq_len=64, kv_block_size=4))
    assert "carries FP8 KV-cache scales" in summary.render()


def test_calibration_prompts_give_the_cache_a_scale_per_kv_head(checkpoint, tmp_path):
    """--calibration-prompts with --kv-cache-dtype fp8 alone: each layer's k and v get a scale per kv head, the
    largest magnitude the prompts wrote there over 448, which the build names; the engine runs on them.
    A checkpoint's own scales win over calibration."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is Paris.\nOne, two, three, four, five.\n")
    build = dict(dtype="float32", max_seq_len=64, kv_block_size=4, kv_cache_dtype="fp8")
    summary = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**build, calibration_prompts=str(prompts)))
    assert "scales calibrated per kv head on --calibration-prompts" in summary.render()
    scales = read_engine_file(tmp_path / "engine" / "rank0.engine").weights["kv_scales"]
    assert scales.shape == (LAYERS, 2, KV_HEADS) and bool((scales > 0).all()) and bool((scales != 1.0).all())
    assert scales.unique().numel() > LAYERS   # heads differ
    uncalibrated = build_engine(checkpoint, tmp_path / "ones", BuildConfig(**build))
    assert "--calibration-prompts would calibrate them" in uncalibrated.render()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with Session(tmp_path / "engine", device="cpu") as session:
        (out,) = session.generate(prompt_token_ids=[[5, 6, 7, 8, 9]], sampling_params=params)
    assert len(out.outputs[0].token_ids) == 6
    values = torch.full((LAYERS, 2), 0.02)
    names = {i: (f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale") for i in range(LAYERS)}
    ckpt = with_kv_scales(checkpoint, tmp_path / "ckpt", names, values, COMPRESSED_TENSORS)
    summary = build_engine(ckpt, tmp_path / "theirs", BuildConfig(**build, calibration_prompts=str(prompts)))
    assert "with the checkpoint's scales" in summary.render()
    assert torch.equal(read_engine_file(tmp_path / "theirs" / "rank0.engine").weights["kv_scales"],
                       values[..., None].expand(-1, -1, KV_HEADS))


def test_a_checkpoint_with_some_layers_scales_missing_is_refused(checkpoint, tmp_path):
    ckpt = with_kv_scales(checkpoint, tmp_path / "ckpt", {0: ("model.layers.0.self_attn.k_scale",
                                                              "model.layers.0.self_attn.v_scale")},
                          torch.ones(LAYERS, 2), COMPRESSED_TENSORS)
    with pytest.raises(CheckpointError, match="none for layer 1's k"):
        read_kv_scales(ckpt, read_config(ckpt))
    done = CliRunner().invoke(build_cli, ["--checkpoint", str(ckpt), "--output", str(tmp_path / "e"), "--target", "cpu",
                                          "--kv-cache-dtype", "fp8", "--max-seq-len", "64", "--quiet"])
    assert done.exit_code == 2 and "none for layer 1's k" in done.output


@pytest.mark.parametrize("bad", [0.0, float("nan"), -1.0])
def test_a_checkpoint_with_a_damaged_kv_scale_is_refused(checkpoint, tmp_path, bad):
    """The cache write divides by each scale: a zero, negative or NaN one is named, not used."""
    values = torch.full((LAYERS, 2), 0.02)
    values[1, 1] = bad
    names = {i: (f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale") for i in range(LAYERS)}
    ckpt = with_kv_scales(checkpoint, tmp_path / "ckpt", names, values, COMPRESSED_TENSORS)
    with pytest.raises(CheckpointError, match="'model.layers.1.self_attn.v_scale' holds .*finite number above 0"):
        read_kv_scales(ckpt, read_config(ckpt))


def test_tensor_parallel_ranks_take_their_kv_heads_scales(checkpoint, tmp_path):
    """Per-head scales, different for each head: each rank holds and reads its own kv head's,
    so TP=2 gives TP=1's greedy tokens (a rank reading the other's scales would not)."""
    values = torch.arange(1, 1 + LAYERS * 2 * KV_HEADS, dtype=torch.float32).reshape(LAYERS, 2, KV_HEADS) / 2048
    names = {i: (f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale") for i in range(LAYERS)}
    ckpt = with_kv_scales(checkpoint, tmp_path / "ckpt", names, values, COMPRESSED_TENSORS)
    build = dict(dtype="float32", max_seq_len=64, kv_block_size=4, max_num_tokens=32, kv_cache_dtype="fp8")
    for tp in (1, 2):
        build_engine(ckpt, tmp_path / f"tp{tp}", BuildConfig(**build, tp_size=tp))
    assert read_engine_file(tmp_path / "tp1" / "rank0.engine").manifest.kv.scale_granularity == "head"
    for rank in range(2):
        ef = read_engine_file(tmp_path / "tp2" / f"rank{rank}.engine")
        # A rank's manifest describes its own weight: one kv head, so one scale per layer and k or v.
        assert ef.manifest.kv.num_kv_heads == 1 and ef.manifest.kv.scale_granularity == "tensor"
        assert torch.equal(ef.weights["kv_scales"], values[:, :, rank:rank + 1])
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        with Session(tmp_path / f"tp{tp}", device="cpu") as session:
            tokens.append([o.outputs[0].token_ids for o in session.generate(prompt_token_ids=prompts,
                                                                            sampling_params=params)])
    assert tokens[0] == tokens[1]


def test_prefix_caching_copy_on_write_and_preemption_on_an_e4m3_cache(fp8_engine_dir, factory, checkpoint):
    """The same tokens with prefix caching on as off, with n=2 samples (copy-on-write block
    copies), and under preemption in a pool of a few blocks: these copy cache bytes, whatever
    their dtype."""
    convs = conversations(4, first_len=10, user_len=(3, 6), turns=3, max_tokens=7, n2_turns=(1,), seed=1)
    want, _, _ = run_conversations(fp8_engine_dir, convs, caching=False)
    got, _, on = run_conversations(fp8_engine_dir, convs, caching=True)
    assert got == want and on.blocks.cache_hits > 0
    short = factory.engine(checkpoint, dtype="float32", max_batch_size=MAX_BATCH_SIZE, max_num_tokens=MAX_NUM_TOKENS,
                           max_seq_len=SHORT_SEQ_LEN, kv_cache_dtype="fp8")
    convs = conversations(4, first_len=8, user_len=(3, 3), turns=3, max_tokens=5, n2_turns=(0,), seed=2)
    want, _, off = run_conversations(short, convs, caching=False, max_kv_tokens=48, policy="max_utilization")
    got, _, on = run_conversations(short, convs, caching=True, max_kv_tokens=48, policy="max_utilization")
    assert got == want and off.scheduler.num_preemptions > 0 and on.scheduler.num_preemptions > 0


def test_copy_blocks_copies_e4m3_bytes(fp8_engine_dir):
    engine = load_engine(fp8_engine_dir)
    ex = CpuExecutor(engine, num_kv_blocks=8)
    ex.kv_cache.view(torch.uint8).copy_(torch.randint(0, 120, ex.kv_cache.shape, dtype=torch.uint8))
    before = ex.kv_cache.view(torch.uint8).clone()
    ex.copy_blocks([(2, 5)])
    after = ex.kv_cache.view(torch.uint8)
    assert torch.equal(after[:, :, 5], before[:, :, 2]) and torch.equal(after[:, :, 2], before[:, :, 2])


def test_onnx_export_refuses_an_fp8_kv_engine(fp8_engine_dir, tmp_path):
    from kiln.builder.onnx_export import OnnxExportError, export_onnx
    with pytest.raises(OnnxExportError, match="FP8 KV cache.*--kv-cache-dtype auto"):
        export_onnx(fp8_engine_dir, tmp_path / "m.onnx")
