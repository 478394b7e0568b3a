"""The FP8 GEMV probe (`scripts/probe_fp8_gemv.py`) on the CPU: its diagnostic variants are edits of
`gemv_fp8.cu`'s text, so a change to that file must either keep them applying or stop the probe with a
message; its other tilings are other kernels; and every variant of one shape compiles for sm_90."""
from __future__ import annotations

import pytest

from kiln.plugins.nvcc import compile_cubin, nvcc_path
from scripts import probe_fp8_gemv as probe


def test_every_edit_applies_to_every_shape_and_changes_the_kernel():
    found = probe.kernels()
    assert {shape for shape, _, _ in found} == set(probe.SHAPES)
    for shape in probe.SHAPES:
        variants = {label: kernel for s, label, kernel in found if s == shape}
        static = probe.STATIC_DIAGNOSTICS if shape in probe.STATIC_SHAPES else {}
        tilings = [probe.tiling_label(tiling) for tiling in probe.TILINGS[shape]]
        assert set(variants) == {"fp8 (engine)", "fp8 static", *static, *probe.DIAGNOSTICS, *tilings, "bf16 (engine)"}
        assert all(variants[label].instance != variants["fp8 (engine)"].instance for label in tilings), shape
        for base, labels in (("fp8 (engine)", probe.DIAGNOSTICS), ("fp8 static", static)):
            for label in labels:
                assert variants[label].instance != variants[base].instance, (shape, label)
                assert variants[label].entry != variants[base].entry


def test_an_edit_that_no_longer_matches_stops_the_probe():
    with pytest.raises(SystemExit, match="update the probe"):
        probe.edited("no such kernel text", probe.NO_STAGE)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed")
def test_the_o_proj_variants_compile_for_sm_90():
    for shape, label, kernel in probe.kernels():
        if shape == "o_proj":
            assert compile_cubin(kernel, "sm_90").binary, label
