"""The model under test when no engine is given: a random checkpoint of a chosen shape (by default
Llama-3-8B's) and its engine, both kept in a work folder and reused by later runs.

Folder names carry everything that decides their contents (shape and dtype for the
checkpoint; build flags, target and a hash of the compiler's source for the engine), so a
second run with the same flags reuses 16 GB instead of rewriting it, and a changed compiler
never reuses an engine it did not build. Both are written to a temporary sibling and renamed
into place by their writers, so an interrupted run leaves nothing that looks finished.
"""
from __future__ import annotations

import hashlib
import inspect
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kiln import builder, engines, models, plugins
from kiln.builder.build import build_engine
from kiln.builder.config import BuildConfig
from kiln.engines.manifest import Manifest

FAMILY = "llama3"  # Llama 3.1's rope scaling ("llama3"), untied embeddings


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int

    def key(self) -> str:
        return (f"h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}-kv{self.num_kv_heads}"
                f"-i{self.intermediate_size}-v{self.vocab_size}-p{self.max_position_embeddings}")

    def parameters(self) -> int:
        h, kv_dim = self.hidden_size, self.hidden_size // self.num_heads * self.num_kv_heads
        layer = h * (2 * h + 2 * kv_dim) + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * layer + 2 * self.vocab_size * h + h


SHAPES = {
    "llama3-8b": Shape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                       vocab_size=128256, max_position_embeddings=8192),
    # Small enough that the whole benchmark runs on a CPU in seconds (tests, trying flags).
    "tiny": Shape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  vocab_size=512, max_position_embeddings=256),
}


def with_overrides(shape: Shape, **overrides: int | None) -> Shape:
    """`shape` with the given fields replaced (None leaves a field as it is)."""
    return replace(shape, **{k: v for k, v in overrides.items() if v is not None})


def check_shape(shape: Shape) -> str | None:
    """Why this shape cannot be built, or None."""
    for name, value in asdict(shape).items():
        if value < 1:
            return f"{name} must be positive, got {value}"
    if shape.hidden_size % shape.num_heads or shape.num_heads % shape.num_kv_heads:
        return "hidden size must divide by heads, and heads by kv heads"
    if (shape.hidden_size // shape.num_heads) % 2:
        return "head_dim (hidden size / heads) must be even for rotary embeddings"
    return None


def source_hash() -> str:
    """Hash of the code that decides an engine's bytes: models, builder, plugins and the format."""
    digest = hashlib.sha256()
    for package in (models, builder, plugins, engines):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def ensure_checkpoint(work_dir: Path, shape: Shape, dtype: str, device: str) -> tuple[Path, bool]:
    """The random checkpoint for `shape`, written if missing; returns (path, reused)."""
    path = work_dir / f"{FAMILY}-{shape.key()}-{dtype}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path, True
    from kiln.models.random_checkpoint import write_random_checkpoint
    kwargs = dict(hidden_size=shape.hidden_size, num_layers=shape.num_layers, num_heads=shape.num_heads,
                  num_kv_heads=shape.num_kv_heads, intermediate_size=shape.intermediate_size,
                  vocab_size=shape.vocab_size, max_position_embeddings=shape.max_position_embeddings,
                  dtype=dtype, overwrite=True)
    # Initialising 8B parameters is minutes on a CPU and seconds on a GPU; older versions of
    # the writer have no device keyword and always use the CPU.
    if "device" in inspect.signature(write_random_checkpoint).parameters:
        kwargs["device"] = device
    return write_random_checkpoint(path, FAMILY, **kwargs), False


def _calibration_key(cfg: BuildConfig) -> str:
    """An engine path's mark of calibrated scales (static activation scales, an e4m3 cache's scales): the
    calibration prompts' content, so that other prompts build another engine."""
    if cfg.calibration_prompts is None:
        return ""
    return f"-static{hashlib.sha256(Path(cfg.calibration_prompts).read_bytes()).hexdigest()[:8]}"


def engine_path(work_dir: Path, checkpoint: Path, cfg: BuildConfig) -> Path:
    """Where the engine for `checkpoint` built with `cfg` lives in the work folder."""
    ckpt_key = f"{checkpoint.name}-{hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:8]}"
    flags = (f"{'-'.join(cfg.targets)}-{cfg.dtype}-tp{cfg.tp_size}-b{cfg.max_batch_size}-s{cfg.max_seq_len}"
             f"-t{cfg.max_num_tokens}-kv{cfg.kv_block_size}" + ("-fp8kv" if cfg.kv_cache_dtype == "fp8" else "")
             + (f"-{cfg.quantization}" if cfg.quantization != "none" else "")
             + ("-lmhead" if cfg.quantize_lm_head else "") + _calibration_key(cfg))
    return work_dir / "engines" / ckpt_key / f"{flags}-{source_hash()}"


def ensure_engine(work_dir: Path, checkpoint: Path, cfg: BuildConfig, progress: bool = True) -> tuple[Path, bool]:
    """The engine for `checkpoint` and `cfg`, built if missing; returns (path, reused).

    Engines of the same checkpoint and flags built by other versions of the compiler are
    deleted first: they can never be reused, and each can be as large as the checkpoint."""
    path = engine_path(work_dir, checkpoint, cfg)
    if (path / Manifest.rank_file(0)).is_file():
        return path, True
    # The same flags exactly: one engine's flags can begin another's ("-fp8kv" and "-fp8kv-fp8").
    flags = path.name.rsplit("-", 1)[0]
    if path.parent.is_dir():
        for stale in path.parent.iterdir():
            if stale.is_dir() and stale.name.rsplit("-", 1)[0] == flags and stale != path:
                shutil.rmtree(stale)
    build_engine(checkpoint, path, cfg, progress=progress)
    return path, False
