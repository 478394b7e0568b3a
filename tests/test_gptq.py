"""builder/gptq.py, and GPTQ through calibration and the quantize pass: where GPTQ must equal rounding
to nearest, that it errs less than it on the inputs it saw, and that `--gptq` engines carry its rounding."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from kiln.builder.calibrate import calibrate
from kiln.builder.cli import build_engine as build_cli
from kiln.builder.config import BuildConfig, BuildConfigError
from kiln.builder.gptq import gptq_e4m3
from kiln.builder.ir import in_spec_order
from kiln.builder.passes.quantize import quantize_fp8, weights_to_quantize
from kiln.engines.format import read_engine_file
from kiln.models.random_checkpoint import write_random_checkpoint
from kiln.plugins.fp8 import FP8, dequantize_rows, quantize_rows
from kiln.runtime.step import SequenceChunk, pack_step
from pass_graphs import BLOCK_SIZE, make_llama, new_cache, nodes_of, run_graph


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def correlated_inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Inputs whose channels move together, a few of them large: what a projection sees after a norm."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(tokens, k, generator=g) @ mix + 0.1 * torch.randn(tokens, k, generator=g)
    x[:, :4] *= 20
    return x


def output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    ref = x @ w.t()
    return ((x @ dequantize_rows(q, scale).t() - ref).norm() / ref.norm()).item()


def test_uncorrelated_inputs_leave_nothing_to_move_so_gptq_rounds_to_nearest():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    hessian = torch.diag(torch.rand(256, generator=torch.Generator().manual_seed(2)) + 0.5)
    q, scale = gptq_e4m3(w, hessian)
    want_q, want_scale = quantize_rows(w)
    assert q.dtype == FP8 and torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale)


def test_gptq_errs_less_than_rounding_to_nearest_on_inputs_like_the_calibration():
    k = 320   # more than one block of columns
    w = 0.02 * torch.randn(96, k, generator=torch.Generator().manual_seed(3))
    x = correlated_inputs(3000, k, seed=4)
    seen, unseen = x[:2000], x[2000:]   # the same distribution: the calibration's tokens and others
    q, scale = gptq_e4m3(w, seen.t() @ seen)
    nearest = quantize_rows(w)
    assert torch.equal(scale, nearest[1])   # each row keeps rounding to nearest's scale
    for x in (seen, unseen):
        assert output_error(x, w, q, scale) < 0.6 * output_error(x, w, *nearest)   # measured 0.45x and 0.50x
    # It buys that by moving weights further from their own values.
    assert (dequantize_rows(q, scale) - w).norm() > (dequantize_rows(*nearest) - w).norm()


def test_an_input_channel_the_prompts_never_reached_is_rounded_to_nearest():
    k = 64
    w = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    x = correlated_inputs(400, k, seed=6)
    x[:, 9] = 0
    q, _ = gptq_e4m3(w, x.t() @ x)
    nearest, _ = quantize_rows(w)
    assert torch.equal(bits(q)[:, 9], bits(nearest)[:, 9])
    assert not torch.equal(bits(q), bits(nearest))


def hessians_of(g, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each linear weight's sum of x^T x over its inputs, prompt after prompt."""
    hessians: dict[str, torch.Tensor] = {}
    for ids in prompts:
        env = run_graph(g, pack_step([SequenceChunk(ids, 0, [0, 1, 2])], BLOCK_SIZE, 3), new_cache(g))
        for node in nodes_of(g, "linear"):
            x = env[node.inputs["x"]].float()
            hessians[node.inputs["weight"]] = hessians.get(node.inputs["weight"], 0) + x.t() @ x
    return hessians


def test_calibration_rounds_each_weight_over_its_inputs_with_the_weights_before_it_rounded():
    g = make_llama(layers=2)
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8]]
    in_order = [n.inputs["weight"] for n in nodes_of(g, "linear")]
    assert sorted(weights_to_quantize(g)) == sorted(in_order[:-1])   # 7 a layer; not the LM head
    first, later = in_order[0], in_order[9]   # layer 0's q_proj; a projection of layer 1
    measured = calibrate(g, prompts, BLOCK_SIZE, gptq=[first, later])
    assert sorted(measured.rounded) == sorted([first, later])
    # The first is rounded over the model's own inputs ...
    want_q, want_scale = gptq_e4m3(g.weights[first], hessians_of(g, prompts)[first])
    q, scale = measured.rounded[first]
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale)
    # ... and the later one over what its op gets with the first running W8A8 with its rounding.
    g_first = g.copy()
    node = next(n for n in g_first.nodes if n.inputs.get("weight") == first)
    node.inputs["weight"] = g_first.add_weight(f"{first}.fp8", q)
    node.inputs = in_spec_order(node.op, {**node.inputs, "weight_scale": g_first.add_weight(f"{first}.scale", scale)})
    unrounded_q, _ = gptq_e4m3(g.weights[later], hessians_of(g, prompts)[later])
    want_q, _ = gptq_e4m3(g.weights[later], hessians_of(g_first, prompts)[later])
    assert torch.equal(bits(measured.rounded[later][0]), bits(want_q))
    assert not torch.equal(bits(want_q), bits(unrounded_q))
    # The quantize pass takes these two as they are and rounds the rest to nearest.
    quantized = quantize_fp8(g, rounded=measured.rounded)
    for name in in_order[:-1]:
        want = measured.rounded.get(name) or quantize_rows(g.weights[name])
        assert torch.equal(bits(quantized.weights[name]), bits(want[0])), name


def test_gptq_needs_fp8_and_calibration_prompts():
    with pytest.raises(BuildConfigError, match="--gptq needs --quantization fp8 and --calibration-prompts"):
        BuildConfig(quantization="fp8", gptq=True)
    with pytest.raises(BuildConfigError, match="--gptq needs"):
        BuildConfig(calibration_prompts="p.txt", kv_cache_dtype="fp8", gptq=True)


SMALL = ["--dtype", "bfloat16", "--max-seq-len", "64", "--max-num-tokens", "64", "--max-batch-size", "4",
         "--kv-block-size", "4", "--quiet", "--target", "cpu"]


def build(*args) -> str:
    result = CliRunner().invoke(build_cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_gptq_engine_holds_its_rounding_and_says_so(tmp_path):
    checkpoint = write_random_checkpoint(tmp_path / "ckpt", "llama3", dtype="bfloat16", hidden_size=64,
                                         num_layers=2, seed=7)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is Paris.\nWrite a haiku about autumn leaves.\nWhat is 17 times 23?\n")
    common = ["--checkpoint", checkpoint, *SMALL, "--quantization", "fp8"]
    build(*common, "--output", tmp_path / "nearest")
    summary = build(*common, "--calibration-prompts", prompts, "--gptq", "--output", tmp_path / "gptq")
    assert "(per-token activation scales)" in summary
    assert "8 FP8 weights rounded by GPTQ over the" in summary
    nearest, gptq = (read_engine_file(tmp_path / e / "rank0.engine").weights for e in ("nearest", "gptq"))
    assert nearest.keys() == gptq.keys()
    fp8 = [n for n, w in nearest.items() if w.dtype == FP8]
    assert fp8 and all(gptq[n].dtype == FP8 for n in fp8)
    assert all(torch.equal(gptq[n], nearest[n]) for n in nearest if n.endswith("_scale"))
    assert sum(not torch.equal(bits(gptq[n]), bits(nearest[n])) for n in fp8) == len(fp8)


def test_gptq_on_a_prequantized_checkpoint_is_refused(tmp_path):
    checkpoint = write_random_checkpoint(tmp_path / "ckpt", "llama3", dtype="bfloat16", hidden_size=64,
                                         num_layers=1, seed=7, fp8_format="modelopt")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is Paris.\n")
    result = CliRunner().invoke(build_cli, [str(a) for a in ["--checkpoint", checkpoint, *SMALL, "--output",
                                tmp_path / "o", "--quantization", "fp8", "--calibration-prompts", prompts, "--gptq"]])
    assert result.exit_code == 2 and "FP8 already" in result.output and "without --gptq" in result.output
    assert not (tmp_path / "o").exists()
