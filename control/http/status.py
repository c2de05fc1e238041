"""The status document of a rollout (`GET /v1/rollouts/{id}`, the list, the 202 ticket's `flight`).

Clients poll a status many times between its changes (every 20 ms each, in the co-batching
benchmark): `StatusBodies` renders it once per published snapshot.
"""

from __future__ import annotations

from typing import Any

from sigmaflight.control.jobs import JobView, iso
from sigmaflight.control.service import Service
from sigmaflight.control.streams import stream_tickets
from starlette.responses import JSONResponse

from sigmaflight.records import RolloutState
from sigmaflight.wire import FlightTicket, Progress, RolloutStatus


def flight_ticket(service: Service, job: JobView, locations: list[str] | None = None) -> FlightTicket:
    """The status's `flight` object; `locations`: the backend's for this job, when asked already."""
    streams = stream_tickets(job.ticket, job.id, list(job.streams))
    locations = service.backend.locations_for(job.id) if locations is None else locations
    return FlightTicket(
        ticket=job.ticket, locations=locations, descriptor_path=["rollouts", job.id],
        streams=streams,  # type: ignore[arg-type]
    )


def status_of(service: Service, job: JobView, locations: list[str] | None = None) -> RolloutStatus:
    return RolloutStatus(
        id=job.id,
        status=job.status,
        model=job.model,
        progress=Progress(steps_done=job.steps_done, steps_total=job.steps_total),
        created_at=iso(job.created_at) or "",
        started_at=iso(job.started_at),
        finished_at=iso(job.finished_at),
        error=job.error,
        result=job.result if job.status == "succeeded" else None,
        flight=flight_ticket(service, job, locations),
    )


class StatusBodies:
    """The rendered status documents of one app's service (`body`), at most `limit`
    (past it the cache starts over)."""

    def __init__(self, service: Service, limit: int = 4096) -> None:
        self.service, self.limit = service, limit
        self._bodies: dict[str, tuple[JobView, list[str], dict[str, Any], bytes]] = {}

    def body(self, job: JobView) -> bytes:
        """The status document of `job` as JSON bytes, rendered once per snapshot: clients poll a
        rollout's status many times between its changes, and the table publishes a new `JobView`
        object on every change, so the same object with the same Flight locations is the same
        body. While it has no error and no result (queued, running: a new snapshot every step),
        only the fields that change are put into the document `RolloutStatus` dumps, its `flight`
        kept."""
        service = self.service
        locations = service.backend.locations_for(job.id)
        hit = self._bodies.get(job.id)
        if hit is not None and hit[1] == locations:
            if hit[0] is job:
                return hit[3]
            flight = hit[2]
        else:
            flight = flight_ticket(service, job, locations).model_dump(mode="json", by_alias=True)
        if job.error is None and job.result is None:
            doc = {"id": job.id, "status": RolloutState(job.status).value, "model": job.model,
                   "progress": {"steps_done": job.steps_done, "steps_total": job.steps_total},
                   "created_at": iso(job.created_at) or "", "started_at": iso(job.started_at),
                   "finished_at": iso(job.finished_at), "error": None, "result": None, "flight": flight}
        else:
            doc = status_of(service, job, locations).model_dump(mode="json", by_alias=True)
        body = bytes(JSONResponse(doc).body)
        if len(self._bodies) >= self.limit:
            self._bodies.clear()
        self._bodies[job.id] = (job, locations, flight, body)
        return body
