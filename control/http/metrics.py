"""/metrics: the service's counters and gauges, exposed with prometheus-client.

Each Service gets its own CollectorRegistry (never prometheus-client's global REGISTRY, so two
services in one process, as in the tests, do not share or clash) holding the process collector
(process_cpu_seconds_total, process_resident_memory_bytes, ...) and one custom collector that
reads the service's state at scrape time. The names are those docs/control.md lists.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sigmaflight.control.jobs import STATES

if TYPE_CHECKING:
    from sigmaflight.control.service import Service

__all__ = ["CONTENT_TYPE", "ServiceCollector", "registry_for", "render"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The exposition format's content type, as prometheus-client writes it."""


class ServiceCollector(Collector):
    """Reads the job queue, the result store, the Flight server and the HTTP counts on each scrape."""

    def __init__(self, service: Service, http_counts: Counter[str]) -> None:
        self._service = weakref.ref(service)
        self._http_counts = http_counts

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
                                       "since start.", labels=["status"])
        for s in STATES[2:]:
            finished.add_metric([s], jobs.counters.get(f"rollouts_{s}", 0))
        yield finished
        yield CounterMetricFamily("sigmaflight_steps", "Denoising steps completed since start (rate() gives "
                                  "steps/s).", value=jobs.counters.get("steps", 0))
        yield CounterMetricFamily("sigmaflight_flight_bytes_served", "Bytes of record batches streamed over "
                                  "Flight.", value=service.flight.bytes_served)
        yield GaugeMetricFamily("sigmaflight_flight_streams", "Flight do_get streams open now.",
                                value=service.flight.active_streams)
        store_bytes = GaugeMetricFamily("sigmaflight_store_bytes", "Trajectory bytes held by the result store.",
                                        labels=["where"])
        store_bytes.add_metric(["memory"], store["bytes_in_memory"])
        store_bytes.add_metric(["disk"], store["bytes_on_disk"])
        yield store_bytes
        yield GaugeMetricFamily("sigmaflight_store_entries", "Trajectories in the result store.",
                                value=store["entries"])
        http = CounterMetricFamily("sigmaflight_http_responses", "HTTP responses by method and status code.",
                                   labels=["method", "code"])
        for key, n in sorted(self._http_counts.items()):
            method, code = key.split(",")
            http.add_metric([method, code], float(n))
        yield http


_REGISTRIES: weakref.WeakKeyDictionary[Service, CollectorRegistry] = weakref.WeakKeyDictionary()


def registry_for(service: Service, http_counts: Counter[str]) -> CollectorRegistry:
    """The service's own registry (made on first use): the process collector and a ServiceCollector."""
    registry = _REGISTRIES.get(service)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=registry)
        registry.register(ServiceCollector(service, http_counts))
        _REGISTRIES[service] = registry
    return registry


def render(service: Service, http_counts: Counter[str]) -> str:
    """The exposition text (serve it with CONTENT_TYPE)."""
    return generate_latest(registry_for(service, http_counts)).decode("utf-8")
