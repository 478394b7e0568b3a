"""The blocked-weight decode GEMM probe (`scripts/probe_blocked_gemv.*`) on the CPU: the blocked layout
holds every weight once, and the lanes' pieces, fed to mma.sync as the probe's kernel feeds them (the PTX
ISA's fragment layouts of m16n8k16 bf16 and m16n8k32 e4m3, emulated here), sum to x W^T; the kernels
compile for sm_90 without spilling."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from kiln.plugins.nvcc import nvcc_path, source_text
from scripts import probe_blocked_gemv as probe


def test_blocked_layout_is_a_permutation_of_8_row_blocks():
    w = torch.arange(16 * 64, dtype=torch.int16).view(16, 64)
    b = probe.block_weights(w).flatten()
    assert sorted(b.tolist()) == list(range(16 * 64))
    # Row group 1, block 2 (k 16..23), row 3 of the group: the 8 values at (1 * 8 * 64 + 2 * 64 + 3 * 8).
    assert b[1 * 512 + 2 * 64 + 3 * 8:][:8].tolist() == w[8 + 3, 16:24].tolist()
    e4m3 = torch.arange(8 * 32, dtype=torch.int16).to(torch.uint8).view(8, 32)
    assert probe.block_weights(e4m3).flatten()[128 + 16:][:16].tolist() == e4m3[1, 16:32].tolist()


def emulate(x: np.ndarray, w: np.ndarray, n: int, fp8: bool, blocked: bool) -> np.ndarray:
    """out [16, n] as the kernel computes it: for each row group and piece, lane (g, q) takes 16 bytes of
    row g from block 4s + q (or from row-major w at the same k) and the same k of x's tokens g and g + 8,
    and each half of them is one MMA's
    fragment (a0 = A[g][slot lo], a1 = A[g + 8][lo], a2 = A[g][hi], a3 = A[g + 8][hi]; b0 = B[lo][g],
    b1 = B[hi][g]; D: lane (g, q) holds rows g and g + 8 of columns 2q, 2q + 1)."""
    per = 8 if not fp8 else 16            # values in a 16-byte piece
    word = per // 4                       # values in a 32-bit register
    k_mma = 4 * per // 2                  # 16 (bf16) or 32 (e4m3)
    k = x.shape[1]
    groups = w.reshape(n // 8, 8 * k)
    out = np.zeros((16, n))
    g, q = np.arange(32) // 4, np.arange(32) % 4
    for rg in range(n // 8):
        d = np.zeros((16, 8))
        for s in range(k // (4 * per)):
            if blocked:                                              # the lane's piece of W, in values
                at = (s * 32 + q * 8 + g) * per
            else:
                at = g * k + (4 * s + q) * per
            wp = np.stack([groups[rg, a:a + per] for a in at])       # [lane, per]
            lo = np.stack([x[gi, (4 * s + qi) * per:][:per] for gi, qi in zip(g, q)])
            hi = np.stack([x[gi + 8, (4 * s + qi) * per:][:per] for gi, qi in zip(g, q)])
            for half in range(2):
                regs = lambda v, i: v[:, (2 * half + i) * word:][:, :word]   # noqa: E731
                a = np.zeros((16, k_mma))
                b = np.zeros((k_mma, 8))
                for lane in range(32):
                    lo_slot = slice(word * q[lane], word * q[lane] + word)
                    hi_slot = slice(k_mma // 2 + word * q[lane], k_mma // 2 + word * q[lane] + word)
                    a[g[lane], lo_slot], a[g[lane] + 8, lo_slot] = regs(lo, 0)[lane], regs(hi, 0)[lane]
                    a[g[lane], hi_slot], a[g[lane] + 8, hi_slot] = regs(lo, 1)[lane], regs(hi, 1)[lane]
                    b[lo_slot, g[lane]], b[hi_slot, g[lane]] = regs(wp, 0)[lane], regs(wp, 1)[lane]
                d += a @ b
        for lane in range(32):
            cols = rg * 8 + 2 * q[lane] + np.arange(2)
            out[g[lane], cols], out[g[lane] + 8, cols] = d[g[lane], 2 * q[lane]:][:2], d[g[lane] + 8, 2 * q[lane]:][:2]
    return out


@pytest.mark.parametrize("fp8, blocked", [(False, True), (True, True), (False, False), (True, False)])
def test_the_lanes_fragments_sum_to_x_w(fp8, blocked):
    rng = np.random.default_rng(0)
    n, k = 16, 128 if fp8 else 64
    x, w = rng.integers(-4, 5, (16, k)).astype(float), rng.integers(-4, 5, (n, k)).astype(float)
    # integers in 1- or 2-byte words, as e4m3 and bf16 weights are: blocked moves words, not values
    words = torch.from_numpy(w.astype(np.int8 if fp8 else np.int16))
    w_blocked = probe.block_weights(words.view(torch.uint8) if fp8 else words)
    w_blocked = (w_blocked.view(torch.int8) if fp8 else w_blocked).numpy().astype(float).flatten()
    np.testing.assert_array_equal(emulate(x, w_blocked if blocked else w.flatten(), n, fp8, blocked), x @ w.T)


@pytest.mark.skipif(nvcc_path() is None, reason="no nvcc")
def test_the_probe_kernels_compile_for_sm_90_without_spills(tmp_path):
    # one translation unit: the first kernel's source, then the other variants' macro calls
    calls = [probe.kernel(*v).instance.rsplit("\n", 1)[1] for v in probe.VARIANTS[1:]]
    source = "\n".join([source_text(probe.kernel(*probe.VARIANTS[0])), *calls])
    (tmp_path / "k.cu").write_text(source)
    result = subprocess.run([nvcc_path(), "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-Xptxas", "-v", "-o",
                             str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("0 bytes spill stores") == len(probe.VARIANTS), result.stderr
