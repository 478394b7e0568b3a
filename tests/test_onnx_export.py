"""ONNX export of an engine's plan (issue 19): every family's engine, fused and built with
--no-fuse, exports a model that passes onnx's full check and gives the CPU engine's prefill
logits in onnxruntime within 1e-4, so a fusion pass that changed the answer is caught by a
runtime Kiln did not write. A TP 2 engine exports one checked graph per rank with the
all-reduce as a `kiln` node; weights above the threshold stream to external data from the
engine's memory map; an op without an ONNX definition, a missing onnx package and a bad
output name each fail with a message that says what to do."""
from __future__ import annotations

import json
import shutil
import sys
import threading
import time
import tracemalloc

import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from kiln.builder import onnx_export
from kiln.builder.build import build_from_model
from kiln.builder.cli import build_engine, inspect_engine
from kiln.builder.config import BuildConfig
from kiln.builder.onnx_export import OnnxExportError, export_onnx
from kiln.models.config import parse_config
from kiln.models.llama import LlamaForCausalLM
from kiln.models.random_checkpoint import FAMILIES
from kiln.plugins import get_plugin
from kiln.runtime.engine import load_engine
from kiln.engines.format import read_engine_file
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step
from test_gelu_model import gelu_model

TINY = dict(max_batch_size=32, max_seq_len=32, max_num_tokens=32, kv_block_size=4)


def prefill(engine_dir, lengths=(11, 6), vocab: int = 380):
    """One prefill step of prompts of `lengths` tokens, packed, every token's logits asked for,
    and the CPU engine's logits for it."""
    engine = load_engine(engine_dir)
    ex = CpuExecutor(engine, num_kv_blocks=32)
    bs, nb = engine.manifest.kv.block_size, engine.manifest.blocks_per_sequence
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    # Interleaved, reversed blocks: the engine's answer must not depend on where its KV lives.
    tables = [list(range(s, 32, len(prompts)))[::-1][:nb] for s in range(len(prompts))]
    step = pack_step([SequenceChunk(p, 0, t, all_logits=True) for p, t in zip(prompts, tables)], bs, nb)
    return step, ex.run(step)


def onnxruntime_logits(path, step) -> torch.Tensor:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = step.as_dict()
    return torch.from_numpy(session.run(None, {i.name: feeds[i.name].numpy() for i in session.get_inputs()})[0])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def exported(engine_dir, path, **kwargs):
    """Export, then onnx's full check (types and shapes inferred strictly, functions included)."""
    exports = export_onnx(engine_dir, path, **kwargs)
    for e in exports:
        onnx.checker.check_model(str(e.path), full_check=True)
    return exports


def kiln_nodes(model) -> list[str]:
    return [n.op_type for n in model.graph.node if n.domain == "kiln"]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])  # Gemma 3: its own test below
def test_family_exports_and_matches_the_cpu_engine_fused_and_unfused(factory, tmp_path, family):
    ckpt = factory.checkpoint(family)
    fused, unfused = factory.engine(ckpt, dtype="float32"), factory.engine(ckpt, dtype="float32", fuse=False)
    step, want = prefill(fused)
    plan = [op.spec for op in load_engine(fused).plan]

    exported(fused, tmp_path / "fused.onnx")
    model = onnx.load(tmp_path / "fused.onnx")
    assert kiln_nodes(model) == [s.name for s in plan if s.fused]
    assert sorted({f.name for f in model.functions}) == sorted({s.name for s in plan if s.fused})
    # CastLike: the final norm's float32 weight to the activations' type.
    assert {n.op_type for n in model.graph.node if n.domain == ""} == {"Gather", "Gemm", "RMSNormalization", "CastLike"}
    assert rel_err(onnxruntime_logits(tmp_path / "fused.onnx", step), want) < 1e-4

    # The traced plan, before any fusion, in standard ops alone: the reference a fusion must keep.
    exported(unfused, tmp_path / "unfused.onnx")
    model = onnx.load(tmp_path / "unfused.onnx")
    assert kiln_nodes(model) == [] and not model.functions
    assert {"RotaryEmbedding", "Attention", "RMSNormalization", "Swish", "Gemm"} <= {n.op_type for n in model.graph.node}
    assert rel_err(onnxruntime_logits(tmp_path / "unfused.onnx", step), want) < 1e-4


def test_gemma3_exports_and_matches_the_cpu_engine_fused_and_unfused(factory, tmp_path):
    """Gemma 3's plan: GeGLU inside norm_swiglu, the scaled embedding, the post-norms' residual
    adds and the soft cap as standard ops; windowed and global layers both in the prompt."""
    ckpt = factory.checkpoint("gemma3")
    fused, unfused = factory.engine(ckpt, dtype="float32"), factory.engine(ckpt, dtype="float32", fuse=False)
    step, want = prefill(fused)
    exported(fused, tmp_path / "fused.onnx")
    model = onnx.load(tmp_path / "fused.onnx")
    assert kiln_nodes(model) == [s.name for s in (op.spec for op in load_engine(fused).plan) if s.fused]
    assert {"Gelu", "Tanh"} <= {n.op_type for f in model.functions for n in f.node} | {n.op_type for n in model.graph.node}
    assert rel_err(onnxruntime_logits(tmp_path / "fused.onnx", step), want) < 1e-4
    exported(unfused, tmp_path / "unfused.onnx")
    model = onnx.load(tmp_path / "unfused.onnx")
    assert kiln_nodes(model) == [] and {"Gelu", "Tanh", "Attention"} <= {n.op_type for n in model.graph.node}
    assert rel_err(onnxruntime_logits(tmp_path / "unfused.onnx", step), want) < 1e-4


def test_fused_functions_inline_into_standard_ops(factory, tmp_path):
    exported(factory.engine(factory.checkpoint("qwen3"), dtype="float32"), tmp_path / "q.onnx")
    inlined = onnx.inliner.inline_local_functions(onnx.load(tmp_path / "q.onnx"))
    onnx.checker.check_model(inlined, full_check=True)
    assert kiln_nodes(inlined) == [] and not inlined.functions
    assert {"RotaryEmbedding", "Attention"} <= {n.op_type for n in inlined.graph.node}


def test_sliding_window_and_gelu_plans_match(factory, tmp_path):
    ckpt = factory.checkpoint("mistral")
    windowed = tmp_path / "mistral-window"
    shutil.copytree(ckpt, windowed)
    config = json.loads((windowed / "config.json").read_text())
    config["sliding_window"] = 5  # shorter than the 11-token prompt
    (windowed / "config.json").write_text(json.dumps(config))
    engine = factory.engine(windowed, dtype="float32")
    step, want = prefill(engine)
    exported(engine, tmp_path / "w.onnx")
    assert rel_err(onnxruntime_logits(tmp_path / "w.onnx", step), want) < 1e-4

    build_from_model(gelu_model(), tmp_path / "gelu", BuildConfig(**TINY), {"architecture": "test-gelu"})
    step, want = prefill(tmp_path / "gelu", vocab=96)
    exported(tmp_path / "gelu", tmp_path / "gelu.onnx")
    assert "Gelu" in {n.op_type for n in onnx.load(tmp_path / "gelu.onnx").graph.node}
    assert rel_err(onnxruntime_logits(tmp_path / "gelu.onnx", step), want) < 1e-4


def test_graph_holds_symbolic_dims_memory_plan_and_plan_metadata(factory, tmp_path):
    engine = factory.engine(factory.checkpoint("llama3"), dtype="float32")
    exported(engine, tmp_path / "m.onnx")
    model = onnx.load(tmp_path / "m.onnx")
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims == {"input_ids": ["tokens"], "positions": ["tokens"], "query_lens": ["sequences"],
                    "logits_indices": ["logit_rows"]}
    (logits,) = model.graph.output
    assert [d.dim_param or d.dim_value for d in logits.type.tensor_type.shape.dim] == ["logit_rows", 512]
    m = read_engine_file(engine / "rank0.engine").manifest
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["kiln.memory_plan"]) == m.to_json()["memory_plan"]
    assert json.loads(props["kiln.kv_cache"]) == m.to_json()["kv_cache"] and props["kiln.targets"] == "cpu"
    assert {i.name for i in model.graph.initializer} == set(m.weights)
    writers = {n.name: {p.key: p.value for p in n.metadata_props} for n in model.graph.node if n.metadata_props}
    assert [w["kiln.op"] for w in writers.values()] == [op.op for op in m.plan]
    for op in m.plan:
        assert writers[op.output]["kiln.arena_offset"] == str(m.slots[op.output].offset)


def test_tp2_engine_exports_one_checked_graph_per_rank(factory, tmp_path):
    ckpt = factory.checkpoint("llama2")
    exports = exported(factory.engine(ckpt, dtype="float32", tp_size=2), tmp_path / "tp.onnx")
    assert [(e.path.name, e.rank, e.world_size) for e in exports] == [("tp.rank0.onnx", 0, 2), ("tp.rank1.onnx", 1, 2)]
    for e in exports:
        model = onnx.load(e.path)
        bodies = {f.name: [n.op_type for n in f.node if n.domain == "kiln"] for f in model.functions}
        # The row-parallel projections (o and down) sum over the ranks inside their fused ops.
        assert bodies["attention_o_proj"] == ["all_reduce"] and bodies["linear_residual"] == ["all_reduce"]
        # The LM head (a primitive linear, inlined) gathers its slices of the logits.
        assert [n for n in kiln_nodes(model) if n.startswith("all_")] == ["all_gather"]
        assert json.loads({p.key: p.value for p in model.metadata_props}["kiln.model"])["architecture"]

    exports = exported(factory.engine(ckpt, dtype="float32", tp_size=2, fuse=False), tmp_path / "unfused.onnx")
    for e in exports:
        # o_proj and down_proj of 2 layers, then the LM head
        assert kiln_nodes(onnx.load(e.path)) == ["all_reduce"] * 4 + ["all_gather"]


def test_external_data_above_the_threshold_runs_in_onnxruntime(factory, tmp_path, monkeypatch):
    engine = factory.engine(factory.checkpoint("qwen2"), dtype="float32")
    step, want = prefill(engine)
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 1 << 16)
    (e,) = exported(engine, tmp_path / "x.onnx")
    assert e.data_path == tmp_path / "x.onnx.data" and e.data_path.stat().st_size >= e.weight_bytes
    assert (tmp_path / "x.onnx").stat().st_size < 64 << 10
    assert rel_err(onnxruntime_logits(tmp_path / "x.onnx", step), want) < 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.onnx", "x.onnx.data"]  # no temporary left


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def test_external_data_streams_weights_without_a_second_copy(tmp_path):
    """82 MiB of weights: the export's peak anonymous memory (sampled every millisecond) and
    Python allocations stay far below one copy of them; only the engine's memory map holds
    them."""
    cfg = parse_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 16384, "hidden_size": 512,
                        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "max_position_embeddings": 64, "rms_norm_eps": 1e-5})
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    build_from_model(model, tmp_path / "engine", BuildConfig(**TINY), {"architecture": "LlamaForCausalLM"})
    del model
    peak, done = [_rss_anon()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.001)

    base = peak[0]
    sampler = threading.Thread(target=sample)
    sampler.start()
    tracemalloc.start()
    try:
        (e,) = export_onnx(tmp_path / "engine", tmp_path / "big.onnx", external_data=True)
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        done.set()
        sampler.join()
    assert e.weight_bytes > 80 << 20
    assert peak[0] - base < e.weight_bytes // 8, (peak[0] - base, e.weight_bytes)
    assert python_peak < e.weight_bytes // 16
    onnx.checker.check_model(str(e.path), full_check=True)


def test_op_without_onnx_definition_is_named(tmp_path):
    import toy_plugins.relu2_scale  # noqa: F401  (registers the op)
    from test_plugin_folder import relu2_model

    build_from_model(relu2_model(), tmp_path / "relu2", BuildConfig(**TINY), {"architecture": "test-relu2"})
    (tmp_path / "out.onnx").write_bytes(b"before")
    with pytest.raises(OnnxExportError, match=r"op 'relu2_scale' has no ONNX definition: add onnx.py to its plugin "
                                              r"folder \(toy_plugins.relu2_scale\)"):
        export_onnx(tmp_path / "relu2", tmp_path / "out.onnx")
    assert (tmp_path / "out.onnx").read_bytes() == b"before"
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]


def test_missing_onnx_package_is_named(factory, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # what `import onnx` meets where it is not installed
    with pytest.raises(OnnxExportError, match=r"ONNX export needs the onnx package .*pip install 'kiln\[onnx\]'"):
        export_onnx(factory.engine(factory.checkpoint("llama3"), dtype="float32"), tmp_path / "m.onnx")


def test_cli_flags(factory, tmp_path):
    ckpt = factory.checkpoint("llama3")
    engine = factory.engine(ckpt, dtype="float32")
    runner = CliRunner()
    result = runner.invoke(inspect_engine, [str(engine), "--onnx", str(tmp_path / "i.onnx")])
    assert result.exit_code == 0, result.output
    assert f"onnx     {tmp_path / 'i.onnx'}  (rank 0 of 1)" in result.output and "weights embedded" in result.output
    onnx.checker.check_model(str(tmp_path / "i.onnx"), full_check=True)

    result = runner.invoke(inspect_engine, [str(engine), "--onnx", str(tmp_path / "i.txt")])
    assert result.exit_code == 2 and "--onnx" in result.output and "name a file ending in .onnx" in result.output

    result = runner.invoke(build_engine, ["--checkpoint", str(ckpt), "--output", str(tmp_path / "e"), "--dtype",
                                          "float32", "--max-seq-len", "32", "--max-num-tokens", "32", "--target",
                                          "cpu", "--quiet", "--no-fuse", "--onnx", str(tmp_path / "b.onnx")])
    assert result.exit_code == 0, result.output
    assert "fused ops per layer: none" in result.output and "kiln functions: none" in result.output
    assert not any(get_plugin(op.spec.name).fused for op in load_engine(tmp_path / "e").plan)
    assert kiln_nodes(onnx.load(tmp_path / "b.onnx")) == []
