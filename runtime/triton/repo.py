"""Writes a Triton model repository that serves a Kiln engine: one decoupled Python-backend
model (config.pbtxt, `1/model.py`) plus a README with the interface and how to start it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from kiln.engines.format import EngineFileError, read_engine_file
from kiln.engines.manifest import Manifest
from kiln.runtime.scheduler import POLICIES
from kiln.runtime.engine_core import check_engine_options
from kiln.runtime.kv_pool import check_max_kv_tokens
from kiln.runtime.triton.protocol import INPUTS, OUTPUTS, TensorSpec

MARKER = "kiln-triton-repo.json"  # tells a repository written here from any other folder
MODEL_SOURCE = Path(__file__).with_name("model.py")


class RepoError(ValueError):
    """The repository cannot be written; the message says what to change."""


def write_repo(engine_dir: Path, output: Path, model_name: str = "kiln", max_kv_tokens: int | None = None,
               policy: str = POLICIES[0], kv_cache_fraction: float | None = None,
               prefix_caching: bool = True) -> Path:
    """Write the repository for `engine_dir` to `output` and return `output`.

    The model refers to the engine by its absolute path, so the engine must stay where it is.
    A repository written here before is replaced; any other non-empty folder is refused. The
    Session options are checked here as the Session will check them (`ArgumentError`), so a bad
    one fails now rather than when the server loads the model.
    """
    engine_dir = Path(engine_dir).resolve()
    output = Path(output)
    engine_file = engine_dir / Manifest.rank_file(0)
    if not engine_file.is_file():
        raise RepoError(f"{engine_dir} holds no {engine_file.name}: pass an engine folder written by build-engine")
    try:
        manifest = read_engine_file(engine_file, verify=False).manifest
    except EngineFileError as e:
        raise RepoError(str(e)) from None
    if not model_name or not all(c.isalnum() or c in "-_." for c in model_name):
        raise RepoError(f"model name {model_name!r}: use letters, digits, '-', '_' and '.' only")
    check_engine_options(None, kv_cache_fraction, max_kv_tokens, policy, 60.0, prefix_caching)
    if max_kv_tokens is not None:
        check_max_kv_tokens(max_kv_tokens, manifest)
    if output.exists():
        if not output.is_dir() or (any(output.iterdir()) and not (output / MARKER).is_file()):
            raise RepoError(f"{output} exists and is not a repository written by triton-repo: choose another folder")
        shutil.rmtree(output)

    model_dir = output / model_name
    (model_dir / "1").mkdir(parents=True)
    shutil.copyfile(MODEL_SOURCE, model_dir / "1" / "model.py")
    parameters = {"engine_dir": str(engine_dir), "policy": policy, "prefix_caching": json.dumps(prefix_caching)}
    if max_kv_tokens is not None:
        parameters["max_kv_tokens"] = str(max_kv_tokens)
    if kv_cache_fraction is not None:
        parameters["kv_cache_fraction"] = repr(float(kv_cache_fraction))
    (model_dir / "config.pbtxt").write_text(model_config(model_name, manifest.max_batch_size, parameters))
    (output / "README.md").write_text(_readme(model_name, engine_dir))
    (output / MARKER).write_text(json.dumps({"engine_dir": str(engine_dir), "model_name": model_name}, indent=2) + "\n")
    return output


def model_config(name: str, max_batch_size: int, parameters: dict[str, str]) -> str:
    """config.pbtxt for the model. Every input is optional because one model serves both
    interfaces; the model itself refuses a request that mixes them or misses what it needs."""
    lines = [f'name: "{name}"', 'backend: "python"',
             # > 0 gives every tensor a leading batch dim, as in TensorRT-LLM's models; each request
             # still carries one sequence (the Session batches requests in flight).
             f"max_batch_size: {max_batch_size}",
             "model_transaction_policy { decoupled: true }", ""]
    lines += ["input ["] + [_tensor(s, optional=True) + "," for s in INPUTS]
    lines[-1] = lines[-1].rstrip(",")
    lines += ["]", "output ["] + [_tensor(s, optional=False) + "," for s in OUTPUTS]
    lines[-1] = lines[-1].rstrip(",")
    # One instance: one Session, whose KV pool and batch every request shares.
    lines += ["]", "", "instance_group [ { count: 1, kind: KIND_CPU } ]", ""]
    lines += [f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(v)} }} }}' for k, v in parameters.items()]
    return "\n".join(lines) + "\n"


def _tensor(spec: TensorSpec, optional: bool) -> str:
    fields = [f'name: "{spec.name}"', f"data_type: {spec.dtype}", f"dims: [ {', '.join(map(str, spec.dims))} ]"]
    if spec.scalar:
        fields.append("reshape: { shape: [ ] }")
    if optional:
        fields.append("optional: true")
    return "  { " + " ".join(fields) + " }"


def _readme(model_name: str, engine_dir: Path) -> str:
    return f"""# Triton model repository for a Kiln engine

Written by `triton-repo` for the engine `{engine_dir}` (referred to by that path: keep the
engine there). One model, `{model_name}`: a decoupled Python-backend model that hands every
request to one shared Kiln `Session`, so concurrent requests are batched in flight.

Start it with `serve-triton --engine {engine_dir} --repo <this folder>`, which also
sets what the server needs (the Python backend stub for this Python, `LD_LIBRARY_PATH`, and
Kiln's virtual environment first on `PATH`, where the stub looks for its Python).

Token interface (TensorRT-LLM's names; send one sequence per request, batch dim 1):

    input_ids INT32 [1, N], request_output_len INT32 [1, 1], optional input_lengths, end_id,
    pad_id, temperature, runtime_top_k, runtime_top_p, repetition_penalty, presence_penalty,
    frequency_penalty, min_length, random_seed (UINT64), streaming, return_log_probs,
    exclude_input_in_output (BOOL), stop_words_list / bad_words_list INT32 [1, 2, K]
    -> output_ids INT32 [1, 1, T], sequence_length INT32 [1, 1],
       cum_log_probs FP32 [1, 1] and output_log_probs FP32 [1, 1, T] with return_log_probs

Text interface:

    text_input, max_tokens, optional temperature, top_k, top_p, stream, stop_words, bad_words
    (and the shared optional inputs above) -> text_output

    curl -d '{{"text_input": "The kiln", "max_tokens": 20}}' localhost:8000/v2/models/{model_name}/generate
    curl -d '{{"text_input": "The kiln", "max_tokens": 20, "stream": true}}' \\
        localhost:8000/v2/models/{model_name}/generate_stream

The full description of every input is in the docstring of Kiln's `runtime/triton/__init__.py`.
Metrics on Triton's metrics endpoint: `kiln_kv_cache_blocks{{state="used"|"total"|"peak"}}`,
`kiln_requests{{state="running"|"waiting"}}` and
`kiln_requests_finished_total{{reason="stop"|"length"|"cancelled"|"error"}}`.
"""
