"""bench-engine's cost model: the bytes and FLOPs of a hand-computed step, causal and windowed attention pairs,
and a real engine's weights counted once. The limits every bench figure is divided by come from here."""
from __future__ import annotations

import pytest

from kiln.bench.hardware import Hardware
from kiln.bench.limits import CostModel, StepShape, attended_pairs
from kiln.engines.manifest import KVLayout, Manifest, PlanEntry, TensorSpec, WeightEntry


def _weight(*shape):
    n = 1
    for d in shape:
        n *= d
    return WeightEntry("float32", shape, 0, 4 * n)


def _op(op, output, attrs=None, **inputs):
    return PlanEntry(op, 1, inputs, attrs or {}, output, "")


# One layer, 2 heads of dim 2, 1 KV head; hidden 4, vocab 10, float32 (4-byte) everything.
HEADS = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 2}
MANIFEST = Manifest(
    kiln_version="test", model={}, dtype="float32", targets=("cpu",), rank=0, world_size=1, max_num_tokens=8,
    max_batch_size=2, max_seq_len=16, kv=KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=2,
                                                 dtype="float32"),
    tokenizer_file=None, inputs=(), outputs=("logits",),
    tensors={name: TensorSpec(shape, "float32", "activation") for name, shape in (
        ("x", ("T", 4)), ("q", ("T", 4)), ("h", ("T", 4)), ("rows", ("L", 4)), ("normed", ("L", 4)),
        ("logits", ("L", 10)))},
    plan=(
        _op("embedding", "x", {"scale": 1.0}, input_ids="input_ids", weight="embed"),
        _op("norm_qkv_rope", "q", HEADS, x="x", w_qkv="w_qkv", rope_cache="rope_cache"),
        _op("attention_o_proj", "h", {**HEADS, "window": 0}, q="q", block_tables="block_tables", w_o="w_o",
            residual="x"),
        _op("take_rows", "rows", x="h", indices="logits_indices"),
        _op("rms_norm", "normed", x="rows", weight="norm"),
        _op("linear", "logits", x="normed", weight="lm_head", bias=None),
    ),
    arena_bytes=0, slots={},
    weights={"embed": _weight(10, 4), "rope_cache": _weight(8, 2), "w_qkv": _weight(8, 4),
             "w_o": _weight(4, 4), "norm": _weight(4), "lm_head": _weight(10, 4)},
)


def test_cost_model_on_a_hand_computed_step():
    cost = CostModel.from_manifest(MANIFEST)
    # A 3-token prefill (context 3) and a decode at context 5: T = 4 tokens, L = 2 logit rows.
    step = cost.step(StepShape(query_lens=(3, 1), context_lens=(3, 5), logit_rows=2))
    # Read whole: w_qkv 128 + w_o 64 + norm 16 + lm_head 160 = 368 bytes. Gathered per token:
    # an embedding row (16) and a rope row (8) -> 4 x 24 = 96. KV, 16 bytes per token (K and V,
    # 1 head of dim 2): read 3 + 5 tokens = 128, write 4 tokens = 64.
    assert step.bytes == 368 + 96 + 128 + 64
    # Matmuls: (32 + 16) elements x 4 tokens + lm_head 40 x 2 rows, 2 FLOPs each = 384 + 160.
    # Attention: causal pairs 1+2+3 (prefill) + 5 (decode) = 11, x 4 x 2 heads x dim 2 = 176.
    assert step.flops == 384 + 160 + 176
    hw = Hardware("cpu", "test", copy_bytes_per_s=1000.0, gemm_flops_per_s=1000.0, copy_buffer_bytes=0,
                  gemm_n=0, gemm_dtype="float32")
    assert step.seconds(hw) == pytest.approx(0.720) and step.bound(hw) == "flops"
    shapes = [StepShape((1,), (5,), 1)] * 3
    assert cost.limit_seconds(shapes, hw) == pytest.approx(3 * cost.step(shapes[0]).seconds(hw))


def test_attended_pairs_respect_causality_and_the_window():
    assert attended_pairs(1, 5) == 5
    assert attended_pairs(4, 4) == 1 + 2 + 3 + 4
    assert attended_pairs(3, 5, window=2) == 2 + 2 + 2
    assert attended_pairs(4, 4, window=2) == 1 + 2 + 2 + 2
    assert attended_pairs(2, 6, window=10) == 5 + 6


def test_cost_model_of_a_real_engine_counts_each_weight_once(factory):
    from kiln.runtime.engine import load_engine
    engine = load_engine(factory.engine(factory.checkpoint("llama3"), dtype="float32"))
    cost = CostModel.from_manifest(engine.manifest)
    weights = engine.manifest.weights
    full = sum(w.nbytes for n, w in weights.items() if n not in ("model.embed_tokens.weight", "rope_cache"))
    assert cost.dense_bytes == full
    assert cost.logit_params == 512 * 64  # the LM head runs on logit rows only
    assert len(cost.layers) == 2
