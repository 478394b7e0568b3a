"""Prefix caching's effect, with caching on and off in one run, on a chat-like workload.

`requests` conversations share one system prompt of `system_len` tokens; each first turn adds a
user message of its own (`user_len` tokens), and every later turn's prompt is the previous
prompt, its `output_len`-token answer and a new user message, submitted as soon as that answer
is complete. All first turns arrive at once. With caching on, the system prompt is computed once
and every follow-up computes only its new tokens.

Reported for caching on and off: time to first token (TTFT) p50 of the first turns and of the
follow-ups (submission to first token, queueing included), and output tokens/s over the whole
run. Then the cost of caching when nothing hits: the same shapes with every prompt fresh random
tokens (0% hit rate), output tokens/s with caching on and off, each the median of REPEATS runs
(with new prompts each time). Each throughput's limit is the cost model's least time for the
steps that ran, as for the offline figures.

Each setting gets an EngineCore of its own, with the same KV pool: one that holds every
conversation at its longest, so caching off never preempts. Before anything is timed, each runs
the no-hit workload once: the first steps of each new shape pay one-time costs (on the CPU,
creating the GEMM primitives), which would otherwise fall on whichever setting runs first.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from kiln.bench.driver import EngineInfo, EngineRun, open_core
from kiln.bench.figures import Figure, skipped
from kiln.bench.hardware import Hardware, synchronize
from kiln.runtime.sampling_params import SamplingParams

SECTION = "prefix"
REPEATS = 3


@dataclass(frozen=True)
class Workload:
    requests: int
    system_len: int
    user_len: int
    output_len: int
    turns: int

    def prompt_len(self, turn: int) -> int:
        return self.system_len + self.user_len + turn * (self.output_len + self.user_len)

    @property
    def longest(self) -> int:
        return self.prompt_len(self.turns - 1) + self.output_len

    def problem(self, info: EngineInfo) -> str | None:
        """Why this workload cannot run on this engine, or None."""
        m = info.manifest
        if self.requests > m.max_batch_size:
            return f"{self.requests} requests are more than the engine's max_batch_size {m.max_batch_size}"
        if self.longest > m.max_seq_len:
            return (f"the last turn reaches {self.longest} tokens, above the engine's max_seq_len {m.max_seq_len}: "
                    "lower --prefix-lengths or --prefix-turns")
        return None

    def kv_tokens_wanted(self, info: EngineInfo) -> int:
        return 0 if self.problem(info) else self.requests * info.kv_tokens(self.longest)


@dataclass
class Conversations:
    """`messages[i][turn]`: what turn `turn` of conversation i adds. Extending, a turn's prompt is
    the conversation so far (empty before the first turn) and its message; otherwise the message
    is the whole prompt."""

    messages: list[list[list[int]]]
    extending: bool

    def prompt(self, i: int, turn: int, history: list[int]) -> list[int]:
        return history + self.messages[i][turn] if self.extending else self.messages[i][turn]


def shared_conversations(w: Workload, vocab_size: int, seed: int) -> Conversations:
    """One system prompt opens every conversation; each turn adds a user message of its own."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(w.system_len)]
    users = [[[rng.randrange(vocab_size) for _ in range(w.user_len)] for _ in range(w.turns)]
             for _ in range(w.requests)]
    return Conversations([[system + u[0]] + u[1:] for u in users], extending=True)


def fresh_conversations(w: Workload, vocab_size: int, seed: int) -> Conversations:
    """The shared workload's prompt lengths, every prompt fresh random tokens: nothing to reuse."""
    rng = random.Random(seed)
    return Conversations([[[rng.randrange(vocab_size) for _ in range(w.prompt_len(t))] for t in range(w.turns)]
                          for _ in range(w.requests)], extending=False)


@dataclass
class Outcome:
    """What one run of a workload measured: TTFT of every first turn and follow-up, in seconds."""

    ttft_first: list[float]
    ttft_follow: list[float]
    seconds: float
    output_tokens: int
    limit_seconds: float
    bound: str
    steps: int
    hit_tokens: int
    query_tokens: int


def run_conversations(run: EngineRun, convs: Conversations, w: Workload, tag: str) -> Outcome:
    """Every conversation through all its turns on `run`'s core, timed on the host."""
    core = run.core
    params = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
    hits, queries = core.blocks.cache_hits, core.blocks.cache_queries
    ttft: dict[tuple[int, int], float] = {}
    submitted: dict[str, tuple[int, int, float]] = {}
    turn_of = [0] * w.requests
    mark = run.recorder.mark()
    synchronize(run.device)
    start = time.perf_counter()

    def submit(i: int, history: list[int]) -> None:
        rid = f"{tag}-{i}-{turn_of[i]}"
        core.add_request(rid, convs.prompt(i, turn_of[i], history), params)
        submitted[rid] = (i, turn_of[i], time.perf_counter())

    for i in range(w.requests):
        submit(i, [])
    while core.has_work():
        for request in core.step():
            i, turn, at = submitted[request.request_id]
            if (i, turn) not in ttft and request.seqs[0].output_ids:
                ttft[i, turn] = time.perf_counter() - at
            if request.finished:
                turn_of[i] += 1
                if turn_of[i] < w.turns:
                    submit(i, request.prompt_ids + request.seqs[0].output_ids)
    synchronize(run.device)
    seconds = time.perf_counter() - start
    shapes = run.recorder.since(mark)
    return Outcome([t for (_, turn), t in ttft.items() if turn == 0], [t for (_, turn), t in ttft.items() if turn > 0],
                   seconds, w.requests * w.turns * w.output_len, run.info.cost.limit_seconds(shapes, run.hw),
                   run.info.cost.bound(shapes, run.hw), len(shapes), core.blocks.cache_hits - hits,
                   core.blocks.cache_queries - queries)


def _names(w: Workload) -> list[tuple[str, str, tuple]]:
    """(name, unit, key) of every figure of this section, in table order."""
    names = []
    for on in ("on", "off"):
        names += [(f"prefix {on}: TTFT p50 first turns", "ms", (SECTION, on, "ttft_first")),
                  (f"prefix {on}: TTFT p50 follow-ups", "ms", (SECTION, on, "ttft_follow")),
                  (f"prefix {on}: output", "tok/s", (SECTION, on, "throughput"))]
    names += [("prefix: TTFT p50 first turns, on vs off", "x", (SECTION, "speedup", "ttft_first")),
              ("prefix: TTFT p50 follow-ups, on vs off", "x", (SECTION, "speedup", "ttft_follow"))]
    for on in ("on", "off"):
        names.append((f"no hits {on}: output", "tok/s", (SECTION, "no-hits", on)))
    names.append(("no hits: caching's throughput cost", "%", (SECTION, "no-hits", "cost")))
    if w.turns == 1:
        names = [n for n in names if "follow-ups" not in n[0]]
    return names


def measure_prefix(info: EngineInfo, hw: Hardware, kv_tokens: int, w: Workload, seed: int = 0,
                   overlap: bool = True, status=lambda message: None) -> list[Figure]:
    """The section's figures: TTFT and throughput with prefix caching on and off, and the no-hit cost."""
    why = w.problem(info)
    if why is None and kv_tokens < w.kv_tokens_wanted(info):
        why = f"a KV pool of {kv_tokens} tokens cannot hold every conversation ({w.kv_tokens_wanted(info)} tokens)"
    if why:
        return [skipped(SECTION, name, unit, why, key) for name, unit, key in _names(w)]
    vocab = info.manifest.vocab_size
    shared = shared_conversations(w, vocab, seed)
    outcomes: dict[str, Outcome] = {}
    fresh: dict[str, list[Outcome]] = {}
    for caching in (True, False):
        on = "on" if caching else "off"
        run = open_core(info, hw, kv_tokens, overlap=overlap, prefix_caching=caching)
        try:
            run_conversations(run, fresh_conversations(w, vocab, seed + 1), w, f"warm-up-{on}")
            status(f"prefix caching {on}: {w.requests} conversations of {w.turns} turns sharing "
                   f"{w.system_len} tokens")
            outcomes[on] = run_conversations(run, shared, w, f"shared-{on}")
            status(f"prefix caching {on}: the same shapes with no prefix to share, {REPEATS} times")
            fresh[on] = [run_conversations(run, fresh_conversations(w, vocab, seed + 2 + r), w, f"fresh-{on}-{r}")
                         for r in range(REPEATS)]
        finally:
            run.close()
    return _figures(w, outcomes, fresh)


def _p50_ms(values: list[float]) -> float:
    return 1e3 * float(np.percentile(values, 50))


def _figures(w: Workload, outcomes: dict[str, Outcome], fresh: dict[str, list[Outcome]]) -> list[Figure]:
    common = {"requests": w.requests, "system_len": w.system_len, "user_len": w.user_len,
              "output_len": w.output_len, "turns": w.turns}

    def throughput(name: str, key: tuple, o: Outcome, **extra) -> Figure:
        return Figure(SECTION, name, "tok/s", o.output_tokens / o.seconds, o.output_tokens / o.limit_seconds,
                      o.bound, key=key, params={**common, "seconds": o.seconds, "steps": o.steps,
                                                "hit_tokens": o.hit_tokens, "query_tokens": o.query_tokens,
                                                "hit_rate": o.hit_tokens / o.query_tokens if o.query_tokens else None,
                                                **extra})

    def latency(name: str, key: tuple, values: list[float], o: Outcome) -> Figure:
        return Figure(SECTION, name, "ms", _p50_ms(values), higher_is_better=False, key=key,
                      params={**common, "count": len(values), "hit_rate": o.hit_tokens / o.query_tokens
                              if o.query_tokens else None})

    figures = {}
    for on in ("on", "off"):
        o = outcomes[on]
        figures[SECTION, on, "ttft_first"] = latency(f"prefix {on}: TTFT p50 first turns",
                                                     (SECTION, on, "ttft_first"), o.ttft_first, o)
        if o.ttft_follow:
            figures[SECTION, on, "ttft_follow"] = latency(f"prefix {on}: TTFT p50 follow-ups",
                                                          (SECTION, on, "ttft_follow"), o.ttft_follow, o)
        figures[SECTION, on, "throughput"] = throughput(f"prefix {on}: output", (SECTION, on, "throughput"), o)
    for what, label in (("ttft_first", "first turns"), ("ttft_follow", "follow-ups")):
        if (SECTION, "on", what) in figures:
            ratio = figures[SECTION, "off", what].value / figures[SECTION, "on", what].value
            figures[SECTION, "speedup", what] = Figure(SECTION, f"prefix: TTFT p50 {label}, on vs off", "x", ratio,
                                                       key=(SECTION, "speedup", what), params=common)
    for on in ("on", "off"):
        runs = sorted(fresh[on], key=lambda o: o.output_tokens / o.seconds)
        figures[SECTION, "no-hits", on] = throughput(f"no hits {on}: output", (SECTION, "no-hits", on),
                                                     runs[len(runs) // 2],
                                                     repeat_tok_s=[o.output_tokens / o.seconds for o in fresh[on]])
    on_rate, off_rate = figures[SECTION, "no-hits", "on"].value, figures[SECTION, "no-hits", "off"].value
    figures[SECTION, "no-hits", "cost"] = Figure(
        SECTION, "no hits: caching's throughput cost", "%", 100 * (off_rate - on_rate) / off_rate,
        higher_is_better=False, key=(SECTION, "no-hits", "cost"), params=common,
        note=f"the medians of {REPEATS} runs each way: compare with the spread of their repeat_tok_s in the JSON")
    return [figures[key] for _, _, key in _names(w)]
