"""Option types of `bench-engine`: comma-separated lists checked where they enter, so a bad
value is a usage error naming the option and the expected form, never a traceback."""
from __future__ import annotations

import click

PHASES = ("startup", "decode", "offline", "latency")


class IntList(click.ParamType):
    name = "N,N,..."

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        try:
            items = [int(v) for v in str(value).split(",") if v.strip()]
        except ValueError:
            self.fail(f"{value!r}: expected positive integers separated by commas, like 1,8,64", param, ctx)
        if not items or any(i < 1 for i in items):
            self.fail(f"{value!r}: every batch size must be a positive integer", param, ctx)
        return items


class LengthPairs(click.ParamType):
    name = "IN/OUT,..."

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        pairs = []
        for item in str(value).split(","):
            parts = item.strip().split("/")
            try:
                pair = tuple(int(p) for p in parts)
            except ValueError:
                pair = ()
            if len(pair) != 2 or min(pair) < 1:
                self.fail(f"{item.strip()!r}: expected input/output token counts like 128/128", param, ctx)
            pairs.append(pair)
        return pairs


class Phases(click.ParamType):
    name = "PHASE,..."

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        items = [v.strip() for v in str(value).split(",") if v.strip()]
        unknown = [v for v in items if v not in PHASES]
        if unknown or not items:
            self.fail(f"{value!r}: choose from {', '.join(PHASES)}", param, ctx)
        return items
