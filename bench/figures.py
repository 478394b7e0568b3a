"""One measured figure with what it is compared against: its limit, the eager baseline and, for
an FP8 engine's figure, the bf16 engine's figure measured in the same run."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Figure:
    """A figure of one section ("decode", "offline", "latency").

    `value` is None when the measurement was skipped (`note` says why). For throughputs
    (`higher_is_better`) the ratio to the limit is value / limit; for latencies it is
    limit / value, so in both cases 1.0 means the hardware's limit and less is further away.
    The ratio to eager is how many times better than the eager baseline Kiln is.
    """

    section: str
    name: str
    unit: str
    value: float | None
    limit: float | None = None
    bound: str | None = None          # "bytes" or "flops": which ceiling sets the limit
    eager: float | None = None
    higher_is_better: bool = True
    note: str = ""
    key: tuple = ()                   # matches the eager baseline's result to this figure
    params: dict = field(default_factory=dict)
    quantization: str = "none"        # the engine's; "fp8" figures sit beside the bf16 ones
    bf16: float | None = None         # an fp8 figure: the bf16 engine's value of the same figure

    @staticmethod
    def _ratio(better: float | None, worse: float | None, higher: bool) -> float | None:
        if better is None or worse is None or better <= 0 or worse <= 0:
            return None
        return better / worse if higher else worse / better

    @property
    def ratio_to_limit(self) -> float | None:
        return self._ratio(self.value, self.limit, self.higher_is_better)

    @property
    def ratio_to_eager(self) -> float | None:
        return self._ratio(self.value, self.eager, self.higher_is_better)

    @property
    def ratio_to_bf16(self) -> float | None:
        """How many times better than the bf16 engine an FP8 engine's figure is."""
        return self._ratio(self.value, self.bf16, self.higher_is_better)

    def to_dict(self) -> dict:
        return {"name": self.name, "unit": self.unit, "value": self.value, "limit": self.limit,
                "bound": self.bound, "ratio_to_limit": self.ratio_to_limit, "eager": self.eager,
                "ratio_to_eager": self.ratio_to_eager, "higher_is_better": self.higher_is_better,
                "note": self.note, **self.params,
                **({"quantization": self.quantization, "bf16": self.bf16, "ratio_to_bf16": self.ratio_to_bf16}
                   if self.quantization != "none" else {})}


def skipped(section: str, name: str, unit: str, why: str, key: tuple = (), **params) -> Figure:
    return Figure(section, name, unit, None, note=f"skipped: {why}", key=key, params=params)


def beside_bf16(quantized: list[Figure], bf16: list[Figure], quantization: str) -> list[Figure]:
    """The FP8 engine's figures, named as such, each with the bf16 engine's value of the same
    figure (same section, name and key) and the eager baseline it shares."""
    same = {(f.section, f.name, f.key): f for f in bf16}
    for f in quantized:
        base = same.get((f.section, f.name, f.key))
        f.quantization, f.name = quantization, f"{quantization} {f.name}"
        if base is not None:
            f.bf16, f.eager = base.value, base.eager
    return quantized
