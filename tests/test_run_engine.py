"""run-engine as a user meets it: batched and streamed output agree with `Session.generate`, and
bad flags, refused prompts and missing engines give a clear message with no traceback."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from kiln.runtime.cli import run_engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

PROMPTS = ["The kiln was hot", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(factory):
    return factory.engine(factory.checkpoint("llama3"), dtype="float32")


def invoke(engine, *args):
    return CliRunner().invoke(run_engine, ["--engine", str(engine), *[str(a) for a in args]])


def prompt_args(prompts=PROMPTS):
    return [arg for p in prompts for arg in ("--prompt", p)]


@pytest.fixture(scope="module")
def plain(engine):
    """The batched greedy run most tests compare against."""
    result = invoke(engine, *prompt_args(), "--max-tokens", 12)
    assert result.exit_code == 0, result.output
    return result


def test_plain_run_prints_each_prompt_with_its_completion(plain):
    lines = plain.stdout.splitlines()
    assert len(lines) == 2
    for line, prompt in zip(lines, PROMPTS):
        assert line.startswith(prompt) and line.endswith("]")


def test_greedy_output_matches_session_generate(engine, plain):
    with Session(engine) as session:
        outs = session.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        assert f"{prompt}{c.text}  [{c.finish_reason}]" in plain.stdout.splitlines()


def test_stream_prints_the_same_text(engine, plain):
    streamed = invoke(engine, *prompt_args(), "--max-tokens", 12, "--stream")
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout == plain.stdout


def test_stream_holds_back_a_stop_string_until_it_is_cut(engine, plain):
    completion = plain.stdout.splitlines()[0][len(PROMPTS[0]):]
    stop = completion[4:7]  # somewhere inside the greedy text, so the stop does fire
    args = [*prompt_args(PROMPTS[:1]), "--max-tokens", 12, "--stop", stop]
    batched, streamed = invoke(engine, *args), invoke(engine, *args, "--stream")
    assert batched.exit_code == 0 and streamed.exit_code == 0, batched.output + streamed.output
    assert "[stop]" in batched.output and streamed.stdout == batched.stdout


def test_prompt_file_skips_blank_lines(engine, plain, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(f"{PROMPTS[0]}\n\n   \n{PROMPTS[1]}\n", encoding="utf-8")
    result = invoke(engine, "--prompt-file", path, "--max-tokens", 12)
    assert result.exit_code == 0, result.output
    assert result.stdout == plain.stdout


def test_n_labels_each_completion(engine):
    result = invoke(engine, *prompt_args(PROMPTS[:1]), "--max-tokens", 4, "--n", 2, "--temperature", 1,
                    "--seed", 0, "--logprobs", 2)
    assert result.exit_code == 0, result.output
    assert "[n=0]" in result.output and "[n=1]" in result.output and "logprob" in result.output


def test_stats_report_throughput_and_kv_use(engine):
    result = invoke(engine, *prompt_args(), "--max-tokens", 8, "--stats")
    assert result.exit_code == 0, result.output
    for word in ("requests", "generated tokens", "tokens/s", "time to first token", "preemptions"):
        assert word in result.output
    kv_line = next(line for line in result.output.splitlines() if line.startswith("KV blocks used"))
    peak, total = kv_line.split()[3], kv_line.split()[6]
    assert 0 < int(peak) <= int(total), kv_line


def test_stats_report_start_up_from_process_start(engine):
    """In a process of its own, so the clock starts with the interpreter: loaded, then first token,
    both within the process's life."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", "from kiln.runtime.cli import run_engine; run_engine()",
                             "--engine", str(engine), "--prompt", "Hello", "--max-tokens", "2", "--stats"],
                            capture_output=True, text=True, timeout=300)
    lived = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    seconds = {}
    for line in result.stderr.splitlines():
        for what in ("engine loaded", "first token"):
            if line.startswith(what):
                seconds[what] = float(line[len(what):].split()[0])
    assert 0 < seconds["engine loaded"] <= seconds["first token"] < lived, result.stderr


def test_no_overlap_prints_the_same_completions(engine, plain):
    result = invoke(engine, *prompt_args(), "--max-tokens", 12, "--no-overlap")
    assert result.exit_code == 0, result.output
    assert result.stdout == plain.stdout


def test_prefix_caching_is_reported_and_can_be_turned_off(engine, plain):
    # Streamed one after another, the second prompt finds the first's prompt in the cache.
    shared = ["The kiln was hot and the potter waited", "The kiln was hot and the potter slept"]
    result = invoke(engine, *prompt_args(shared), "--max-tokens", 4, "--stream", "--stats")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("prefix cache"))
    hits = int(line.split()[2])
    assert hits > 0 and "prompt tokens found cached" in line, line
    off = invoke(engine, *prompt_args(), "--max-tokens", 12, "--no-prefix-caching", "--stats")
    assert off.exit_code == 0, off.output
    assert off.stdout == plain.stdout and "off (--no-prefix-caching)" in off.output


@pytest.mark.parametrize("args, words", [
    (["--prompt", "Hi", "--temperature", -1], ["--temperature", "temperature must be >= 0"]),
    (["--prompt", "Hi", "--min-tokens", 9, "--max-tokens", 4], ["--min-tokens", "min_tokens"]),
    (["--prompt", "Hi", "--stream", "--n", 2], ["--stream"]),
    ([], ["--prompt"]),
    (["--prompt", "Hi", "--prompt-file", "-"], ["--prompt-file"]),
])
def test_bad_flags_are_usage_errors(engine, args, words):
    result = invoke(engine, *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output


@pytest.mark.parametrize("stream", [False, True], ids=["batched", "streamed"])
def test_refused_prompts_fail_alone(engine, plain, stream):
    long = " ".join(["kiln"] * 200)
    result = invoke(engine, "--prompt", PROMPTS[0], "--prompt", long, "--prompt", "", "--prompt", PROMPTS[1],
                    "--max-tokens", 12, *(["--stream"] if stream else []))
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    # The valid prompts print exactly what they print alone, in their order.
    assert result.stdout == plain.stdout
    assert "prompt 2 ('kiln kiln" in result.stderr and "max_seq_len is 64" in result.stderr
    assert "prompt 3 ('') was refused: prompt is empty" in result.stderr
    assert "2 of 4 prompts were refused" in result.stderr


def test_the_kv_pool_chosen_at_load_is_printed(plain):
    line = next(line for line in plain.stderr.splitlines() if line.startswith("KV cache:"))
    # The test engine's bounds (32 sequences of 64 tokens in 4-token blocks) cap the default pool.
    assert line.startswith("KV cache: 512 blocks of 4 tokens (2,048 tokens,") and "32 sequences of 64" in line


@pytest.mark.parametrize("args, words", [
    (["--kv-cache-fraction", 2], ["--kv-cache-fraction", "must be in (0, 1]", "got 2"]),
    (["--kv-cache-fraction", 0.5, "--max-kv-tokens", 64], ["--kv-cache-fraction", "give one of them"]),
    (["--max-kv-tokens", 8], ["--max-kv-tokens", "max_seq_len 64", "--max-kv-tokens 64 or more", "--max-seq-len"]),
    (["--max-kv-tokens", 0], ["--max-kv-tokens", "must be >= 1, got 0"]),
])
def test_bad_kv_pool_flags_name_the_flag(engine, args, words):
    result = invoke(engine, "--prompt", "Hi", *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output


def test_missing_engine_folder(tmp_path):
    result = CliRunner().invoke(run_engine, ["--engine", str(tmp_path / "nope"), "--prompt", "Hi"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "does not exist" in result.output and "build-engine" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error(engine):
    result = invoke(engine, "--prompt", "Hi", "--device", "cuda")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "no CUDA GPU" in result.output and "'cpu'" in result.output


def test_device_auto_runs_a_cpu_engine_on_the_cpu(engine, plain):
    assert invoke(engine, *prompt_args(), "--max-tokens", 12, "--device", "auto").stdout == plain.stdout


def test_help_teaches_by_example():
    result = CliRunner().invoke(run_engine, ["--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and "run-engine --engine engines/demo --prompt-file" in result.output
    assert "greedy" in result.output
