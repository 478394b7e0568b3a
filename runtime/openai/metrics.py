"""The serving metrics (runtime/metrics.py) in Prometheus' text format, for the server's /metrics.

Each server has a registry of its own, so two servers in one process (tests) do not share counts.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kiln.runtime.metrics import COUNTER, GAUGE, METRICS, MetricSpec

LABEL = "model_name"


class PrometheusExporter:
    """An `Exporter` over prometheus_client's metric types."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._metrics = {}
        for spec in METRICS:
            if spec.kind == GAUGE:
                family = Gauge(spec.name, spec.description, [LABEL], registry=self.registry)
            elif spec.kind == COUNTER:
                family = Counter(spec.name, spec.description, [LABEL], registry=self.registry)
            else:
                family = Histogram(spec.name, spec.description, [LABEL], buckets=spec.buckets, registry=self.registry)
            self._metrics[spec] = family.labels(model_name)

    def set(self, spec: MetricSpec, value: float) -> None:
        self._metrics[spec].set(value)

    def increment(self, spec: MetricSpec, amount: float) -> None:
        self._metrics[spec].inc(amount)

    def observe(self, spec: MetricSpec, value: float) -> None:
        self._metrics[spec].observe(value)

    def text(self) -> bytes:
        return generate_latest(self.registry)
