"""`bench-engine --kv-cache-dtype fp8`: the decode and offline phases run again, in the same run,
on the same checkpoint built with an e4m3 KV cache, its KV pool sized from the same free memory
(so it holds about twice the tokens), and each such figure set beside the model-dtype cache's."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kiln.bench.figures import Figure
from kiln.builder.config import BuildConfig

TAG = "fp8 KV"


def fp8_config(cfg: BuildConfig, calibration_prompts: Path | None = None) -> BuildConfig:
    """The e4m3-cache engine's build: `cfg`'s, with its scales calibrated on `calibration_prompts` if given."""
    return replace(cfg, kv_cache_dtype="fp8", calibration_prompts=calibration_prompts and str(calibration_prompts))


def tagged(figures: list[Figure]) -> list[Figure]:
    """The FP8-KV engine's figures, named and keyed apart from the model-dtype engine's."""
    return [replace(f, name=f"{f.name} [{TAG}]", key=("fp8_kv",) + f.key, params={**f.params, "kv_cache": "fp8"})
            for f in figures]


def share_eager(base: list[Figure], fp8: list[Figure]) -> None:
    """The eager baseline is the same model either way: give each FP8-KV figure its twin's."""
    by_key = {f.key: f for f in base}
    for f in fp8:
        twin = by_key.get(f.key[1:])
        if twin is not None:
            f.eager = twin.eager


def comparisons(base: list[Figure], fp8: list[Figure], model_dtype: str) -> list[str]:
    """One note per figure both engines measured: the FP8-KV engine's value over the model-dtype one's."""
    by_key = {f.key: f for f in base}
    notes = []
    for f in fp8:
        twin = by_key.get(f.key[1:])
        if twin is None or f.value is None or twin.value is None or not f.higher_is_better:
            continue
        notes.append(f"{twin.name}: {TAG} {f.value / twin.value:.2f}x the {model_dtype} KV cache "
                     f"({f.value:,.0f} vs {twin.value:,.0f} {f.unit})")
    return notes
