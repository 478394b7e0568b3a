"""Option types of `bench-engine`: comma-separated lists and the prefix phase's lengths, checked
where they enter, so a bad value is a usage error naming the option and the expected form, never
a traceback."""
from __future__ import annotations

import click

PHASES = ("startup", "decode", "offline", "latency", "prefix")


class CommaList(click.ParamType):
    """A comma-separated list; `parse` checks its items. A default that is already a list passes."""

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        return self.parse([v.strip() for v in str(value).split(",")], value, param, ctx)

    def parse(self, items: list[str], value, param, ctx) -> list:
        raise NotImplementedError


class IntList(CommaList):
    name = "N,N,..."

    def parse(self, items, value, param, ctx):
        try:
            numbers = [int(v) for v in items if v]
        except ValueError:
            self.fail(f"{value!r}: expected positive integers separated by commas, like 1,8,64", param, ctx)
        if not numbers or any(i < 1 for i in numbers):
            self.fail(f"{value!r}: every batch size must be a positive integer", param, ctx)
        return numbers


class LengthPairs(CommaList):
    name = "IN/OUT,..."

    def parse(self, items, value, param, ctx):
        pairs = []
        for item in items:
            try:
                pair = tuple(int(p) for p in item.split("/"))
            except ValueError:
                pair = ()
            if len(pair) != 2 or min(pair) < 1:
                self.fail(f"{item!r}: expected input/output token counts like 128/128", param, ctx)
            pairs.append(pair)
        return pairs


class Phases(CommaList):
    name = "PHASE,..."

    def parse(self, items, value, param, ctx):
        phases = [v for v in items if v]
        if not phases or any(v not in PHASES for v in phases):
            self.fail(f"{value!r}: choose from {', '.join(PHASES)}", param, ctx)
        return phases


class PrefixLengths(click.ParamType):
    """The prefix phase's token counts: system prompt, each user message, each answer."""

    name = "SYSTEM/USER/OUT"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            lengths = tuple(int(p) for p in str(value).split("/"))
        except ValueError:
            lengths = ()
        if len(lengths) != 3 or min(lengths) < 1:
            self.fail(f"{value!r}: expected system prompt, user message and output token counts like 1024/64/64",
                      param, ctx)
        return lengths
