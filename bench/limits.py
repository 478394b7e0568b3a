"""The cost model of one engine step: the bytes it must move and the FLOPs it must do.

Everything comes from one rank's engine manifest (its plan, weight index and KV-cache
layout), so bench knows no architecture either:

- bytes: every weight the plan reads in full (each counted once, however many ops use it),
  plus the rows gathered from lookup tables (the embedding, the rope table: one row per
  token, not the table), plus per attention layer the KV cache each sequence attends to
  (K and V of its context, within the sliding window if any) and the KV the step's new
  tokens write. Activations are left out: they fit in caches or are small next to weights,
  so the figure is a lower bound on the traffic, which is what a limit should be.
- FLOPs: 2 x weight elements x rows for every matrix the plan multiplies, rows being the
  step's tokens (T) or its logit rows (L) as the op's output says (the LM head only runs on
  L rows), plus attention: 4 x heads x head_dim per (query, key) pair, counting only the
  causal pairs each query really attends to.

The limit time of a step is max(bytes / copy bandwidth, FLOPs / GEMM rate): a perfect engine
streams the bytes and does the math at full rate, overlapped. For a tensor-parallel engine
the manifest is one rank's share, compared with one device's ceilings (the ranks run side by
side); the all-reduce traffic is not counted.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.bench.hardware import Hardware
from kiln.engines.manifest import Manifest
# Inputs that an op gathers rows from instead of reading whole: (op, input), "*" for any op.
GATHERED = {("embedding", "weight"), ("*", "rope_cache")}


@dataclass(frozen=True)
class StepShape:
    """What one step ran: new tokens and context length per sequence, and logit rows."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    logit_rows: int

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass(frozen=True)
class StepCost:
    bytes: float
    flops: float

    def seconds(self, hw: Hardware) -> float:
        return max(self.bytes / hw.copy_bytes_per_s, self.flops / hw.gemm_flops_per_s)

    def bound(self, hw: Hardware) -> str:
        """Which ceiling sets the limit: "bytes" (bandwidth) or "flops" (compute)."""
        return "bytes" if self.bytes / hw.copy_bytes_per_s >= self.flops / hw.gemm_flops_per_s else "flops"

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(self.bytes + other.bytes, self.flops + other.flops)


@dataclass(frozen=True)
class AttentionLayer:
    num_heads: int
    head_dim: int
    window: int  # 0: no sliding window


def attended_pairs(new_tokens: int, context: int, window: int = 0) -> int:
    """(query, key) pairs of `new_tokens` queries at the end of `context` tokens, causal, each
    query seeing at most `window` keys (0: all): query i (1-based position p) sees min(p, w)."""
    first = context - new_tokens + 1  # position of the first new token, 1-based

    def prefix(p: int) -> int:  # sum of min(q, w) for q = 1..p
        if window <= 0 or p <= window:
            return p * (p + 1) // 2
        return window * (window + 1) // 2 + (p - window) * window

    return prefix(context) - prefix(first - 1)


@dataclass(frozen=True)
class CostModel:
    dense_bytes: int            # weights read in full every step
    gathered_row_bytes: int     # bytes gathered per token from lookup tables
    token_params: int           # matrix elements multiplied once per token (T rows)
    logit_params: int           # matrix elements multiplied once per logit row (L rows)
    kv_token_bytes: int         # K and V of one token in one layer
    layers: tuple[AttentionLayer, ...]

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> CostModel:
        weights, tensors = manifest.weights, manifest.tensors
        dense: set[str] = set()
        gathered: set[str] = set()
        token_params = logit_params = 0
        layers = []
        for op in manifest.plan:
            rows = tensors[op.output].shape[0] if op.output in tensors else "T"
            for key, name in op.inputs.items():
                if name is None or name not in weights:
                    continue
                if (op.op, key) in GATHERED or ("*", key) in GATHERED:
                    gathered.add(name)
                    continue
                dense.add(name)
                shape = weights[name].shape
                if len(shape) == 2:  # a matrix multiplied by the op's rows; 1-D are norms and biases
                    params = shape[0] * shape[1]
                    if rows == "L":
                        logit_params += params
                    else:
                        token_params += params
            if "block_tables" in op.inputs:  # an op that attends over the paged KV cache
                a = op.attrs
                layers.append(AttentionLayer(a["num_heads"], a["head_dim"], a.get("window", 0) or 0))
        row_bytes = sum(weights[n].nbytes // weights[n].shape[0] for n in gathered - dense)
        return cls(dense_bytes=sum(weights[n].nbytes for n in dense), gathered_row_bytes=row_bytes,
                   token_params=token_params, logit_params=logit_params,
                   kv_token_bytes=manifest.kv.bytes_per_token // manifest.kv.num_layers,
                   layers=tuple(layers))

    def step(self, shape: StepShape) -> StepCost:
        """Bytes and FLOPs of one step that ran `shape`."""
        t = shape.num_tokens
        nbytes = self.dense_bytes + t * self.gathered_row_bytes
        flops = 2 * (self.token_params * t + self.logit_params * shape.logit_rows)
        for layer in self.layers:
            kv_read = sum(min(ctx, layer.window) if layer.window else ctx for ctx in shape.context_lens)
            nbytes += (kv_read + t) * self.kv_token_bytes  # read the context, write the new tokens
            pairs = sum(attended_pairs(n, ctx, layer.window) for n, ctx in zip(shape.query_lens, shape.context_lens))
            flops += 4 * layer.num_heads * layer.head_dim * pairs
        return StepCost(float(nbytes), float(flops))

    def total(self, shapes: Sequence[StepShape]) -> StepCost:
        cost = StepCost(0.0, 0.0)
        for s in shapes:
            cost = cost + self.step(s)
        return cost

    def limit_seconds(self, shapes: Sequence[StepShape], hw: Hardware) -> float:
        """The least time the steps could take, each at its own bound (steps run one after another)."""
        return sum(self.step(s).seconds(hw) for s in shapes)

    def bound(self, shapes: Sequence[StepShape], hw: Hardware) -> str:
        """"bytes" or "flops": whichever sets the limit for most of the limit time."""
        by = {"bytes": 0.0, "flops": 0.0}
        for s in shapes:
            cost = self.step(s)
            by[cost.bound(hw)] += cost.seconds(hw)
        return max(by, key=by.get)

    def prefill_shapes(self, prompt_len: int, max_num_tokens: int) -> list[StepShape]:
        """The steps of a lone prompt's prefill, chunked at the engine's token budget."""
        shapes, done = [], 0
        while done < prompt_len:
            n = min(max_num_tokens, prompt_len - done)
            done += n
            shapes.append(StepShape((n,), (done,), 1))
        return shapes
