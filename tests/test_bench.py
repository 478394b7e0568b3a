"""bench-engine (issue 4, item 4): the whole command on a tiny model on the CPU, the eager baseline producing the
engine's own greedy tokens, a tensor-parallel engine folder taken with no extra flags, and clear errors for bad flags.
The cost model's own tests are in test_bench_limits.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kiln.bench import startup
from kiln.bench.cli import bench_engine
from kiln.bench.eager import EagerModel
from kiln.bench.figures import Figure
from kiln.bench.hardware import Hardware
from kiln.bench.report import render
from kiln.engines.format import read_engine_file
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

TINY = ["--shape", "tiny", "--device", "cpu", "--max-batch-size", "8", "--max-seq-len", "64",
        "--max-num-tokens", "64", "--decode-context", "12", "--decode-steps", "6"]
SMALL_RUN = ["--batch-sizes", "1,2", "--offline", "8/8", "--offline-requests", "4",
             "--rate-lengths", "8/8", "--rate-requests", "4", "--rate", "200",
             "--prefix-lengths", "16/4/4", "--prefix-requests", "4", "--prefix-turns", "2"]


def invoke(*args):
    return CliRunner().invoke(bench_engine, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One full run on the tiny shape: random checkpoint, engine, every phase, eager baseline."""
    root = tmp_path_factory.mktemp("bench")
    result = invoke(*TINY, *SMALL_RUN, "--work-dir", root / "work", "--json", root / "out.json")
    assert result.exit_code == 0, result.output
    return root, result, json.loads((root / "out.json").read_text())


def test_json_has_every_section_with_positive_figures(tiny_run):
    _, _, data = tiny_run
    for key in ("date", "commit", "device", "torch", "command", "hardware", "build"):
        assert key in data
    assert data["command"].startswith("bench-engine ") and "--device cpu --shape tiny" in data["command"]
    hw = data["hardware"]
    assert hw["copy_bandwidth_bytes_per_s"] > 0 and hw["gemm_flops_per_s"] > 0
    assert [f["batch"] for f in data["decode"]] == [1, 2]
    assert [f["name"] for f in data["offline"]] == ["offline 8/8 output", "offline 8/8 total"]
    assert [f["name"] for f in data["latency"]] == [f"{w} p{p}" for w in ("TTFT", "ITL") for p in (50, 90, 99)]
    for section in ("decode", "offline", "latency"):
        for f in data[section]:
            assert f["value"] > 0 and f["limit"] > 0 and f["bound"] in ("bytes", "flops"), f
    for f in data["decode"] + data["offline"]:
        assert f["eager"] > 0, f  # the baseline ran beside every throughput figure


def test_prefix_caching_is_measured_on_and_off_in_one_run(tiny_run):
    _, result, data = tiny_run
    figures = {f["name"]: f for f in data["prefix"]}
    assert list(figures) == [
        "prefix on: TTFT p50 first turns", "prefix on: TTFT p50 follow-ups", "prefix on: output",
        "prefix off: TTFT p50 first turns", "prefix off: TTFT p50 follow-ups", "prefix off: output",
        "prefix: TTFT p50 first turns, on vs off", "prefix: TTFT p50 follow-ups, on vs off",
        "no hits on: output", "no hits off: output", "no hits: caching's throughput cost"]
    on, off = figures["prefix on: output"], figures["prefix off: output"]
    # 4 conversations of 2 turns: prompts of 16 + 4 tokens, then 20 + 4 out + 4 more. The system
    # prompt fills one 16-token block, which 3 first turns find cached; each follow-up finds the
    # full block of its first turn's 23 computed tokens.
    assert data["build"]["kv_block_size"] == 16
    assert on["requests"] == 4 and on["turns"] == 2 and on["value"] > 0 and off["value"] > 0
    assert on["query_tokens"] == 4 * (20 + 28) and on["hit_tokens"] == 3 * 16 + 4 * 16
    assert off["hit_rate"] is None and figures["no hits on: output"]["hit_rate"] == 0
    assert len(figures["no hits on: output"]["repeat_tok_s"]) == 3
    for what in ("first turns", "follow-ups"):
        ratio = figures[f"prefix: TTFT p50 {what}, on vs off"]["value"]
        assert ratio == pytest.approx(figures[f"prefix off: TTFT p50 {what}"]["value"] /
                                      figures[f"prefix on: TTFT p50 {what}"]["value"])
    cost = figures["no hits: caching's throughput cost"]["value"]
    no_hits = figures["no hits on: output"]["value"], figures["no hits off: output"]["value"]
    assert cost == pytest.approx(100 * (no_hits[1] - no_hits[0]) / no_hits[1])
    assert "prefix on: TTFT p50 first turns (ms)" in result.stdout


def test_start_up_is_timed_in_a_fresh_process(tiny_run):
    _, result, data = tiny_run
    loaded, first = data["startup"]
    assert (loaded["name"], first["name"]) == ("start-up to engine loaded", "start-up to first token")
    # A fresh interpreter: importing torch alone takes a good part of a second.
    assert 0.2 < loaded["value"] <= first["value"] < startup.TIMEOUT_S
    assert loaded["unit"] == "s" and loaded["limit"] is None and first["kv_tokens"] == 8 * 64
    assert "start-up to first token (s)" in result.stdout


def test_decode_step_time_beside_graph_replay(tiny_run):
    _, result, data = tiny_run
    for f in data["decode"]:
        assert f["ms_per_step"] == pytest.approx(1e3 * f["seconds"] / f["steps"])
        # No CUDA graphs on the CPU: the replay time and the host's share are absent, not 0;
        # one rank has no collectives.
        assert f["replay_ms_per_step"] is None and f["host_share"] is None
        assert f["collective_ms_per_step"] is None and f["collective_share"] is None
    table = result.stdout[result.stdout.index("decode step"):].splitlines()
    assert table[0].split()[:2] == ["decode", "step"] and "graph replay (ms)" in table[0]
    assert "collective" not in result.stdout
    assert table[2].startswith("decode b=1") and table[2].split()[-2:] == ["-", "-"]


def test_step_table_shows_the_hosts_share_where_graphs_replayed():
    hw = Hardware("cuda", "H200", 4e12, 8e14, 2**30, 8192, "bfloat16")
    f = Figure("decode", "decode b=8", "tok/s", 1000.0, key=("decode", 8),
               params={"ms_per_step": 5.0, "replay_ms_per_step": 4.0, "host_share": 0.2})
    lines = render([f], hw, [], []).splitlines()
    row = lines[lines.index(next(line for line in lines if line.startswith("decode step"))) + 2]
    assert row.split()[-3:] == ["5.000", "4.000", "20.0%"]


def test_ratios_are_the_figure_over_its_limit(tiny_run):
    _, _, data = tiny_run
    for f in data["decode"] + data["offline"]:
        assert f["ratio_to_limit"] == pytest.approx(f["value"] / f["limit"])
        assert f["ratio_to_eager"] == pytest.approx(f["value"] / f["eager"])
        assert f["ratio_to_limit"] < 1  # nothing beats the hardware
    for f in data["latency"]:  # lower is better: the limit is a floor
        assert f["ratio_to_limit"] == pytest.approx(f["limit"] / f["value"]) and f["ratio_to_limit"] < 1
    decode1 = data["decode"][0]
    assert decode1["tokens"] == decode1["steps"] == 6
    assert decode1["value"] == pytest.approx(decode1["tokens"] / decode1["seconds"])
    assert len(decode1["window_tok_s"]) == 3
    assert decode1["value"] == pytest.approx(sorted(decode1["window_tok_s"])[1])  # the median window
    out, total = data["offline"]
    assert total["value"] == pytest.approx(2 * out["value"])  # 8 in + 8 out per request
    # The schedule: 4 requests at once, so a step runs 1 to 4 sequences; the shares add up.
    assert 1 <= out["mean_batch"] <= 4 and out["steps"] >= 8
    assert out["prefill_steps"] + out["decode_steps"] + out["mixed_steps"] == pytest.approx(1)
    assert out["decode_steps"] > 0 and out["prefill_steps"] + out["mixed_steps"] > 0
    assert any(n.startswith("offline 8/8: 4 requests in") and "mean running batch" in n for n in data["notes"])


def test_table_on_stdout_names_each_figure(tiny_run):
    _, result, _ = tiny_run
    for name in ("decode b=1 (tok/s)", "decode b=2 (tok/s)", "offline 8/8 output (tok/s)", "TTFT p50 (ms)",
                 "ITL p99 (ms)", "copy bandwidth", "GEMM"):
        assert name in result.stdout
    assert "Traceback" not in result.output


def test_second_run_reuses_checkpoint_and_engine(tiny_run):
    root, _, _ = tiny_run
    result = invoke(*TINY, "--only", "decode", "--batch-sizes", "1", "--no-baseline",
                    "--work-dir", root / "work", "--json", root / "again.json")
    assert result.exit_code == 0, result.output
    assert "reusing engine" in result.output and "wrote" not in result.output
    data = json.loads((root / "again.json").read_text())
    assert data["offline"] == data["latency"] == [] and "eager baseline skipped (--no-baseline)" in data["notes"]


def test_fp8_engine_is_measured_beside_the_bf16_one_in_the_same_run(tiny_run):
    root, _, _ = tiny_run
    result = invoke(*TINY, "--dtype", "bfloat16", "--only", "decode,offline", "--batch-sizes", "1,2", "--offline", "8/8",
                    "--offline-requests", "2", "--quantization", "fp8", "--work-dir", root / "work",
                    "--json", root / "fp8.json")
    assert result.exit_code == 0, result.output
    data = json.loads((root / "fp8.json").read_text())
    for section in ("decode", "offline"):
        plain = [f for f in data[section] if "quantization" not in f]
        fp8 = [f for f in data[section] if f.get("quantization") == "fp8"]
        assert len(plain) == len(fp8) > 0
        for base, f in zip(plain, fp8):
            assert f["name"] == f"fp8 {base['name']}" and f["bf16"] == base["value"]
            assert f["ratio_to_bf16"] == pytest.approx(f["value"] / base["value"])
    assert data["quantized_engine"].endswith("-fp8-" + data["quantized_engine"].rsplit("-", 1)[1])
    assert "vs bf16" in result.output and "fp8 decode b=1" in result.output


def test_fp8_engine_with_its_lm_head_quantized_too(tiny_run):
    root, _, _ = tiny_run
    result = invoke(*TINY, "--dtype", "bfloat16", "--only", "decode", "--batch-sizes", "1", "--no-baseline",
                    "--quantization", "fp8", "--quantize-lm-head", "--work-dir", root / "work",
                    "--json", root / "lmhead.json")
    assert result.exit_code == 0, result.output
    data = json.loads((root / "lmhead.json").read_text())
    assert "-fp8-lmhead-" in data["quantized_engine"] and data["options"]["quantize_lm_head"] is True
    weights = read_engine_file(Path(data["quantized_engine"]) / "rank0.engine").weights
    assert weights["lm_head.weight"].dtype == torch.float8_e4m3fn and "lm_head.weight_scale" in weights
    assert "fp8, LM head too" in result.output and "fp8 decode b=1" in result.output


def test_fp8_engine_with_static_activation_scales(tiny_run):
    root, _, _ = tiny_run
    prompts = root / "calibration.txt"
    prompts.write_text("hello there\nthe quick brown fox\n")
    result = invoke(*TINY, "--dtype", "bfloat16", "--only", "decode", "--batch-sizes", "1", "--no-baseline",
                    "--quantization", "fp8", "--calibration-prompts", prompts, "--work-dir", root / "work",
                    "--json", root / "static.json")
    assert result.exit_code == 0, result.output
    data = json.loads((root / "static.json").read_text())
    assert "-fp8-static" in data["quantized_engine"]
    weights = read_engine_file(Path(data["quantized_engine"]) / "rank0.engine").weights
    assert any(name.endswith(".input_scale") for name in weights)
    assert f"static activation scales from {prompts}" in result.output and "fp8 decode b=1" in result.output


@pytest.mark.parametrize("flag,words", [(["--quantize-lm-head"], "give --quantization fp8 too"),
                                        (["--calibration-prompts", __file__],
                                         "give --quantization fp8 or --kv-cache-dtype fp8 too")])
def test_lm_head_quantization_and_calibration_need_the_quantized_engine(flag, words, tmp_path):
    result = invoke(*TINY, *flag, "--json", tmp_path / "x.json")
    assert result.exit_code == 2 and words in result.output


def test_fp8_comparison_needs_a_checkpoint_not_an_engine(tmp_path):
    result = invoke("--engine", tmp_path, "--device", "cpu", "--quantization", "fp8", "--json", tmp_path / "x.json")
    assert result.exit_code == 2 and "not --engine" in result.output


def test_plain_loop_is_measured_with_no_overlap(tiny_run):
    root, _, _ = tiny_run
    result = invoke(*TINY, "--only", "decode", "--batch-sizes", "1", "--no-baseline", "--no-overlap",
                    "--work-dir", root / "work", "--json", root / "plain.json")
    assert result.exit_code == 0, result.output
    data = json.loads((root / "plain.json").read_text())
    assert data["options"]["no_overlap"] is True and data["decode"][0]["value"] > 0


def test_a_batch_whose_prefill_takes_several_steps_decodes_whole(tiny_run):
    # 8 prompts of 12 tokens take two steps of 64 tokens: the decode pool must admit all of them
    # under the projected-peak policy (which rounds each sequence's last block up), or the leftover
    # requests wait until the others finish and the timed steps decode those few alone.
    root, _, _ = tiny_run
    result = invoke(*TINY, "--only", "decode", "--batch-sizes", "8", "--decode-steps", "12", "--no-baseline",
                    "--work-dir", root / "work", "--json", root / "whole.json")
    assert result.exit_code == 0, result.output
    figure = json.loads((root / "whole.json").read_text())["decode"][0]
    assert figure["note"] == "" and figure["tokens"] == 8 * 12


def test_batches_the_engine_cannot_hold_are_skipped_with_a_note(tiny_run):
    root, _, _ = tiny_run
    result = invoke(*TINY, "--only", "decode,offline,prefix", "--batch-sizes", "1,16", "--offline", "40/40",
                    "--no-baseline", "--work-dir", root / "work", "--json", root / "skip.json")
    assert result.exit_code == 0, result.output
    data = json.loads((root / "skip.json").read_text())
    assert all(f["value"] is None and "max_batch_size 8" in f["note"] for f in data["prefix"])  # 64 requests
    assert data["decode"][0]["value"] > 0
    assert data["decode"][1]["value"] is None and "max_batch_size 8" in data["decode"][1]["note"]
    assert all(f["value"] is None and "max_seq_len 64" in f["note"] for f in data["offline"])
    assert "skipped" in result.stdout


# -- the eager baseline is the same model -----------------------------------------------------

@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])  # plain, q/k/v bias, q/k norm
def test_eager_baseline_greedy_tokens_match_the_engine(factory, family):
    checkpoint = factory.checkpoint(family)
    engine = factory.engine(checkpoint, dtype="float32")
    prompts = torch.randint(3, 380, (3, 10), generator=torch.Generator().manual_seed(1))
    eager = EagerModel.load(checkpoint, "float32", 64, "cpu").greedy(prompts, 8)
    with Session(engine) as session:
        outs = session.generate(prompt_token_ids=prompts.tolist(),
                                sampling_params=SamplingParams(temperature=0, ignore_eos=True, max_tokens=8))
    assert eager.tolist() == [o.outputs[0].token_ids for o in outs]


# -- a tensor-parallel engine folder, as is ----------------------------------------------------

def test_tensor_parallel_engine_folder_needs_no_flags(factory, tmp_path):
    engine = factory.engine(factory.checkpoint("llama3"), dtype="float32", tp_size=2)
    result = invoke("--engine", engine, "--device", "cpu", "--only", "decode", "--batch-sizes", "2",
                    "--decode-context", "8", "--decode-steps", "4", "--json", tmp_path / "tp.json")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "tp.json").read_text())
    assert data["world_size"] == 2 and data["decode"][0]["value"] > 0
    assert any("no eager baseline" in n for n in data["notes"])
    # The share of a step its collectives take, estimated from collectives timed apart. Not
    # compared with the step time: both are timings, and on a loaded CPU the estimate taken
    # apart can exceed a step's (it failed so once in a full run on a busy 2-core machine).
    f = data["decode"][0]
    assert f["collective_ms_per_step"] > 0 and f["ms_per_step"] > 0
    assert f["collective_share"] == pytest.approx(f["collective_ms_per_step"] / f["ms_per_step"])
    table = result.stdout[result.stdout.index("decode step"):].splitlines()
    assert "collective share" in table[0] and table[2].split()[-1].endswith("%")
    assert "timed apart" in result.stdout


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--batch-sizes", "0"], "positive integer"),
    (["--batch-sizes", "1,x"], "positive integers separated by commas"),
    (["--offline", "128x128"], "like 128/128"),
    (["--offline", "128/0"], "like 128/128"),
    (["--rate", "0"], "--rate"),
    (["--only", "prefill"], "choose from startup, decode, offline, latency, prefix"),
    (["--rate-lengths", "8/8,16/16"], "give one IN/OUT pair"),
    (["--engine", "/nonexistent/engine"], "does not exist"),
    (["--shape", "tiny", "--heads", "3"], "divide"),
])
def test_bad_flags_give_a_clear_error(args, message, tmp_path):
    result = invoke("--device", "cpu", "--work-dir", tmp_path, "--json", tmp_path / "x.json", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, (TypeError, KeyError))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU does")
def test_bare_run_without_a_gpu_writes_no_8b_checkpoint(tmp_path):
    result = invoke("--work-dir", tmp_path / "work", "--json", tmp_path / "x.json")
    assert result.exit_code == 2, result.output
    assert "no GPU here" in result.output and "--shape tiny" in result.output and "8B-parameter" in result.output
    assert not (tmp_path / "work").exists()


def test_fp8_kv_cache_is_measured_beside_the_model_dtype_cache(tmp_path):
    """--kv-cache-dtype fp8: decode and offline again on the e4m3-cache engine in the same run,
    its pool twice the tokens of the same bytes (here both hold every request), each figure
    beside its model-dtype twin, with the ratio in a note."""
    result = invoke(*TINY, "--only", "decode,offline", "--batch-sizes", "2", "--offline", "8/8",
                    "--offline-requests", "4", "--kv-cache-dtype", "fp8", "--work-dir", tmp_path / "work",
                    "--json", tmp_path / "out.json")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out.json").read_text())
    assert [f["name"] for f in data["offline"]] == ["offline 8/8 output", "offline 8/8 total",
                                                    "offline 8/8 output [fp8 KV]", "offline 8/8 total [fp8 KV]"]
    assert [f.get("kv_cache") for f in data["decode"]] == [None, "fp8"]
    for plain, fp8 in ((data["decode"][0], data["decode"][1]), (data["offline"][0], data["offline"][2])):
        assert plain["value"] > 0 and fp8["value"] > 0 and fp8["eager"] == plain["eager"] > 0
    ratio = data["offline"][2]["value"] / data["offline"][0]["value"]
    assert f"offline 8/8 output: fp8 KV {ratio:.2f}x the bfloat16 KV cache" in result.stdout
    engines = [p.name for p in (tmp_path / "work" / "engines").glob("*/*")]
    assert len(engines) == 2 and sum("-fp8kv-" in name for name in engines) == 1


def test_fp8_weights_with_the_fp8_kv_cache_beside_bf16(tmp_path):
    """--quantization fp8 --kv-cache-dtype fp8: the FP8 engine has the e4m3 cache too (the figure FP8
    serving is quoted by), beside the bf16 engine; the bf16 weights with the e4m3 cache run as before."""
    result = invoke(*TINY, "--dtype", "bfloat16", "--only", "decode", "--batch-sizes", "2", "--no-baseline",
                    "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--work-dir", tmp_path / "work",
                    "--json", tmp_path / "out.json")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out.json").read_text())
    assert "-fp8kv-fp8-" in data["quantized_engine"]
    assert read_engine_file(Path(data["quantized_engine"]) / "rank0.engine").manifest.kv.dtype == "float8_e4m3fn"
    assert [(f.get("kv_cache"), f.get("quantization")) for f in data["decode"]] == [
        (None, None), ("fp8", None), (None, "fp8")]
    assert "fp8, e4m3 KV cache, the same checkpoint" in result.output


def test_the_fp8_kv_engine_takes_the_calibration_prompts(tmp_path):
    """--kv-cache-dtype fp8 --calibration-prompts without --quantization: the e4m3-cache engine's scales come
    from the prompts (a scale per kv head, not 1.0); the model-dtype engine has none."""
    prompts = tmp_path / "calibration.txt"
    prompts.write_text("hello there\nthe quick brown fox\n")
    result = invoke(*TINY, "--only", "decode", "--batch-sizes", "2", "--no-baseline", "--kv-cache-dtype", "fp8",
                    "--calibration-prompts", prompts, "--work-dir", tmp_path / "work", "--json", tmp_path / "out.json")
    assert result.exit_code == 0, result.output
    (engine,) = [p for p in (tmp_path / "work" / "engines").glob("*/*") if "-fp8kv-" in p.name]
    scales = read_engine_file(engine / "rank0.engine").weights["kv_scales"]
    assert "-static" in engine.name and bool((scales != 1.0).all())


def test_an_engine_from_older_sources_is_deleted_and_other_flags_kept(tmp_path, monkeypatch):
    """Only the same flags built from other sources go: an engine whose flags begin with these ones
    ("-fp8kv" and "-fp8kv-fp8") is another engine."""
    from kiln.bench import model
    from kiln.builder.config import BuildConfig

    monkeypatch.setattr(model, "build_engine", lambda ckpt, path, cfg, progress: (path.mkdir(parents=True),
                                                                                (path / "rank0.engine").touch()))
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    kv = BuildConfig(kv_cache_dtype="fp8", targets=("cpu",))
    fp8 = BuildConfig(kv_cache_dtype="fp8", quantization="fp8", targets=("cpu",))
    built = model.engine_path(tmp_path, checkpoint, kv)
    older = built.with_name(built.name.rsplit("-", 1)[0] + "-0123456789ab")
    older.mkdir(parents=True)
    other, _ = model.ensure_engine(tmp_path, checkpoint, fp8)
    assert model.ensure_engine(tmp_path, checkpoint, kv) == (built, False)
    assert not older.exists() and other.exists() and "-fp8kv-fp8-" in other.name


def test_fp8_kv_cache_needs_a_checkpoint_not_an_engine(tmp_path):
    result = invoke("--engine", tmp_path, "--device", "cpu", "--kv-cache-dtype", "fp8")
    assert result.exit_code == 2 and "give --checkpoint (or a --shape) instead of --engine" in result.output
