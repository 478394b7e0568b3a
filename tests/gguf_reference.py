"""An independent reading of GGML's block formats, written from the format's definition (ggml's
block structs and its reference dequantize_row_* loops), to check the dequantization Kiln reads
GGUF weights through. Every function takes the raw blocks, uint8 [n_blocks, block_bytes], and
returns float32 [n_blocks, block_values]; plain numpy over all blocks at once, loops only over the
positions inside a block, so each line can be held against the definition."""
from __future__ import annotations

import numpy as np


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view("<f2").astype(np.float32)  # [n, 1]


def q8_0(b: np.ndarray) -> np.ndarray:
    """d (f16), then 32 signed bytes: x = d * q."""
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def q4_0(b: np.ndarray) -> np.ndarray:
    """d, then 16 bytes: low nibbles are values 0..15, high nibbles 16..31: x = d * (q - 8)."""
    qs = b[:, 2:18].astype(np.int32)
    q = np.concatenate([qs & 15, qs >> 4], axis=1)
    return _f16(b, 0) * (q - 8).astype(np.float32)


def q4_1(b: np.ndarray) -> np.ndarray:
    """d, m, then 16 bytes as in Q4_0: x = d * q + m."""
    qs = b[:, 4:20].astype(np.int32)
    q = np.concatenate([qs & 15, qs >> 4], axis=1)
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def q5_0(b: np.ndarray) -> np.ndarray:
    """d, a 32-bit little-endian word of fifth bits (bit i for value i), 16 bytes of nibbles as in
    Q4_0: x = d * (q - 16)."""
    qh = b[:, 2:6].copy().view("<u4").astype(np.int64)  # [n, 1]
    qs = b[:, 6:22].astype(np.int64)
    low = np.concatenate([qs & 15, qs >> 4], axis=1)
    high = (qh >> np.arange(32)) & 1
    return _f16(b, 0) * ((low | (high << 4)) - 16).astype(np.float32)


def q5_1(b: np.ndarray) -> np.ndarray:
    """d, m, fifth bits and nibbles as in Q5_0: x = d * q + m."""
    qh = b[:, 4:8].copy().view("<u4").astype(np.int64)
    qs = b[:, 8:24].astype(np.int64)
    low = np.concatenate([qs & 15, qs >> 4], axis=1)
    high = (qh >> np.arange(32)) & 1
    return _f16(b, 0) * (low | (high << 4)).astype(np.float32) + _f16(b, 2)


def _k4_scale_min(scales: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block j's 6-bit scale and min, packed in 12 bytes (ggml's get_scale_min_k4)."""
    s = scales.astype(np.int32)
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return ((s[:, j + 4] & 15) | ((s[:, j - 4] >> 6) << 4)), ((s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4))


def q4_k(b: np.ndarray) -> np.ndarray:
    """d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles; 256 values in 4 runs of 64:
    the low nibbles of 32 bytes, then their high nibbles, each 32 with its own scale and min:
    x = d * scale * q - dmin * min."""
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), b[:, 4:16], b[:, 16:144].astype(np.int32)
    out = []
    for run in range(4):
        q = qs[:, 32 * run:32 * run + 32]
        for half, values in enumerate((q & 15, q >> 4)):
            sc, m = _k4_scale_min(scales, 2 * run + half)
            out.append(d * sc[:, None] * values - dmin * m[:, None])
    return np.concatenate(out, axis=1).astype(np.float32)


def q5_k(b: np.ndarray) -> np.ndarray:
    """As Q4_K with a fifth bit per value from 32 bytes qh (bit 2*run + half of byte l):
    d, dmin, 12 bytes scales, 32 bytes qh, 128 bytes nibbles."""
    d, dmin, scales = _f16(b, 0), _f16(b, 2), b[:, 4:16]
    qh, qs = b[:, 16:48].astype(np.int32), b[:, 48:176].astype(np.int32)
    out = []
    for run in range(4):
        q = qs[:, 32 * run:32 * run + 32]
        for half, values in enumerate((q & 15, q >> 4)):
            fifth = (qh >> (2 * run + half)) & 1
            sc, m = _k4_scale_min(scales, 2 * run + half)
            out.append(d * sc[:, None] * (values + 16 * fifth) - dmin * m[:, None])
    return np.concatenate(out, axis=1).astype(np.float32)


def q6_k(b: np.ndarray) -> np.ndarray:
    """128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed 8-bit scales, d last; 256
    values in 2 halves of 128, each 4 runs of 32 (value = 6 bits - 32), scale per 16 values."""
    ql, qh = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b, 208)
    out = np.zeros((b.shape[0], 256), np.float32)
    for half in range(2):
        lo, hi, s = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32], sc[:, 8 * half:8 * half + 8]
        runs = ((lo[:, :32] & 15) | ((hi & 3) << 4), (lo[:, 32:] & 15) | (((hi >> 2) & 3) << 4),
                (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4))
        for r, q in enumerate(runs):
            scale = np.repeat(s[:, 2 * r:2 * r + 2], 16, axis=1)  # values 0-15 and 16-31 of the run
            out[:, 128 * half + 32 * r:128 * half + 32 * r + 32] = d * scale * (q - 32)
    return out


REFERENCES = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q4_K": q4_k, "Q5_K": q5_k,
              "Q6_K": q6_k}
# Byte offsets of each block's float16 fields: random blocks get finite values there.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw data of a [rows, cols] tensor of `qtype`, uint8 [rows, bytes per row], with
    finite float16 scales in [-2, 2]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    n = rows * cols // block_values
    blocks = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        blocks[:, at:at + 2] = rng.uniform(-2, 2, (n, 1)).astype("<f2").view(np.uint8)
    return blocks.reshape(rows, cols // block_values * block_bytes)


def reference_dequantize(qtype: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """float32 [rows, cols] of raw data uint8 [rows, bytes per row]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rows = raw.shape[0]
    return REFERENCES[qtype](raw.reshape(-1, block_bytes)).reshape(rows, cols)
