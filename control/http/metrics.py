"""/metrics: the service's counters and gauges, exposed with prometheus-client.

Each app gets its own `ServiceMetrics`: a CollectorRegistry (never prometheus-client's global
REGISTRY, so two services in one process, as in the tests, do not share or clash) holding the
process collector (process_cpu_seconds_total, process_resident_memory_bytes, ...), the metrics
counted as things happen (HTTP responses, a labelled Counter the request-id middleware counts
into), and one custom collector that reads the service's state at scrape time. The names are
those docs/control.md lists.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sigmaflight.control.jobs import STATES

if TYPE_CHECKING:
    from sigmaflight.control.service import Service

__all__ = ["CONTENT_TYPE", "ServiceCollector", "ServiceMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The exposition format's content type, as prometheus-client writes it."""


class ServiceMetrics:
    """The app's metrics registry: the process collector, the counted metrics, and the service's
    state at scrape time once `bind` has been given the service."""

    def __init__(self) -> None:
        disable_created_metrics()  # no `_created` series beside each counter (process-wide, idempotent)
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        self.http_responses = PromCounter(
            "sigmaflight_http_responses", "HTTP responses by method and status code.", ["method", "code"],
            registry=self.registry,
        )

        self.held_reads = Gauge(
            "sigmaflight_held_reads", "Status reads held now until their rollout ends (GET /v1/rollouts/{id}?wait_s=).",
            registry=self.registry,
        )
        self.batch_samples = Histogram(
            "sigmaflight_batch_samples", "Samples per co-batched model call.", registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, float("inf")),
        )
        self.batch_requests = Histogram(
            "sigmaflight_batch_requests", "Rollouts per co-batched model call.", registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, float("inf")),
        )

    def observe_batch(self, samples: int, requests: int) -> None:
        self.batch_samples.observe(samples)
        self.batch_requests.observe(requests)

    def bind(self, service: Service) -> None:
        """Read `service`'s queue, store and Flight server at each scrape from now on, and count
        its batches."""
        self.registry.register(ServiceCollector(service))
        service.jobs.on_batch = self.observe_batch

    def render(self) -> str:
        """The exposition text (serve it with CONTENT_TYPE)."""
        return generate_latest(self.registry).decode("utf-8")


class ServiceCollector(Collector):
    """Reads the job queue, the result store and the Flight server on each scrape."""

    def __init__(self, service: Service) -> None:
        self._service = weakref.ref(service)

    def collect(self) -> Iterator[Metric]:
        service = self._service()
        if service is None:
            return
        jobs = service.jobs
        counts = jobs.status_counts()
        store = service.store.stats()

        yield GaugeMetricFamily("sigmaflight_queue_depth", "Rollouts waiting in the queue.",
                                value=jobs.queue_depth())
        rollouts = GaugeMetricFamily("sigmaflight_rollouts", "Rollouts known to the server, by status.",
                                     labels=["status"])
        for s in STATES:
            rollouts.add_metric([s], counts.get(s, 0))
        yield rollouts
        finished = CounterMetricFamily("sigmaflight_rollouts_finished", "Rollouts that reached a final status "
                                       "since start; expired counts succeeded ones released later (each counted "
                                       "as succeeded too), so finished rollouts are succeeded+failed+cancelled.",
                                       labels=["status"])
        for s in STATES[2:]:
            finished.add_metric([s], jobs.counters.get(f"rollouts_{s}", 0))
        yield finished
        yield CounterMetricFamily("sigmaflight_steps", "Denoising steps completed since start (rate() gives "
                                  "steps/s).", value=jobs.counters.get("steps", 0))
        yield CounterMetricFamily("sigmaflight_flight_bytes_served", "Bytes of record batches streamed over "
                                  "Flight (a finished rollout's table once it was all written and its call not cancelled).",
                                  value=service.flight.bytes_served)
        yield GaugeMetricFamily("sigmaflight_flight_streams", "Flight do_get streams open now.",
                                value=service.flight.active_streams)
        store_bytes = GaugeMetricFamily("sigmaflight_store_bytes", "Trajectory bytes held by the result store.",
                                        labels=["where"])
        store_bytes.add_metric(["memory"], store["bytes_in_memory"])
        store_bytes.add_metric(["disk"], store["bytes_on_disk"])
        yield store_bytes
        yield GaugeMetricFamily("sigmaflight_store_entries", "Trajectories in the result store.",
                                value=store["entries"])
        yield from _weights_metrics(service)


def _weights_metrics(service: Service) -> Iterator[Metric]:
    """Streamed weights pushes (Flight do_put, dataplane/weights.py)."""
    pushes = service.weights_pushes
    with pushes._lock:
        pushed, seconds, commits, failures = (pushes.pushed_bytes, pushes.push_seconds, pushes.commits,
                                              dict(pushes.failures))
    yield CounterMetricFamily("sigmaflight_weights_pushed_bytes", "Tensor bytes received by streamed weights "
                              "pushes (every chunk that landed, committed or not).", value=pushed)
    yield CounterMetricFamily("sigmaflight_weights_skipped_bytes", "Tensor bytes committed pushes did not send "
                              "(unchanged, or kept by a partial push).", value=service.weights_sink.skipped_bytes)
    yield CounterMetricFamily("sigmaflight_weights_push_seconds", "Seconds from start to commit, summed over "
                              "committed pushes.", value=seconds)
    yield CounterMetricFamily("sigmaflight_weights_commits", "Streamed weights pushes committed.", value=commits)
    failed = CounterMetricFamily("sigmaflight_weights_push_failures", "Streamed weights pushes refused or "
                                 "ended early, by reason.", labels=["reason"])
    for reason, n in sorted(failures.items()):
        failed.add_metric([reason], n)
    yield failed
    yield GaugeMetricFamily("sigmaflight_weights_staged_bytes", "Bytes held in staging by pushes under way.",
                            value=pushes.staged_bytes())
    yield GaugeMetricFamily("sigmaflight_weights_pushes_open", "Streamed weights pushes under way (or cut and "
                            "waiting for a resume).", value=pushes.active())
