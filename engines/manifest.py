"""The manifest of an engine file, typed: what the builder writes and the runtime reads.

`Manifest` is the one place that knows the manifest's JSON keys. The builder makes one and
`engines.format.write_engine_file` serializes it (adding the weight and kernel indexes and the
sections); `read_engine_file` parses it back with `Manifest.from_json`, which checks every
field once, so the code that reads it afterwards trusts named, typed fields. Each fact is
stored once: the step bounds are `max_num_tokens`, `max_batch_size` and `blocks_per_sequence`
(derived from `max_seq_len` and the KV block size), and the vocabulary size is the width of the
logits tensor. engines/README.md documents the JSON.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.dtypes import element_bytes
from kiln.engines.manifest_fields import Fields, ManifestError


# How an engine's GEMM weights are stored: "none" in the model dtype; "fp8" as float8_e4m3fn with
# a float32 `<weight>_scale` input per op (W8A8, plugins/fp8.py).
QUANTIZATIONS = ("none", "fp8")


def blocks_per_sequence(max_seq_len: int, block_size: int) -> int:
    """KV blocks one sequence of `max_seq_len` tokens needs: the width of a block table."""
    return -(-max_seq_len // block_size)


def symbol_bounds(max_num_tokens: int, max_batch_size: int, blocks_per_seq: int) -> dict[str, int]:
    """The largest value of each symbolic dim in the plan's tensor shapes (see builder/ir.py):
    T tokens in a step, S sequences in a step, L logit rows (one per sequence), B blocks per
    sequence. Shapes and plugin launch rules are written in these symbols; code outside them
    uses the manifest's named fields."""
    return {"T": max_num_tokens, "S": max_batch_size, "L": max_batch_size, "B": blocks_per_seq}


KV_FP8 = "float8_e4m3fn"
SCALE_GRANULARITIES = ("tensor", "head")


@dataclass(frozen=True)
class KVLayout:
    """The paged KV cache's layout; the pool is [layers, K and V, blocks, block_size, kv heads, head_dim].

    An e4m3 cache (`dtype` float8_e4m3fn) holds value / scale: `scales` names the float32 weight
    [layers, 2 (k, v), kv heads] of those scales, one per layer and k or v ("tensor", the same for
    every head) or one per kv head too ("head"). A cache in the model's dtype has none."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    scales: str | None = None
    scale_granularity: str | None = None

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element_bytes(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads)

    def to_json(self) -> dict[str, Any]:
        """The fields; an unquantized cache's (None) scale fields are left out, as engines from
        before them wrote it."""
        return {k: v for k, v in _fields(self).items() if v is not None}

    def check(self, weights: dict[str, WeightEntry]) -> None:
        """An e4m3 cache names its scales weight, of the right shape; any other cache has none."""
        if self.dtype != KV_FP8:
            if self.scales is not None or self.scale_granularity is not None:
                raise ManifestError(f"manifest.kv_cache: a {self.dtype} cache has no scales; only a {KV_FP8} "
                                    "cache does")
            return
        if self.scale_granularity not in SCALE_GRANULARITIES:
            raise ManifestError(f"manifest.kv_cache.scale_granularity must be one of {SCALE_GRANULARITIES} for a "
                                f"{KV_FP8} cache, got {self.scale_granularity!r}")
        w = weights.get(self.scales) if self.scales is not None else None
        if w is None or w.dtype != "float32" or tuple(w.shape) != self.scales_shape:
            raise ManifestError(f"manifest.kv_cache.scales must name a float32 weight of shape "
                                f"{list(self.scales_shape)}, got {self.scales!r}"
                                + (f" ({w.dtype} {list(w.shape)})" if w is not None else ""))


@dataclass(frozen=True)
class TensorSpec:
    """A step input, activation or state (the KV cache, which lives outside the arena): its
    shape may hold the symbols of `symbol_bounds`."""

    shape: tuple[int | str, ...]
    dtype: str
    kind: str

    def resolve(self, dims: dict[str, int]) -> tuple[int, ...]:
        return tuple(dims[d] if isinstance(d, str) else d for d in self.shape)


@dataclass(frozen=True)
class Slot:
    """Where a tensor lives in the activation arena."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class PlanEntry:
    """One op of the plan: the plugin and version it runs, its tensors and attributes, and the
    keys of its kernels per GPU target."""

    op: str
    version: int
    inputs: dict[str, str | None]
    attrs: dict[str, Any]
    output: str
    source: str
    kernel_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightEntry:
    """A weight's place in the weights section (`offset` from the section's start)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class KernelEntry:
    """A kernel blob's place in the kernels section and how to launch it (engines/README.md)."""

    offset: int
    nbytes: int
    plugin: str
    target: str
    entry: str
    signature: tuple[str, ...]
    num_warps: int
    shared_bytes: int
    launch: dict[str, Any]
    global_scratch: int = 0   # bytes per program; absent in engines whose kernels need none


@dataclass(frozen=True)
class Section:
    offset: int
    length: int
    crc32: int


SECTIONS = ("weights", "kernels")


@dataclass(frozen=True)
class Manifest:
    kiln_version: str
    model: dict[str, Any]          # the checkpoint's configuration as the builder read it, for people
    dtype: str                     # weights and activations
    targets: tuple[str, ...]
    rank: int
    world_size: int
    max_num_tokens: int            # tokens in one step: decode tokens plus prefill chunks
    max_batch_size: int            # sequences in one step
    max_seq_len: int               # prompt plus output of one sequence
    kv: KVLayout
    tokenizer_file: str | None     # in the engine folder, beside the rank files
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    tensors: dict[str, TensorSpec]
    plan: tuple[PlanEntry, ...]
    arena_bytes: int
    slots: dict[str, Slot]         # the memory plan: every step input and activation
    chat_template_file: str | None = None  # the checkpoint's chat template (Jinja), in the engine folder
    # A tensor-parallel engine's custom all-reduce kernel, per GPU target (plugins/all_reduce).
    all_reduce_kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    quantization: str = "none"     # one of QUANTIZATIONS; absent in engines from before FP8: "none"
    # Set by the writer (engines.format), replacing whatever the builder left there.
    weights: dict[str, WeightEntry] = field(default_factory=dict)
    kernels: dict[str, KernelEntry] = field(default_factory=dict)
    sections: dict[str, Section] = field(default_factory=dict)

    @property
    def blocks_per_sequence(self) -> int:
        return blocks_per_sequence(self.max_seq_len, self.kv.block_size)

    @property
    def symbol_bounds(self) -> dict[str, int]:
        return symbol_bounds(self.max_num_tokens, self.max_batch_size, self.blocks_per_sequence)

    @property
    def logits(self) -> str:
        """The plan's output: the logits of the step's requested rows."""
        return self.outputs[0]

    @property
    def vocab_size(self) -> int:
        return self.tensors[self.logits].shape[-1]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.model.get("eos_token_ids", ()))

    @property
    def source(self) -> str:
        """The checkpoint the engine was built from."""
        return str(self.model.get("source", "unknown"))

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())

    @staticmethod
    def rank_file(rank: int) -> str:
        """The name of rank `rank`'s engine file in an engine folder."""
        return f"rank{rank}.engine"

    def to_json(self) -> dict[str, Any]:
        return {
            "kiln_version": self.kiln_version, "model": self.model, "dtype": self.dtype,
            "targets": list(self.targets), "rank": self.rank, "world_size": self.world_size,
            "limits": {"max_num_tokens": self.max_num_tokens, "max_batch_size": self.max_batch_size,
                       "max_seq_len": self.max_seq_len},
            "kv_cache": self.kv.to_json(), "tokenizer": self.tokenizer_file,
            "chat_template": self.chat_template_file, "quantization": self.quantization,
            "inputs": list(self.inputs), "outputs": list(self.outputs),
            "tensors": {n: {**_fields(t), "shape": list(t.shape)} for n, t in self.tensors.items()},
            "plan": [{**_fields(p), "kernel_keys": {t: list(k) for t, k in p.kernel_keys.items()}}
                     for p in self.plan],
            "all_reduce_kernels": {t: list(k) for t, k in self.all_reduce_kernels.items()},
            "memory_plan": {"arena_bytes": self.arena_bytes, "tensors": {n: _fields(s) for n, s in self.slots.items()}},
            "weights": {n: {**_fields(w), "shape": list(w.shape)} for n, w in self.weights.items()},
            "kernels": {k: {**_fields(e), "signature": list(e.signature)} for k, e in self.kernels.items()},
            "sections": {n: _fields(s) for n, s in self.sections.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and check a manifest; ManifestError names the first field that is wrong."""
        m = Fields(data, "manifest")
        limits, kv, memory = m.obj("limits"), m.obj("kv_cache"), m.obj("memory_plan")
        sections = m.obj("sections")
        manifest = cls(
            kiln_version=m.string("kiln_version"), model=m.obj("model").data, dtype=m.dtype("dtype"),
            targets=m.strs("targets"), rank=m.integer("rank", low=0), world_size=m.integer("world_size"),
            max_num_tokens=limits.integer("max_num_tokens"), max_batch_size=limits.integer("max_batch_size"),
            max_seq_len=limits.integer("max_seq_len"),
            kv=KVLayout(kv.integer("num_layers"), kv.integer("block_size"), kv.integer("num_kv_heads"),
                        kv.integer("head_dim"), kv.dtype("dtype"), kv.string("scales", optional=True),
                        kv.string("scale_granularity", optional=True)),
            tokenizer_file=m.string("tokenizer", optional=True),
            chat_template_file=m.string("chat_template", optional=True),
            inputs=m.strs("inputs"), outputs=m.strs("outputs"),
            tensors={n: TensorSpec(t.shape("shape", symbols=True), t.dtype("dtype"), t.string("kind"))
                     for n, t in m.objs("tensors")},
            plan=tuple(_plan_entry(p) for p in m.list_of_objs("plan")),
            all_reduce_kernels=_kernel_keys(m.obj("all_reduce_kernels", optional=True)),
            quantization=m.string("quantization", optional=True) or "none",
            arena_bytes=memory.integer("arena_bytes", low=0),
            slots={n: Slot(s.integer("offset", low=0), s.integer("nbytes", low=0)) for n, s in memory.objs("tensors")},
            weights={n: WeightEntry(w.dtype("dtype"), w.shape("shape"), w.integer("offset", low=0),
                                    w.integer("nbytes", low=0))
                     for n, w in m.objs("weights")},
            kernels={k: KernelEntry(e.integer("offset", low=0), e.integer("nbytes", low=0), e.string("plugin"),
                                    e.string("target"), e.string("entry"), e.strs("signature"), e.integer("num_warps"),
                                    e.integer("shared_bytes", low=0), e.obj("launch").data,
                                    e.integer("global_scratch", low=0, default=0))
                     for k, e in m.objs("kernels")},
            sections={n: Section(s.integer("offset", low=0), s.integer("length", low=0), s.integer("crc32", low=0))
                      for n, s in ((n, sections.obj(n)) for n in SECTIONS)},
        )
        manifest._check()
        return manifest

    def _check(self) -> None:
        """What the fields must agree on, beyond each field's own type."""
        if self.quantization not in QUANTIZATIONS:
            raise ManifestError(f"manifest.quantization must be one of {', '.join(QUANTIZATIONS)}, "
                                f"got {self.quantization!r}: this engine needs a newer Kiln")
        if self.rank >= self.world_size:
            raise ManifestError(f"manifest: rank {self.rank} is not below world_size {self.world_size}")
        logits = self.tensors.get(self.logits) if self.outputs else None
        if logits is None or not logits.shape or not isinstance(logits.shape[-1], int):
            raise ManifestError("manifest: the first output must be a tensor of fixed width (the logits)")
        eos = self.model.get("eos_token_ids", [])
        if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise ManifestError(f"manifest.model.eos_token_ids must be a list of token ids, got {eos!r}")
        known = set(self.tensors) | set(self.weights)
        for i, p in enumerate(self.plan):
            missing = [t for t in (*p.inputs.values(), p.output) if t is not None and t not in known]
            if missing:
                raise ManifestError(f"manifest: plan op {i} ({p.op}) names tensor {missing[0]!r}, which is "
                                    "neither a tensor nor a weight")
            absent = [k for keys in p.kernel_keys.values() for k in keys if k not in self.kernels]
            if absent:
                raise ManifestError(f"manifest: plan op {i} ({p.op}) names kernel {absent[0]!r}, which is not stored")
        absent = [k for keys in self.all_reduce_kernels.values() for k in keys if k not in self.kernels]
        if absent:
            raise ManifestError(f"manifest: all_reduce_kernels names kernel {absent[0]!r}, which is not stored")
        self.kv.check(self.weights)
        unplaced = [n for n, t in self.tensors.items() if t.kind != "state" and n not in self.slots]
        if unplaced:
            raise ManifestError(f"manifest: tensor {unplaced[0]!r} has no place in the memory plan")


def _fields(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


def _plan_entry(p: Fields) -> PlanEntry:
    return PlanEntry(p.string("op"), p.integer("version", low=0), p.inputs("inputs"), p.obj("attrs").data,
                     p.string("output"), p.string("source"), _kernel_keys(p.obj("kernel_keys")))


def _kernel_keys(keys: Fields | None) -> dict[str, tuple[str, ...]]:
    """{target: kernel keys}; an absent object is none (engines from before the field)."""
    return {} if keys is None else {t: k.strs_value() for t, k in keys.items()}
