"""The Triton Python-backend model that serves a Kiln engine; `triton-repo` copies this file to
`<repo>/<model>/1/model.py`, and it runs inside Triton's Python stub, not in Kiln's own process.

One `Session` per model instance serves every request, so all concurrent requests are batched
in flight. `execute` parses each request, hands it to a thread of its own and returns at once;
that thread streams the Session's outputs back and always ends the request with the final flag,
after an error or a cancellation too. A watcher thread turns client cancellations into
`Session.cancel` and keeps the KV-cache gauges on Triton's metrics endpoint current; a counter
there tells how requests ended (stop, length, cancelled, error). The serving metrics that the
OpenAI server exports too (kiln:..., runtime/metrics.py) are published there through
`_TritonExporter`.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import triton_python_backend_utils as pb_utils

try:
    from kiln.runtime.arguments import ArgumentError
    from kiln.runtime.metrics import COUNTER, GAUGE, HISTOGRAM, METRICS, MetricSpec, ServingMetrics
    from kiln.runtime.scheduler import POLICIES
    from kiln.runtime.session import Session
    from kiln.runtime.triton import protocol
except ImportError as e:
    raise ImportError(f"{e}. The model runs Kiln in the Python that Triton's stub finds first on PATH: start the "
                      "server with serve-triton, or put Kiln's virtual environment's bin/ first on PATH") from e

CANCEL_POLL_S = 0.1  # how soon a client that went away frees its KV blocks
METRICS_EVERY_S = 0.25
SHUTDOWN_WAIT_S = 5.0
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Gauge label -> Session.stats key.
KV_GAUGES = {"used": "kv_blocks_used", "total": "kv_blocks_total", "peak": "kv_blocks_peak"}
REQUEST_GAUGES = {"running": "running", "waiting": "waiting"}
OUTCOMES = ("stop", "length", "cancelled", "error")


@dataclass(eq=False)
class _InFlight:
    request: object
    sender: object
    job: protocol.Job
    thread: threading.Thread | None = None
    request_id: str | None = None  # the Session's id, known once the first output arrives
    cancelled: bool = False
    # Held by the watcher while it asks the sender whether the client cancelled: the sender's
    # response factory is freed once the final response is sent, and asking then crashes the
    # server, so `_serve` sets `ending` under it first. (request.is_cancelled() is no better: the
    # backend releases the request itself when `execute` returns.)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ending: bool = False


class _TritonExporter:
    """The serving metrics (runtime/metrics.py) as Triton custom metrics, each labelled with the
    model's name. A counter's name carries `_total`, as Prometheus clients expose it, so both
    servers show the same samples."""

    def __init__(self, model_name: str, lock: threading.Lock):
        self.lock = lock
        kinds = {GAUGE: pb_utils.MetricFamily.GAUGE, COUNTER: pb_utils.MetricFamily.COUNTER,
                 HISTOGRAM: pb_utils.MetricFamily.HISTOGRAM}
        self.families, self.metrics = [], {}
        for spec in METRICS:
            family = pb_utils.MetricFamily(name=spec.name + ("_total" if spec.kind == COUNTER else ""),
                                           description=spec.description,
                                           kind=kinds[spec.kind])
            labels = {"model_name": model_name}
            self.metrics[spec] = (family.Metric(labels=labels, buckets=list(spec.buckets)) if spec.kind == HISTOGRAM
                                  else family.Metric(labels=labels))
            self.families.append(family)

    def set(self, spec: MetricSpec, value: float) -> None:
        with self.lock:
            self.metrics[spec].set(value)

    def increment(self, spec: MetricSpec, amount: float) -> None:
        with self.lock:
            self.metrics[spec].increment(amount)

    def observe(self, spec: MetricSpec, value: float) -> None:
        with self.lock:
            self.metrics[spec].observe(value)

    def close(self) -> None:
        # Metrics must go before their families (the backend refuses the other order).
        with self.lock:
            self.metrics.clear()
            self.families.clear()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_dir = Path(params["engine_dir"])
        max_kv_tokens = int(params["max_kv_tokens"]) if params.get("max_kv_tokens") else None
        fraction = float(params["kv_cache_fraction"]) if params.get("kv_cache_fraction") else None
        self.session = Session(engine_dir, kv_cache_fraction=fraction, max_kv_tokens=max_kv_tokens,
                               policy=params.get("policy", POLICIES[0]),
                               prefix_caching=params.get("prefix_caching", "true") == "true")
        self.tokenizer = self.session.tokenizer
        self.lock = threading.Lock()
        self.in_flight: set[_InFlight] = set()
        self._init_metrics(args["model_name"])
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="kiln-triton-watch", daemon=True)
        self.watcher.start()
        pb_utils.Logger.log_info(f"Kiln serves {engine_dir}; {self.session.kv_pool.describe()}")

    def _init_metrics(self, model_name: str) -> None:
        gauge = pb_utils.MetricFamily.GAUGE
        self.kv_family = pb_utils.MetricFamily(name="kiln_kv_cache_blocks", kind=gauge,
                                               description="KV-cache blocks of the Kiln Session's pool, by state")
        self.request_family = pb_utils.MetricFamily(name="kiln_requests", kind=gauge,
                                                    description="Requests in the Kiln Session's scheduler, by state")
        self.gauges = {key: family.Metric(labels={"model": model_name, "state": state})
                       for family, names in ((self.kv_family, KV_GAUGES), (self.request_family, REQUEST_GAUGES))
                       for state, key in names.items()}
        self.outcome_family = pb_utils.MetricFamily(name="kiln_requests_finished_total",
                                                    kind=pb_utils.MetricFamily.COUNTER,
                                                    description="Requests the Kiln model has ended, by reason")
        self.outcomes = {reason: self.outcome_family.Metric(labels={"model": model_name, "reason": reason})
                         for reason in OUTCOMES}
        # Every metric call goes through this lock: the backend's metric messages are not safe to
        # send from two threads at once (the server crashed), and an older stats reading must
        # never overwrite a newer one.
        self.metrics_lock = threading.Lock()
        self.exporter = _TritonExporter(model_name, self.metrics_lock)
        self.serving = ServingMetrics(self.exporter, lambda: self.session.stats)
        self._publish_metrics()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = protocol.parse_request(_inputs(request), self.tokenizer)
            except ValueError as e:
                self._count("error")
                sender.send(_error(request, str(e), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
                continue
            entry = _InFlight(request, sender, job)
            entry.thread = threading.Thread(target=self._serve, args=(entry,), name="kiln-triton-request", daemon=True)
            with self.lock:
                self.in_flight.add(entry)
            entry.thread.start()
        return None

    def _serve(self, entry: _InFlight) -> None:
        reply = protocol.Reply(entry.job)
        last, error, outcome = None, None, "cancelled"
        tracker = self.serving.request()
        try:
            outputs = self.session.stream(entry.job.prompt, entry.job.params, entry.job.prompt_token_ids)
            try:
                for out in outputs:
                    tracker.update(out)
                    # Set before reading `cancelled`; the watcher sets `cancelled` before reading this,
                    # so one of the two always sees the other and the Session request gets cancelled.
                    entry.request_id = out.request_id
                    if entry.cancelled:
                        break
                    tensors, done = reply.update(out)
                    if done:
                        # A stop sequence ends the request here while the Session still runs it.
                        last, outcome = tensors, out.outputs[0].finish_reason if out.finished else "stop"
                        break
                    if tensors is not None:
                        entry.sender.send(_response(tensors))
            finally:
                outputs.close()  # cancels the Session request if it still runs (stop sequence, client gone)
        except ArgumentError as e:  # refused by the Session's validation
            error = _error(entry.request, protocol.client_message(e, entry.job.text), pb_utils.TritonError.INVALID_ARG)
        except ValueError as e:
            error = _error(entry.request, str(e), pb_utils.TritonError.INVALID_ARG)
        except Exception as e:  # a failed engine step: this request ends, the model keeps serving
            error = _error(entry.request, f"Kiln could not finish this request: {e}", pb_utils.TritonError.INTERNAL)
        # Metrics first: once a client has every final response, the metrics show its blocks freed.
        tracker.end(error is None and outcome in ("stop", "length"))
        self._count("error" if error is not None else outcome)
        self._publish_metrics()
        with entry.lock:
            entry.ending = True
        with self.lock:
            self.in_flight.discard(entry)
        if error is not None:
            entry.sender.send(error, flags=FINAL)
        elif last is not None:
            entry.sender.send(_response(last), flags=FINAL)
        else:
            entry.sender.send(flags=FINAL)

    def _watch(self) -> None:
        next_metrics = time.monotonic() + METRICS_EVERY_S
        while not self.stopping.wait(CANCEL_POLL_S):
            with self.lock:
                entries = list(self.in_flight)
            for entry in entries:
                with entry.lock:
                    cancelled = not entry.ending and not entry.cancelled and entry.sender.is_cancelled()
                if cancelled:
                    entry.cancelled = True
                    if entry.request_id is not None:
                        self.session.cancel(entry.request_id)
            if time.monotonic() >= next_metrics:
                self._publish_metrics()
                next_metrics = time.monotonic() + METRICS_EVERY_S

    def _count(self, outcome: str) -> None:
        with self.metrics_lock:
            self.outcomes[outcome].increment(1)

    def _publish_metrics(self) -> None:
        with self.metrics_lock:
            stats = self.session.stats
            for key, gauge in self.gauges.items():
                gauge.set(stats[key])
        self.serving.publish()  # outside the lock: the exporter takes it per metric

    def finalize(self) -> None:
        self.stopping.set()
        with self.lock:
            threads = [self.watcher] + [entry.thread for entry in self.in_flight]
        self.session.close()  # requests still in flight end as cancelled and send their final responses
        # Bounded: while the stub is in finalize, calls into the backend from other threads may
        # never be answered, and an unload must not hang on them.
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        # Metrics must go before their families (the backend refuses the other order).
        with self.metrics_lock:
            self.gauges.clear()
            self.outcomes.clear()
            del self.kv_family, self.request_family, self.outcome_family
        self.exporter.close()
        pb_utils.Logger.log_info("Kiln session closed")


def _inputs(request) -> dict:
    found = {}
    for spec in protocol.INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            found[spec.name] = tensor.as_numpy()
    return found


def _response(tensors: dict):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, value) for name, value in tensors.items()])


def _error(request, message: str, code):
    # gRPC stream clients get errors without the request they belong to: name it, as Triton does.
    rid = request.request_id()
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"[request id: {rid}] {message}" if rid else message,
                                                                 code))
