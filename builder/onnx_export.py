"""ONNX export of an engine's plan: one ONNX model per rank, so a standard viewer (Netron) shows
what the compiler produced and an independent runtime (onnxruntime) can check its passes.

The graph is the plan in its dense prefill form: the step inputs `input_ids` and `positions`
([tokens]), `query_lens` ([sequences]: prompts packed one after another, each attending to
itself under a causal mask) and `logits_indices` ([logit_rows]); the paged KV cache is a
runtime structure, so each layer's k and v pass from the op that writes them to the attention
that reads them. Each plan op is its plugin's ONNX function (the plugin folder's `onnx.py`,
see `plugins/onnx_function.py`): a primitive op is inlined into standard ops, a fused op stays
one node of the `kiln` domain whose function holds its definition. The engine's weights are
the initializers, the memory plan and the kernels per target are metadata properties (of the
model, and of the node that writes each plan tensor). `onnx_files` writes the files.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln.builder.onnx_files import OnnxExportError, onnx_module, tensor_type, write_model
from kiln.plugins import get_plugin
from kiln.plugins.onnx_function import CACHE_K, CACHE_V, DOMAIN, DOMAIN_VERSION, OPSET, OnnxFunction
from kiln.engines.format import EngineFileError, read_engine_file
from kiln.engines.manifest import Manifest, PlanEntry, TensorSpec

# Symbolic dims of the dense form, named for a reader of the graph (the IR's T, S, L).
DIMS = {"T": "tokens", "S": "sequences", "L": "logit_rows"}
# Above this many bytes of weights the export keeps them in a side file (`OUT.onnx.data`): an
# embedded model is built in memory, one more copy of the weights, and protobuf stops at 2 GB.
EXTERNAL_DATA_BYTES = 256 << 20
IR_VERSION = 10  # overloaded functions and node metadata; onnxruntime 1.32 reads it


@dataclass
class OnnxExport:
    """One rank's exported model."""

    path: Path
    rank: int
    world_size: int
    nodes: int
    functions: list[str]
    weight_bytes: int
    data_path: Path | None

    def render(self) -> str:
        fused = ", ".join(self.functions) or "none"
        where = f"in {self.data_path.name}" if self.data_path else "embedded"
        return (f"onnx     {self.path}  (rank {self.rank} of {self.world_size}): {self.nodes} nodes, "
                f"kiln functions: {fused}; weights {where} ({self.weight_bytes / 2**20:.2f} MiB)")


def onnx_paths(output: Path, world_size: int) -> list[Path]:
    """OUT.onnx for one rank; OUT.rank{r}.onnx for each of several."""
    if world_size == 1:
        return [output]
    return [output.with_name(f"{output.stem}.rank{r}{output.suffix}") for r in range(world_size)]


def export_onnx(engine: str | Path, output: str | Path, external_data: bool | None = None) -> list[OnnxExport]:
    """Export every rank of an engine folder (or the one rank of an engine file) to ONNX.

    `external_data` None keeps the weights in a side file above EXTERNAL_DATA_BYTES; True or
    False forces it either way. The weights are streamed from the engine's memory map.
    """
    engine, output = Path(engine), Path(output)
    if output.suffix != ".onnx" or output.is_dir():
        raise OnnxExportError(f"--onnx {output}: name a file ending in .onnx (one per rank is written beside it "
                              "for a tensor-parallel engine)")
    files = sorted(engine.glob("rank*.engine")) if engine.is_dir() else [engine]
    if not files or not files[0].is_file():
        raise OnnxExportError(f"{engine} holds no engine file: pass an engine folder made by build-engine")
    onnx = onnx_module()
    exports = []
    for file in files:
        try:
            ef = read_engine_file(file)
        except EngineFileError as e:
            raise OnnxExportError(str(e)) from None
        m = ef.manifest
        if m.kv.scales is not None:
            # The dense prefill form passes each layer's k and v in the model's dtype, never
            # through the cache, so it would not show the e4m3 rounding the engine does.
            raise OnnxExportError(f"{engine} has an FP8 KV cache, which the ONNX form (dense prefill, k and v in "
                                  f"{m.dtype}) cannot express: export the same checkpoint built with "
                                  "--kv-cache-dtype auto")
        if m.quantization != "none":
            raise OnnxExportError(f"{file} is a {m.quantization} engine: its W8A8 projections have no ONNX form in "
                                  "Kiln yet; export the engine built without --quantization")
        path = onnx_paths(output, m.world_size)[m.rank]
        model = rank_model(onnx, m, str(file))
        weight_bytes = sum(w.nbytes for w in ef.weights.values())
        external = weight_bytes > EXTERNAL_DATA_BYTES if external_data is None else external_data
        data_path = write_model(onnx, model, ef.weights, path, external)
        exports.append(OnnxExport(path, m.rank, m.world_size, len(model.graph.node),
                                  list(dict.fromkeys(f.name for f in model.functions)), weight_bytes, data_path))
    return exports


def _function(entry: PlanEntry) -> OnnxFunction:
    spec = get_plugin(entry.op)
    if spec.version != entry.version:
        raise OnnxExportError(f"engine uses plugin {spec.name} v{entry.version}, this Kiln has v{spec.version}: "
                              "rebuild the engine with this Kiln")
    fn = _plugin_onnx(spec).function(entry.inputs, entry.attrs)
    if fn.name != spec.name:
        raise OnnxExportError(f"plugin {spec.name!r}: its onnx.py names its function {fn.name!r}; use the op's name")
    return fn


def _plugin_onnx(spec) -> ModuleType:
    module = spec.module("onnx")
    if module is None:
        raise OnnxExportError(f"op {spec.name!r} has no ONNX definition: add onnx.py to its plugin folder "
                              f"({spec.package}) with function(inputs, attrs) -> OnnxFunction "
                              "(see kiln/plugins/onnx_function.py)")
    return module


class _Plan:
    """The plan's nodes as calls of their ONNX functions, with the KV cache's k and v passed
    from the op that writes a layer's cache to the ops that read it."""

    def __init__(self, onnx: ModuleType):
        self.onnx = onnx
        self.nodes: list = []
        self.functions: dict[tuple[str, str], tuple[OnnxFunction, Any]] = {}
        self.cache: dict[int, dict[str, str]] = {}

    def call(self, entry: PlanEntry) -> tuple[OnnxFunction, Any]:
        fn = _function(entry)
        key = (fn.name, fn.overload)
        if key not in self.functions:
            self.functions[key] = (fn, _parse(self.onnx, fn))
        elif self.functions[key][0] != fn:
            raise OnnxExportError(f"plugin {fn.name!r} gives two bodies for its {fn.overload or 'base'} variant: "
                                  "its onnx.py must name every variant by its overload")
        attrs = entry.attrs
        layer = attrs.get("layer")
        inputs = [self._cache_read(entry, layer, name) if name in (CACHE_K, CACHE_V) else self._input(entry, name)
                  for name in fn.inputs]
        outputs = [entry.output]
        for name in fn.outputs[1:]:
            if name not in (CACHE_K, CACHE_V):
                raise OnnxExportError(f"plugin {fn.name!r}: extra output {name!r} is not {CACHE_K} or {CACHE_V}")
            outputs.append(f"{entry.output}.{name}")
            self.cache.setdefault(layer, {})[name] = outputs[-1]
        node = self.onnx.helper.make_node(fn.name, inputs, outputs, name=entry.output, domain=DOMAIN,
                                          overload=fn.overload, doc_string=entry.source,
                                          **{a: _attr(attrs[a]) for a in fn.attrs})
        self.nodes.append(node)
        return self.functions[key]

    def _input(self, entry: PlanEntry, name: str) -> str:
        tensor = entry.inputs.get(name)
        if tensor is None:
            raise OnnxExportError(f"plugin {entry.op!r}: its ONNX function reads {name!r}, which this node "
                                  "does not have: choose the variant from the inputs present")
        return tensor

    def _cache_read(self, entry: PlanEntry, layer: int | None, name: str) -> str:
        written = self.cache.get(layer, {})
        if name not in written:
            raise OnnxExportError(f"{entry.output}: reads layer {layer}'s {name} from the KV cache, "
                                  "but no earlier op of the plan writes it")
        return written[name]


def _attr(value: Any) -> Any:
    return int(value) if isinstance(value, bool) else value


def _parse(onnx: ModuleType, fn: OnnxFunction):
    try:
        return onnx.parser.parse_function(fn.text())
    except Exception as e:
        raise OnnxExportError(f"plugin {fn.name!r}: its ONNX function ({fn.overload or 'base'} variant) does not "
                              f"parse: {e}\n{fn.text()}") from None


def _value_info(onnx: ModuleType, name: str, info: TensorSpec):
    dims = [DIMS.get(d, d) if isinstance(d, str) else d for d in info.shape]
    return onnx.helper.make_tensor_value_info(name, tensor_type(onnx, info.dtype), dims)


def rank_model(onnx: ModuleType, m: Manifest, source: str):
    """The ONNX model of one rank's plan (without its initializers, which `write_model` adds)."""
    plan = _Plan(onnx)
    calls = [plan.call(entry) for entry in m.plan]
    read = {t for n in plan.nodes for t in n.input}
    inputs = [_value_info(onnx, n, m.tensors[n]) for n in m.inputs
              if n in read and n in m.tensors and m.tensors[n].kind == "input"]
    outputs = [_value_info(onnx, n, m.tensors[n]) for n in m.outputs]
    known = set(m.inputs) | set(m.outputs)
    value_info = [_value_info(onnx, e.output, m.tensors[e.output]) for e in m.plan if e.output not in known]
    arch = m.model.get("architecture", "model")
    graph = onnx.helper.make_graph(plan.nodes, f"{arch} rank {m.rank} of {m.world_size}", inputs, outputs,
                                   value_info=value_info)
    model = onnx.helper.make_model(
        graph, ir_version=IR_VERSION, producer_name="kiln", producer_version=m.kiln_version,
        opset_imports=[onnx.helper.make_opsetid("", OPSET), onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=[proto for _, proto in plan.functions.values()],
        doc_string=f"The plan of Kiln engine {source} in the dense prefill form (see the kiln.form property)")
    primitive = sorted({(DOMAIN, fn.name) for fn, _ in plan.functions.values() if not get_plugin(fn.name).fused})
    model = onnx.inliner.inline_selected_functions(model, primitive)
    _label(model, m, calls)
    onnx.helper.set_model_props(model, _model_props(m, source))
    return model


def _label(model, m: Manifest, calls: list[tuple[OnnxFunction, Any]]) -> None:
    """Name the nodes a primitive op was inlined into after the op's output, and give the node
    that writes each plan tensor its arena slot and kernels as metadata."""
    nodes = list(model.graph.node)
    at = 0
    for entry, (fn, proto) in zip(m.plan, calls):
        fused = get_plugin(fn.name).fused
        count = 1 if fused else len(proto.node)
        group = nodes[at:at + count]
        at += count
        writer = next((n for n in group if entry.output in n.output), None)
        if writer is None:
            raise OnnxExportError(f"{entry.output}: the inlined {fn.name} nodes do not write it (onnx's inliner "
                                  "changed how it lays out a call)")
        if not fused:
            for i, n in enumerate(group):
                n.name = entry.output if n is writer else f"{entry.output}/{i}.{n.op_type}"
                n.doc_string = f"{entry.source} ({entry.op})"
        props = {"kiln.op": entry.op}
        if entry.output in m.slots:
            props["kiln.arena_offset"] = str(m.slots[entry.output].offset)
            props["kiln.arena_nbytes"] = str(m.slots[entry.output].nbytes)
        for target, keys in entry.kernel_keys.items():
            props[f"kiln.kernels.{target}"] = ", ".join(f"{m.kernels[k].entry} {k}" for k in keys)
        for key, value in props.items():
            prop = writer.metadata_props.add()
            prop.key, prop.value = key, value
    if at != len(nodes):
        raise OnnxExportError(f"the inlined graph has {len(nodes)} nodes, the plan's functions {at}")


def _model_props(m: Manifest, source: str) -> dict[str, str]:
    """The manifest's facts that the graph does not show, as JSON."""
    kernels = {k: {f: v for f, v in asdict(e).items() if f not in ("offset", "nbytes")}
               for k, e in m.kernels.items()}
    limits = {"max_num_tokens": m.max_num_tokens, "max_batch_size": m.max_batch_size, "max_seq_len": m.max_seq_len}
    memory_plan = {"arena_bytes": m.arena_bytes, "tensors": {n: asdict(s) for n, s in m.slots.items()}}
    form = ("dense prefill: input_ids and positions [tokens]; query_lens [sequences], the prompts packed in order, "
            "each attending to itself under a causal mask; logits_indices [logit_rows], the rows whose logits are "
            "returned. The paged KV cache is a runtime structure: the outputs named *.cache_k and *.cache_v are a "
            "layer's keys and values, which its attention reads. kiln.all_reduce sums over the tensor-parallel ranks; "
            "kiln.all_gather puts their slices of the logits side by side.")
    return {
        "kiln.engine": source,
        "kiln.form": form,
        "kiln.kiln_version": m.kiln_version,
        "kiln.rank": str(m.rank),
        "kiln.world_size": str(m.world_size),
        "kiln.dtype": m.dtype,
        "kiln.targets": ", ".join(m.targets),
        "kiln.model": json.dumps(m.model),
        "kiln.limits": json.dumps(limits),
        "kiln.kv_cache": json.dumps(m.kv.to_json()),
        "kiln.memory_plan": json.dumps(memory_plan),
        "kiln.kernels": json.dumps(kernels),
    }
