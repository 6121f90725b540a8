"""Prometheus metrics: requests, timings, batch shapes, queue depth, rejections, models.

Durations are in seconds under `_seconds` names; counters end in `_total`. Each of TEI's
metrics has one counterpart here, so a TEI dashboard maps onto them one to one (the table
is in docs/architecture.md, "Metrics")."""

from __future__ import annotations

import functools
import os
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ember.engine import BatchRecord, RequestRecord
from ember.engine.stats import GAP_CAUSES, GAP_FLOOR_S, IdleGap
from ember.registry import LoadedModel, Registry

SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10,
                   30, 60)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
INPUT_TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)  # a large model's minutes


PendingSource = Callable[[], Mapping[str, int]]
DispatchSource = Callable[[], Mapping[str, Mapping[str, Any]]]  # policy.describe() by model


@runtime_checkable
class ReportedDepths(Protocol):
    """Models whose workers run in another process (the engine process, or Ray's engine
    replicas): their queue depths as last reported, brought up to date before a scrape."""

    def pending(self) -> Mapping[str, int]: ...

    def running(self) -> Mapping[str, int]: ...

    def dispatches(self) -> Mapping[str, Mapping[str, Any]]: ...

    async def refresh(self) -> None: ...


@functools.lru_cache(maxsize=4096)
def labelled(metric: Counter | Histogram, *values: str) -> Any:
    """`metric.labels(*values)`, kept: `labels` checks and locks on every call, and the
    request path asks for the same few label sets (routes, models, statuses) over and
    over."""
    return metric.labels(*values)


class _PendingCollector(Collector):
    """Queue depth and the forward's size of each loaded model, read at scrape time."""

    def __init__(self, pending: Callable[[], PendingSource],
                 running: Callable[[], PendingSource],
                 dispatch: Callable[[], DispatchSource]) -> None:
        self.pending = pending
        self.running = running
        self.dispatch = dispatch

    def collect(self) -> Iterator[Metric]:
        items = GaugeMetricFamily("ember_pending_items", "Items queued, not yet dispatched",
                                  labels=["model"])
        running = GaugeMetricFamily("ember_running_items", "Items in the forward on the "
                                    "device now", labels=["model"])
        loaded = GaugeMetricFamily("ember_model_loaded", "1 when the model is in memory",
                                   labels=["model"])
        in_forward = self.running()()
        for name, count in self.pending()().items():
            items.add_metric([name], count)
            running.add_metric([name], in_forward.get(name, 0))
            loaded.add_metric([name], 1)
        yield items
        yield running
        yield loaded
        yield from dispatch_metrics(self.dispatch()())


def dispatch_metrics(models: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """Each model's learned cost per forward and the dispatch windows in use, per LoRA
    ("" for the base model); the cost is absent until a few forwards have run."""
    fixed = GaugeMetricFamily("ember_dispatch_fixed_cost_seconds", "Learned fixed part of "
                              "a forward's time", labels=["model", "lora"])
    per_token = GaugeMetricFamily("ember_dispatch_token_cost_seconds", "Learned time per "
                                  "padded token of a forward", labels=["model", "lora"])
    window = GaugeMetricFamily("ember_dispatch_window_seconds", "Dispatch window in use "
                               "(max_batch_wait, idle_coalesce)",
                               labels=["model", "lora", "window"])
    padding = GaugeMetricFamily("ember_dispatch_max_padding", "Padded tokens a batch may "
                                "hold per real token (0: no bound)", labels=["model", "lora"])
    tokens = GaugeMetricFamily("ember_dispatch_max_batch_tokens", "Padded tokens a forward "
                               "may hold", labels=["model", "lora"])
    learned = GaugeMetricFamily("ember_dispatch_learned", "1 when a window in use comes "
                                "from the learned cost", labels=["model", "lora"])
    for name, described in models.items():
        parts = {"": described, **described.get("loras", {})}
        for lora, part in parts.items():
            windows, cost = part["windows"], part["cost"]
            window.add_metric([name, lora, "max_batch_wait"], windows["max_batch_wait_ms"] / 1e3)
            window.add_metric([name, lora, "idle_coalesce"], windows["idle_coalesce_ms"] / 1e3)
            padding.add_metric([name, lora], windows["max_padding"])
            tokens.add_metric([name, lora], windows["max_batch_tokens"])
            learned.add_metric([name, lora], float(windows["learned"]))
            if cost is not None:
                fixed.add_metric([name, lora], cost["fixed_ms"] / 1e3)
            if cost is not None and cost["per_token_us"] is not None:  # None: unmeasured
                per_token.add_metric([name, lora], cost["per_token_us"] / 1e6)
    yield from (fixed, per_token, window, padding, tokens, learned)


class Metrics:
    """The server's metrics. With several processes (prometheus-client's multiprocess mode,
    PROMETHEUS_MULTIPROC_DIR set before the import), each process writes its own figures
    and a scrape adds them up; the queue depths come live from the engine."""

    def __init__(self, process: bool = False) -> None:
        """`process`: the standard process_* series too (memory, CPU, open files), where
        this process is the whole server (not an API process or a Ray ingress replica,
        whose own figures would pass for the server's)."""
        self.registry = CollectorRegistry()
        self.pending: PendingSource = dict
        self.running: PendingSource = dict
        self.dispatch: DispatchSource = dict
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        if not self.multiprocess:
            self.registry.register(self._live())
        if process and not self.multiprocess:
            ProcessCollector(registry=self.registry)
        reg = self.registry
        self.requests = Counter("ember_requests", "HTTP requests by route, model and status, "
                                "refusals included", ["route", "model", "status"],
                                registry=reg)
        self.request_seconds = Histogram("ember_request_duration_seconds", "End-to-end "
                                         "request duration, from the first byte read to "
                                         "the response's last byte sent", ["route"],
                                         buckets=SECONDS_BUCKETS, registry=reg)
        self.input_tokens = Histogram("ember_request_input_tokens", "Input tokens (after "
                                      "truncation) per request; _sum counts them all",
                                      ["route", "model"], buckets=INPUT_TOKEN_BUCKETS,
                                      registry=reg)
        # Per submit: a request's, or each side's of a score whose query and documents
        # take different prompts (they are submitted apart).
        self.queue_seconds = Histogram("ember_queue_duration_seconds", "Submit to first "
                                       "dispatch, per submit to the model's worker",
                                       ["model"], buckets=SECONDS_BUCKETS, registry=reg)
        self.inference_seconds = Histogram("ember_inference_duration_seconds", "Forward time, "
                                           "per submit to the model's worker", ["model"],
                                           buckets=SECONDS_BUCKETS, registry=reg)
        self.batch_seconds = Histogram("ember_batch_inference_duration_seconds", "Duration "
                                       "of one forward", ["model"], buckets=SECONDS_BUCKETS,
                                       registry=reg)
        self.batch_items = Histogram("ember_batch_items", "Items per forward", ["model"],
                                     buckets=SIZE_BUCKETS, registry=reg)
        self.batch_tokens = Histogram("ember_batch_tokens", "Input tokens per forward, "
                                      "before padding", ["model"], buckets=TOKEN_BUCKETS,
                                      registry=reg)
        self.batch_padded_tokens = Histogram("ember_batch_padded_tokens", "Padded tokens per "
                                             "forward (items x longest)", ["model"],
                                             buckets=TOKEN_BUCKETS, registry=reg)
        self.batch_requests = Histogram("ember_batch_requests", "Submits per forward",
                                        ["model"], buckets=SIZE_BUCKETS, registry=reg)
        self.forward_failures = Counter("ember_forward_failures", "Forwards that raised",
                                        ["model"], registry=reg)
        self.dropped_items = Counter("ember_dropped_items", "Queued items dropped before a "
                                     "forward (caller gone or request failed)", ["model"],
                                     registry=reg)
        self.idle_gap_seconds = Counter("ember_device_idle_gap_seconds", "Seconds a model's "
                                        "device was idle while its work waited, by cause: "
                                        "hold, formation, wakeup", ["model", "cause"],
                                        registry=reg)
        self.idle_gap_count = Counter("ember_device_idle_gaps", "Idle gaps (of at "
                                      "least 0.1 ms) before a forward, by cause",
                                      ["model", "cause"], registry=reg)
        self.rejections = Counter("ember_rejections", "Requests the server turned "
                                  "away or its client left before the answer (a key, a "
                                  "Host, a size, a full queue, a drain, a timeout), by "
                                  "reason; invalid input is counted by status only",
                                  ["reason"], registry=reg)
        self.loads = Counter("ember_model_loads", "Model loads", ["model"], registry=reg)
        self.load_seconds = Histogram("ember_model_load_duration_seconds", "Time to load a "
                                      "model", ["model"], buckets=LOAD_BUCKETS, registry=reg)
        self.load_failures = Counter("ember_model_load_failures", "Model loads that failed "
                                     "(its requests get 502 model_load_failed)", ["model"],
                                     registry=reg)
        self.evictions = Counter("ember_model_evictions", "Models evicted", ["model"],
                                 registry=reg)
        # Beyond one a role (--workers: each API process its own), a process that died and
        # was replaced: a dead process's figures stay in the sums of a multiprocess scrape.
        self.process_starts = Counter("ember_process_starts", "Processes of this server "
                                      "started, by role: server (one process), api or "
                                      "engine", ["role"], registry=reg)

    def attach(self, registry: Registry) -> None:
        """Record what the registry's workers do (in the process that runs them)."""
        registry.on_worker.append(self._watch_worker)
        registry.on_load.append(self._loaded)
        registry.on_evict.append(lambda name: self.evictions.labels(name).inc())
        registry.on_load_failure.append(lambda name: self.load_failures.labels(name).inc())
        self.dispatch = lambda: {name: m.worker.policy.describe()
                                 for name, m in registry.loaded.items()}
        self.pending = lambda: {name: m.worker.pending_items
                                for name, m in registry.loaded.items()}
        self.running = lambda: {name: m.worker.running_items
                                for name, m in registry.loaded.items()}

    def report(self, depths: ReportedDepths) -> None:
        """Read the live gauges from models whose workers run in another process."""
        self.pending, self.running = depths.pending, depths.running
        self.dispatch = depths.dispatches

    def exposition(self) -> CollectorRegistry:
        """What a scrape reports: this process's metrics, or every process's."""
        if not self.multiprocess:
            return self.registry
        combined = CollectorRegistry()
        MultiProcessCollector(combined)  # type: ignore[no-untyped-call]
        combined.register(self._live())
        return combined

    def _live(self) -> _PendingCollector:
        """The gauges read at scrape time, from whichever sources are set by then."""
        return _PendingCollector(lambda: self.pending, lambda: self.running,
                                 lambda: self.dispatch)

    def rejected(self, reason: str) -> None:
        labelled(self.rejections, reason).inc()

    def _loaded(self, model: LoadedModel) -> None:
        self.loads.labels(model.spec.name).inc()
        self.load_seconds.labels(model.spec.name).observe(model.load_seconds)

    def _watch_worker(self, model: LoadedModel) -> None:
        name = model.spec.name
        items, padded = self.batch_items.labels(name), self.batch_padded_tokens.labels(name)
        tokens, forward = self.batch_tokens.labels(name), self.batch_seconds.labels(name)
        requests, failures = self.batch_requests.labels(name), self.forward_failures.labels(name)
        queue, inference = self.queue_seconds.labels(name), self.inference_seconds.labels(name)
        dropped = self.dropped_items.labels(name)

        def on_batch(record: BatchRecord) -> None:
            items.observe(record.items)
            tokens.observe(record.real_tokens)
            padded.observe(record.padded_tokens)
            forward.observe(record.duration_ms / 1e3)
            requests.observe(record.requests)
            if record.failed:
                failures.inc()

        def on_requests(records: Sequence[RequestRecord]) -> None:
            observe_all(queue, [r.queue_ms / 1e3 for r in records])
            # A request that left before any forward took its items had no inference.
            observe_all(inference, [r.inference_ms / 1e3 for r in records
                                    if r.inference_ms or not r.cancelled])

        gap_seconds = {c: self.idle_gap_seconds.labels(name, c) for c in GAP_CAUSES}
        gap_count = {c: self.idle_gap_count.labels(name, c) for c in GAP_CAUSES}

        def on_gap(gap: IdleGap) -> None:
            for cause, seconds in gap.by_cause().items():
                if seconds > 0:  # each write costs a lock and a file write in --workers mode
                    gap_seconds[cause].inc(seconds)
                if seconds >= GAP_FLOOR_S:
                    gap_count[cause].inc()

        stats = model.worker.stats
        stats.batch_listeners.append(on_batch)
        stats.gap_listeners.append(on_gap)
        stats.request_listeners.append(on_requests)
        stats.drop_listeners.append(dropped.inc)


def observe_all(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe` for each of `values`, with one write per bucket they touch: in
    the multiprocess mode every write takes a lock and writes a file map, and the engine
    observes two values for every request it answers. (prometheus_client has no call for
    many values; tests/test_metrics.py checks this one against `observe`.)"""
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    total = getattr(histogram, "_sum", None)
    if buckets is None or bounds is None or total is None or len(values) < 2:
        for value in values:
            histogram.observe(value)
        return
    for index, count in Tally(bisect_left(bounds, value) for value in values).items():
        buckets[index].inc(count)
    total.inc(sum(values))
