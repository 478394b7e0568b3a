"""The Triton interface without a server: request parsing into SamplingParams, TensorRT-LLM's
word-list format, replies (streaming, non-streaming, log probs, multi-token stop words), and the
repository writer and its CLIs."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.triton.cli import serve_triton, triton_repo
from kiln.runtime.triton.protocol import INPUTS, OUTPUTS, Reply, decode_word_list, parse_request
from kiln.runtime.triton.repo import MARKER, RepoError, write_repo


def _req(**values) -> dict:
    """Input tensors as Triton hands them over; arrays are given with their batch dim of 1,
    scalars plain (reshaped to [1] as config.pbtxt's reshape does)."""
    out = {}
    for name, value in values.items():
        spec = next(s for s in INPUTS if s.name == name)
        array = np.asarray(value, dtype=object if spec.dtype == "TYPE_STRING" else None)
        out[name] = array.reshape(1) if spec.scalar else array
    return out


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return type("Encoding", (), {"ids": [ord(c) for c in text]})()


def test_token_request_maps_to_sampling_params():
    job = parse_request(_req(input_ids=[[5, 6, 7, 0]], input_lengths=np.int32(3), request_output_len=np.int32(9),
                             temperature=np.float32(0.5), runtime_top_p=np.float32(0.75),
                             random_seed=np.uint64(2**63), min_length=np.int32(2), end_id=np.int32(4),
                             return_log_probs=True,
                             stop_words_list=[[[8, 9, 10], [1, 3, -1]]], bad_words_list=[[[11, 12], [2, -1]]]), None)
    p = job.params
    assert job.prompt_token_ids == [5, 6, 7] and not job.text and job.include_input and not job.streaming
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.min_tokens) == (9, 0.5, 0, 0.75, 2**63, 2)
    # end_id replaces eos; the one-token stop word stops in the Session, the longer one in the reply.
    assert p.stop_token_ids == (8, 4) and p.ignore_eos and job.stop_sequences == ((9, 10),)
    assert p.bad_words == ((11, 12),) and p.logprobs == 0 and job.return_log_probs


def test_end_id_minus_one_means_no_end_token():
    # As in TensorRT-LLM's tools: no stop token at all, and the eos is generated like any other.
    p = parse_request(_req(input_ids=[[5]], request_output_len=4, end_id=np.int32(-1)), None).params
    assert p.stop_token_ids == () and p.ignore_eos
    with pytest.raises(ValueError, match="end_id must be a token id, or -1 for no end token, got -2"):
        parse_request(_req(input_ids=[[5]], request_output_len=4, end_id=np.int32(-2)), None)


def test_neither_top_k_nor_top_p_is_greedy_as_in_tensorrt_llm():
    assert parse_request(_req(input_ids=[[5]], request_output_len=4), None).params.greedy
    sampled = parse_request(_req(input_ids=[[5]], request_output_len=4, runtime_top_k=np.int32(5)), None).params
    assert not sampled.greedy and sampled.top_p == 1.0


def test_text_request_with_stop_and_bad_words():
    job = parse_request(_req(text_input=[[b"Hello"]], max_tokens=np.int32(5), stream=True, stop_words=[[b'a,"b,c"']],
                             bad_words=[[b"xy", b"z,w"]]), FakeTokenizer())
    assert job.text and job.prompt == "Hello" and job.streaming and not job.include_input
    assert job.params.stop == ("a", "b,c")  # one string: comma-separated, with CSV quoting
    assert job.params.bad_words == ((120, 121), (122, 44, 119))  # several strings: taken as they are


@pytest.mark.parametrize("values, message", [
    (dict(request_output_len=4), "exactly one of them"),
    (dict(input_ids=[[5]], text_input=[[b"x"]], max_tokens=4), "exactly one of them"),
    (dict(input_ids=[[5]]), "request_output_len is missing"),
    (dict(text_input=[[b"x"]], max_tokens=4, runtime_top_k=np.int32(2)), "for the token interface"),
    (dict(input_ids=[[5, 6]], request_output_len=4, input_lengths=np.int32(3)), "input_lengths is 3"),
    (dict(input_ids=[[5]], request_output_len=4, stop_words_list=[[[5, 6], [3, -1]]]), "end offsets"),
    (dict(input_ids=[[5]], request_output_len=4, stop_words_list=[[[5, 6], [1, 2], [0, 0]]]),
     "shape"),
    (dict(input_ids=[[5]], request_output_len=4, stop_words_list=[[[-5, 6], [2, -1]]]), "negative"),
    (dict(input_ids=[[5]], request_output_len=4, temperature=np.float32(-1)), "temperature must be >= 0"),
    # SamplingParams' field errors are worded with the request's own tensor names.
    (dict(input_ids=[[5]], request_output_len=4, runtime_top_p=np.float32(1.5)), r"^runtime_top_p must be in \(0, 1\]"),
    (dict(input_ids=[[5]], request_output_len=0), "^request_output_len must be >= 1, got 0"),
    (dict(text_input=[[b"x"]], max_tokens=0), "^max_tokens must be >= 1, got 0"),
    (dict(input_ids=[[5]], request_output_len=4, min_length=np.int32(9)), "^min_length must be in"),
    (dict(text_input=[[b"x", b"y"]], max_tokens=4), "one prompt per request"),
    (dict(text_input=[[b"\xff"]], max_tokens=4), "UTF-8"),
])
def test_bad_requests_raise_value_error(values, message):
    with pytest.raises(ValueError, match=message):
        parse_request(_req(**values), FakeTokenizer())


def test_batch_of_two_is_refused():
    with pytest.raises(ValueError, match="batch size 2"):
        parse_request({"input_ids": np.array([[5], [6]], np.int32)}, None)


def test_word_list_decoding():
    assert decode_word_list(np.array([[1, 2, 3, 4], [2, 3, 4, -1]]), "w") == ((1, 2), (3,), (4,))
    assert decode_word_list(np.array([[7, 0], [1, -1]]), "w") == ((7,),)
    assert decode_word_list(np.array([[0], [-1]]), "w") == ()


def _out(tokens, finished=False, reason=None, text="", logprobs=None, prompt=(1, 2)):
    return RequestOutput("r", list(prompt), [CompletionOutput(0, text, list(tokens), reason, logprobs)], finished)


def test_streaming_reply_sends_only_new_tokens_and_log_probs():
    job = parse_request(_req(input_ids=[[1, 2]], request_output_len=3, streaming=True, return_log_probs=True), None)
    reply = Reply(job)
    lps = [{"logprob": -1.0}, {"logprob": -0.5}, {"logprob": -0.25}]
    first, done = reply.update(_out([7], logprobs=lps[:1]))
    assert not done and first["output_ids"].tolist() == [[[7]]] and first["sequence_length"].tolist() == [[1]]
    last, done = reply.update(_out([7, 8, 9], True, "length", logprobs=lps))
    assert done and last["output_ids"].tolist() == [[[8, 9]]]
    assert last["output_log_probs"].tolist() == [[[-0.5, -0.25]]] and last["cum_log_probs"].tolist() == [[-1.75]]
    assert last["output_ids"].dtype == np.int32 and last["cum_log_probs"].dtype == np.float32


def test_non_streaming_reply_waits_and_includes_the_prompt():
    reply = Reply(parse_request(_req(input_ids=[[1, 2]], request_output_len=3), None))
    assert reply.update(_out([7])) == (None, False)
    tensors, done = reply.update(_out([7, 8], True, "stop"))
    assert done and tensors["output_ids"].tolist() == [[[1, 2, 7, 8]]] and tensors["sequence_length"].tolist() == [[4]]


def test_multi_token_stop_word_ends_the_reply_with_the_word():
    job = parse_request(_req(input_ids=[[1, 2]], request_output_len=9, streaming=True,
                             stop_words_list=[[[8, 9], [2, -1]]]), None)
    reply = Reply(job)
    assert reply.update(_out([8]))[0]["output_ids"].tolist() == [[[8]]]
    # Several tokens may arrive at once; the reply stops right after the word.
    tensors, done = reply.update(_out([8, 5, 8, 9, 4]))
    assert done and tensors["output_ids"].tolist() == [[[5, 8, 9]]]


def test_text_reply_streams_text_pieces():
    job = parse_request(_req(text_input=[[b"hi"]], max_tokens=4, stream=True), None)
    reply = Reply(job)
    assert reply.update(_out([1], text="Hel"))[0]["text_output"].tolist() == [[b"Hel"]]
    assert reply.update(_out([1, 2], text="Hel")) == (None, False)  # held back by the Session
    tensors, done = reply.update(_out([1, 2, 3], True, "stop", text="Hello"))
    assert done and tensors["text_output"].tolist() == [[b"lo"]]


def test_repo_layout_and_config(factory, tmp_path):
    engine = factory.engine(factory.checkpoint("llama3"), dtype="float32")
    repo = write_repo(engine, tmp_path / "repo", "my-model", max_kv_tokens=256, policy="guaranteed_no_evict")
    config = (repo / "my-model" / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "decoupled: true" in config and "max_batch_size: 32" in config
    assert all(f'name: "{s.name}"' in config for s in INPUTS + OUTPUTS)
    assert f'string_value: "{engine.resolve()}"' in config and 'string_value: "256"' in config
    assert 'key: "prefix_caching" value: { string_value: "true" }' in config
    assert (repo / "my-model" / "1" / "model.py").read_text().startswith('"""The Triton Python-backend model')
    assert json.loads((repo / MARKER).read_text())["model_name"] == "my-model"
    write_repo(engine, repo)  # a repository written here before is replaced
    assert not (repo / "my-model").exists() and (repo / "kiln" / "config.pbtxt").is_file()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file").write_text("x")
    with pytest.raises(RepoError, match="not a repository written by triton-repo"):
        write_repo(engine, tmp_path / "other")
    with pytest.raises(RepoError, match="no rank0.engine"):
        write_repo(tmp_path, tmp_path / "r2")
    with pytest.raises(RepoError, match="model name"):
        write_repo(engine, tmp_path / "r3", "a b")


def test_cli_triton_repo(factory, tmp_path):
    engine = factory.engine(factory.checkpoint("llama3"), dtype="float32")
    result = CliRunner().invoke(triton_repo, ["--engine", str(engine), "--output", str(tmp_path / "repo")])
    assert result.exit_code == 0 and "serve-triton" in result.output
    result = CliRunner().invoke(triton_repo, ["--engine", str(engine), "--output", str(tmp_path / "repo"),
                                              "--no-prefix-caching"])
    assert result.exit_code == 0, result.output
    config = (tmp_path / "repo" / "kiln" / "config.pbtxt").read_text()
    assert 'key: "prefix_caching" value: { string_value: "false" }' in config
    result = CliRunner().invoke(triton_repo, ["--engine", str(tmp_path), "--output", str(tmp_path / "r")])
    assert result.exit_code == 2 and "no rank0.engine" in result.output


def test_session_options_are_checked_when_the_repo_is_written(factory, tmp_path):
    engine = factory.engine(factory.checkpoint("llama3"), dtype="float32")  # max_seq_len 64, 4-token blocks
    repo = write_repo(engine, tmp_path / "repo", kv_cache_fraction=0.5)
    assert 'key: "kv_cache_fraction"' in (repo / "kiln" / "config.pbtxt").read_text()
    for args, words in ((["--kv-cache-fraction", "2"], ["--kv-cache-fraction", "must be in (0, 1]"]),
                        (["--max-kv-tokens", "32"], ["--max-kv-tokens", "max_seq_len 64", "--max-seq-len"]),
                        (["--policy", "fifo"], ["--policy"])):
        result = CliRunner().invoke(triton_repo, ["--engine", str(engine), "--output", str(tmp_path / "r"), *args])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert all(w in result.output for w in words), result.output


def test_serve_triton_names_a_busy_port_before_starting(factory, tmp_path):
    import socket
    engine = factory.engine(factory.checkpoint("llama3"), dtype="float32")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(serve_triton, ["--engine", str(engine), "--grpc-port", str(port)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "--grpc-port" in result.output and f"127.0.0.1:{port} is not free" in result.output
    result = CliRunner().invoke(serve_triton, ["--engine", str(engine), "--http-port", "9100", "--grpc-port", "9100"])
    assert result.exit_code == 2 and "the grpc port 9100 is also the http port" in result.output, result.output
