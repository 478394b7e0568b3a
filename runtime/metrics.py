"""Serving metrics with the names vLLM users already chart, computed here once for every front end:
the OpenAI-compatible server exports them with `prometheus_client` on its /metrics, the Triton
model through Triton's custom-metrics API on its metrics port. Each front end hands over an
`Exporter` (set a gauge, add to a counter, observe a histogram) and reports its requests'
outputs; what the values are and when they change is decided here.

  kiln:num_requests_running, kiln:num_requests_waiting   gauges, the scheduler's queues
  kiln:kv_cache_usage_perc                                gauge, used / total KV blocks (0..1)
  kiln:prefix_cache_queries, kiln:prefix_cache_hits       counters, prompt tokens looked up in the
                                                          prefix cache and found there
  kiln:prompt_tokens, kiln:generation_tokens              counters (exposed with `_total`)
  kiln:time_to_first_token_seconds                        histogram, submission to first token
  kiln:inter_token_latency_seconds                        histogram, between a request's outputs
                                                          that bring new tokens
  kiln:e2e_request_latency_seconds                        histogram, submission to the end of a
                                                          request that completed (not cancelled)
Every metric carries the label model_name.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from kiln.runtime.outputs import RequestOutput

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"


@dataclass(frozen=True)
class MetricSpec:
    name: str  # a counter's base name: Prometheus exposes it with `_total`
    kind: str
    description: str
    buckets: tuple[float, ...] = ()


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)

RUNNING = MetricSpec("kiln:num_requests_running", GAUGE, "Requests in the running batch")
WAITING = MetricSpec("kiln:num_requests_waiting", GAUGE, "Requests waiting to be scheduled")
KV_USAGE = MetricSpec("kiln:kv_cache_usage_perc", GAUGE, "Share of the KV-cache blocks in use (1 is all)")
PREFIX_QUERIES = MetricSpec("kiln:prefix_cache_queries", COUNTER, "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = MetricSpec("kiln:prefix_cache_hits", COUNTER, "Prompt tokens found in the prefix cache")
PROMPT_TOKENS = MetricSpec("kiln:prompt_tokens", COUNTER, "Prompt tokens of the requests that got a first token")
GENERATION_TOKENS = MetricSpec("kiln:generation_tokens", COUNTER, "Tokens generated")
TTFT = MetricSpec("kiln:time_to_first_token_seconds", HISTOGRAM, "Seconds from a request's submission to its "
                  "first token", _LATENCY_BUCKETS)
ITL = MetricSpec("kiln:inter_token_latency_seconds", HISTOGRAM, "Seconds between a request's outputs that bring "
                 "new tokens", _STEP_BUCKETS)
E2E = MetricSpec("kiln:e2e_request_latency_seconds", HISTOGRAM, "Seconds from a request's submission to its end "
                 "(completed requests)", _REQUEST_BUCKETS)
METRICS = (RUNNING, WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS, PROMPT_TOKENS, GENERATION_TOKENS, TTFT, ITL, E2E)

# Counters whose totals the Session keeps (Session.stats key); the others are counted here.
_SESSION_COUNTERS = {PREFIX_QUERIES: "prefix_cache_queries", PREFIX_HITS: "prefix_cache_hits"}


class Exporter(Protocol):
    """Where a front end publishes the values: one method per kind of metric, by spec name."""

    def set(self, spec: MetricSpec, value: float) -> None: ...

    def increment(self, spec: MetricSpec, amount: float) -> None: ...

    def observe(self, spec: MetricSpec, value: float) -> None: ...


class ServingMetrics:
    """The metrics of one Session's front end. `publish` reads the Session's state into the
    gauges and Session-kept counters (call it before each scrape, or every so often);
    `request` starts tracking one request. Safe to use from any thread."""

    def __init__(self, exporter: Exporter, stats: Callable[[], dict]):
        self.exporter = exporter
        self._stats = stats
        self._lock = threading.Lock()
        self._published = {spec: 0 for spec in _SESSION_COUNTERS}

    def publish(self) -> None:
        with self._lock:  # two publishers must not both add the same counter delta
            stats = self._stats()
            self.exporter.set(RUNNING, stats["running"])
            self.exporter.set(WAITING, stats["waiting"])
            self.exporter.set(KV_USAGE, stats["kv_blocks_used"] / stats["kv_blocks_total"])
            for spec, key in _SESSION_COUNTERS.items():
                total = stats[key]
                if total > self._published[spec]:
                    self.exporter.increment(spec, total - self._published[spec])
                    self._published[spec] = total

    def request(self) -> "RequestMetrics":
        """A tracker for a request submitted now."""
        return RequestMetrics(self.exporter)


class RequestMetrics:
    """Times one request from its submission: `update` with each of its outputs, `end` when the
    front end is done with it."""

    def __init__(self, exporter: Exporter):
        self.exporter = exporter
        self.submitted = time.monotonic()
        self.last_token: float | None = None
        self.generated = 0
        self.ended = False

    def update(self, out: RequestOutput) -> None:
        now = time.monotonic()
        generated = sum(len(c.token_ids) for c in out.outputs)
        if generated <= self.generated:
            return
        if self.last_token is None:
            self.exporter.observe(TTFT, now - self.submitted)
            self.exporter.increment(PROMPT_TOKENS, len(out.prompt_token_ids))
        else:
            self.exporter.observe(ITL, now - self.last_token)
        self.exporter.increment(GENERATION_TOKENS, generated - self.generated)
        self.generated, self.last_token = generated, now

    def end(self, completed: bool) -> None:
        """The request is over: `completed` when it ran to its end (not cancelled, not failed)."""
        if not self.ended and completed:
            self.exporter.observe(E2E, time.monotonic() - self.submitted)
        self.ended = True
