"""Prometheus text exposition of the service's counters and gauges (format 0.0.4)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from control.jobs import STATES

if TYPE_CHECKING:
    from control.service import Service


def _line(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {value}"
    return f"{name} {value}"


def render(service: Service, http_counts: Counter[str]) -> str:
    jobs = service.jobs
    counts = jobs.status_counts()
    store = service.store.stats()
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str] | None, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(_line(name, v, labels) for labels, v in samples)

    metric("sigmaflight_queue_depth", "gauge", "Rollouts waiting in the queue.", [(None, jobs.queue_depth())])
    metric(
        "sigmaflight_rollouts",
        "gauge",
        "Rollouts known to the server, by status.",
        [({"status": s}, counts.get(s, 0)) for s in STATES],
    )
    metric(
        "sigmaflight_rollouts_finished_total",
        "counter",
        "Rollouts that reached a final status since start.",
        [({"status": s}, jobs.counters.get(f"rollouts_{s}", 0)) for s in STATES[2:]],
    )
    metric(
        "sigmaflight_steps_total",
        "counter",
        "Denoising steps completed since start (rate() gives steps/s).",
        [(None, jobs.counters.get("steps", 0))],
    )
    metric(
        "sigmaflight_flight_bytes_served_total",
        "counter",
        "Bytes of record batches streamed over Flight.",
        [(None, service.flight.bytes_served)],
    )
    metric("sigmaflight_flight_streams", "gauge", "Flight do_get streams open now.", [(None, service.flight.active_streams)])
    metric(
        "sigmaflight_store_bytes",
        "gauge",
        "Trajectory bytes held by the result store.",
        [({"where": "memory"}, store["bytes_in_memory"]), ({"where": "disk"}, store["bytes_on_disk"])],
    )
    metric("sigmaflight_store_entries", "gauge", "Trajectories in the result store.", [(None, store["entries"])])
    http: list[tuple[dict[str, str] | None, float]] = []
    for key, n in sorted(http_counts.items()):
        method, code = key.split(",")
        http.append(({"method": method, "code": code}, float(n)))
    metric("sigmaflight_http_responses_total", "counter", "HTTP responses by method and status code.", http)
    return "\n".join(out) + "\n"
