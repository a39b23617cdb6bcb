"""Prometheus metrics of one server (own registry, so several apps can live in one process: tests).

Exposed at `GET /metrics` in the text format. Names are prefixed `xstage_`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)
from prometheus_client.core import CounterMetricFamily

from xstage_dit.runtime.gc_pauses import GENERATIONS, GcPauses

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, float("inf"))
_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, float("inf"))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("xstage_queue_depth", "Jobs waiting to run.", registry=r)
        self.running_jobs = Gauge("xstage_running_jobs", "Jobs in the batch being computed.", registry=r)
        self.ranks_ready = Gauge("xstage_ranks_ready", "1 when every rank is up and serving.", registry=r)
        self.world_size = Gauge("xstage_world_size", "Ranks (processes) running the pipeline.", registry=r)
        self.requests = Counter("xstage_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "code"], registry=r)
        self.errors = Counter("xstage_errors", "Failed jobs and rejected requests by reason.",
                              ["reason"], registry=r)
        self.request_latency = Histogram("xstage_request_latency_seconds",
                                         "Submission to completion of finished jobs.", ["kind"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("xstage_queue_wait_seconds", "Time jobs spent waiting in the queue.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_latency = Histogram("xstage_batch_seconds", "Pipeline time of one batch.",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("xstage_step_seconds",
                                   "Time of one denoising step of a batch (from the second step on).",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("xstage_batch_size", "Items per pipeline call.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.batch_decisions = Counter("xstage_batch_decisions",
                                       "Batches taken from the queue by outcome: batched (several requests), fifo "
                                       "(compatible requests were waiting but the batcher ran one), single "
                                       "(nothing compatible waited).", ["outcome"], registry=r)
        self.batch_speedup = Gauge("xstage_batch_speedup",
                                   "Measured images/s of a batch over one image at a time, per size.", ["size"],
                                   registry=r)
        self.batch_identical = Gauge("xstage_batch_identical",
                                     "1 when a measured batch gave the same bytes as single runs, per size.",
                                     ["size"], registry=r)
        self.items = Counter("xstage_generated_items", "Images or videos generated.", ["kind"], registry=r)
        self.cache_computed = Counter("xstage_step_cache_computed", "Work the step cache computed, by method and "
                                      "unit (steps, attention calls).", ["method", "unit"], registry=r)
        self.cache_skipped = Counter("xstage_step_cache_skipped", "Work the step cache skipped (reused or "
                                     "predicted), by method and unit.", ["method", "unit"], registry=r)

    def count_step_cache(self, stats: dict | None) -> None:
        """A completed job's step-cache counts (`Job.cache_stats`; None: no step cache) into the counters."""
        if stats is not None:
            self.cache_computed.labels(stats["method"], stats["unit"]).inc(stats["computed"])
            self.cache_skipped.labels(stats["method"], stats["unit"]).inc(stats["skipped"])

    def watch_gc(self, pauses: GcPauses) -> None:
        """Expose `pauses`' running totals: xstage_gc_collections_total and xstage_gc_pause_seconds_total by
        generation (read at each scrape)."""
        self.registry.register(_GcCollector(pauses))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GcCollector:
    """The garbage collector's pauses as Prometheus counters, read from a `GcPauses` at scrape time."""

    def __init__(self, pauses: GcPauses):
        self.pauses = pauses

    def collect(self):
        collections = CounterMetricFamily("xstage_gc_collections", "Python garbage collections by generation "
                                          "(any thread).", labels=["generation"])
        seconds = CounterMetricFamily("xstage_gc_pause_seconds", "Time every Python thread stood still in garbage "
                                      "collections, by generation.", labels=["generation"])
        for g in GENERATIONS:
            collections.add_metric([str(g)], self.pauses.collections[g])
            seconds.add_metric([str(g)], self.pauses.seconds[g])
        return [collections, seconds]
