"""Build configuration: the flags of `build-engine`, checked once where they enter."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.dtypes import MODEL_DTYPES
from kiln.engines.manifest import QUANTIZATIONS, blocks_per_sequence, symbol_bounds
from kiln.plugins.fp8 import FP8_TARGETS

TARGETS = ("cpu", "sm_80", "sm_89", "sm_90", "sm_100")
# --kv-cache-dtype: "auto" keeps the cache in the model's dtype, "fp8" stores e4m3 (plugins/fp8.py).
KV_CACHE_DTYPES = ("auto", "fp8")
# --activation-scales of an FP8 engine (builder/passes/quantize.py).
ACTIVATION_SCALES = ("per-token", "static")
# GPU targets whose Triton has e4m3 (float8e4nv) values; sm_80 has none, even for a cache that
# is only converted in registers (Triton refuses the type there).
FP8_KV_TARGETS = ("sm_89", "sm_90", "sm_100")


class BuildConfigError(ValueError):
    """A build flag with a value that cannot work; the message names the flag."""


@dataclass(frozen=True)
class BuildConfig:
    dtype: str = "float32"
    tp_size: int = 1
    max_batch_size: int = 8
    max_seq_len: int = 256
    max_num_tokens: int = 256
    kv_block_size: int = 16
    targets: tuple[str, ...] = field(default=("cpu",))
    # False keeps the traced plan of primitive ops (`--no-fuse`): it runs on the CPU, and its
    # ONNX export is the reference that a fusion pass must not change.
    fuse: bool = True
    kv_cache_dtype: str = "auto"
    # "fp8": the decoder layers' GEMMs run W8A8 in e4m3 (builder/passes/quantize.py).
    quantization: str = "none"
    quantize_lm_head: bool = False
    # A text file of prompts (one a line) that builder/calibrate.py runs: for an e4m3 cache's scales, static
    # activation scales and GPTQ.
    calibration_prompts: str | None = None
    # FP8: "per-token" (each row's own scale, found as the row is made) or "static" (one per tensor, calibrated).
    activation_scales: str = "per-token"
    # Round the FP8 weights by GPTQ over the calibration prompts' inputs (builder/gptq.py), not to nearest.
    gptq: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise BuildConfigError(f"--dtype {self.dtype}: choose one of {', '.join(MODEL_DTYPES)}")
        for flag, value in (("--tp-size", self.tp_size), ("--max-batch-size", self.max_batch_size),
                            ("--max-seq-len", self.max_seq_len), ("--max-num-tokens", self.max_num_tokens),
                            ("--kv-block-size", self.kv_block_size)):
            if not isinstance(value, int) or value < 1:
                raise BuildConfigError(f"{flag} must be a positive integer, got {value!r}")
        if self.kv_block_size & (self.kv_block_size - 1):
            raise BuildConfigError(f"--kv-block-size must be a power of two, got {self.kv_block_size}")
        if not isinstance(self.fuse, bool):
            raise BuildConfigError(f"fuse must be True or False, got {self.fuse!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BuildConfigError(f"--kv-cache-dtype {self.kv_cache_dtype}: choose one of {', '.join(KV_CACHE_DTYPES)}")
        if not self.targets:
            raise BuildConfigError("at least one --target is needed")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise BuildConfigError(f"--target {unknown[0]}: choose from {', '.join(TARGETS)}")
        no_fp8 = [t for t in self.targets if t != "cpu" and t not in FP8_KV_TARGETS]
        if self.kv_cache_dtype == "fp8" and no_fp8:
            raise BuildConfigError(f"--kv-cache-dtype fp8 cannot run on --target {no_fp8[0]}: Triton has e4m3 values "
                                   f"only on {', '.join(FP8_KV_TARGETS)} (and the cpu reference); build for those, "
                                   "or keep --kv-cache-dtype auto for that target")
        if self.quantization not in QUANTIZATIONS:
            raise BuildConfigError(f"--quantization {self.quantization}: choose one of {', '.join(QUANTIZATIONS)}")
        if self.quantize_lm_head and self.quantization == "none":
            raise BuildConfigError("--quantize-lm-head needs --quantization fp8")
        if self.activation_scales not in ACTIVATION_SCALES:
            raise BuildConfigError(f"--activation-scales {self.activation_scales}: choose one of "
                                   f"{', '.join(ACTIVATION_SCALES)}")
        if self.activation_scales == "static" and (self.quantization != "fp8" or self.calibration_prompts is None):
            raise BuildConfigError("--activation-scales static needs --quantization fp8 and --calibration-prompts: "
                                   "the static scales are the largest inputs the prompts give each projection")
        if self.calibration_prompts is not None and self.quantization == "none" and self.kv_cache_dtype != "fp8":
            raise BuildConfigError("--calibration-prompts needs --quantization fp8 or --kv-cache-dtype fp8: "
                                   "it measures their scales")
        if (self.calibration_prompts is not None and self.kv_cache_dtype != "fp8" and not self.gptq
                and self.activation_scales != "static"):
            raise BuildConfigError("--calibration-prompts measures nothing in this build: with --quantization fp8 "
                                   "it is for --gptq (more accurate weights) or --activation-scales static (faster "
                                   "o_proj and down), and for --kv-cache-dtype fp8's scales; add what you meant")
        if self.gptq and (self.quantization != "fp8" or self.calibration_prompts is None):
            raise BuildConfigError("--gptq needs --quantization fp8 and --calibration-prompts: it rounds the FP8 "
                                   "weights over the inputs the prompts give each projection")
        no_fp8 = [t for t in self.targets if t not in FP8_TARGETS + ("cpu",)]
        if self.quantization == "fp8" and no_fp8:
            raise BuildConfigError(f"--quantization fp8 needs FP8 tensor cores, which {no_fp8[0]} does not have: "
                                   f"build for {', '.join(FP8_TARGETS)} (or cpu), or without --quantization fp8")

    @property
    def bounds(self) -> dict[str, int]:
        """The largest value of each symbolic dim, which the memory plan sizes tensors for."""
        return symbol_bounds(self.max_num_tokens, self.max_batch_size,
                             blocks_per_sequence(self.max_seq_len, self.kv_block_size))


def default_targets() -> tuple[str, ...]:
    """This machine's GPU architecture if it has one, else the CPU."""
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return (f"sm_{major}{minor}",)
    except Exception:  # a broken CUDA setup should not stop a CPU build
        pass
    return ("cpu",)
