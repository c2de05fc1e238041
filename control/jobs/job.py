"""One rollout as the job manager holds it (`Job`), the snapshot readers get (`JobView`), and the
refusals a submit can meet.

Every change of a job goes through `Job.move`, which checks the transition table
(sigmaflight/records.py), and is published as a new frozen `JobView`. Readers (REST status and
list, /metrics) take the latest view without a lock and never see a half-made change (a
"failed" status without its error, say).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sigmaflight.control.jobs.backend import RunContext
from sigmaflight.pipeline.spec import RolloutSpec

from sigmaflight.records import TRANSITIONS, ErrorInfo, InvalidTransition, ResultInfo, RolloutState

TRAJECTORY = "trajectory"
"""The stream every rollout has (sigmaflight.dataplane.streams.TRAJECTORY)."""


class QueueFull(Exception):
    """The queue holds `queue_size` waiting rollouts already."""


class IdempotencyConflict(Exception):
    """An Idempotency-Key was reused with a different body."""


class NotAccepting(Exception):
    """The manager is shutting down."""


class Unavailable(Exception):
    """The server cannot take the rollout now (REST 503); `type` says why, `message` in words."""

    type = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class JournalUnavailable(Unavailable):
    """The job journal cannot be written (full or read-only disk): nothing was accepted."""

    type = "journal_unavailable"


class PlacementFailed(Unavailable):
    """The backend could not place the rollout (no live worker, a worker call timed out)."""

    type = "no_workers"


class NotFinished(Exception):
    """A release asked of a rollout that is still queued or running (cancel it first)."""

    def __init__(self, job_id: str, status: str) -> None:
        super().__init__(f"rollout {job_id} is {status}; cancel it first")
        self.status = status


@dataclass(frozen=True, kw_only=True)
class JobView:
    """One rollout as readers see it: a consistent, immutable snapshot."""

    id: str
    model: str
    status: RolloutState
    steps_done: int
    steps_total: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: ErrorInfo | None
    result: ResultInfo | None
    ticket: str
    streams: tuple[str, ...]
    """The streams it publishes ("trajectory" first), fixed at submit time."""


@dataclass(eq=False, kw_only=True)
class Job(RunContext):
    """The manager's record of one rollout: mutable, changed only under the table's lock and
    only through `move`; readers get `view()` snapshots. It is also what its backend runs (a
    `RunContext`: stop, progress and the outcome), so one record goes from the queue to the engine."""

    id: str
    model: str
    request: RolloutSpec | None
    """The spec as submitted; None for a job restored from the journal (it never runs again)."""
    spec_json: dict[str, Any] | None
    """The spec as the journal keeps it; None once an ended job let go of it (`forget_request`)."""
    streams: tuple[str, ...]
    steps_total: int
    created_at: float
    state: RolloutState = RolloutState.QUEUED
    steps_done: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    error: ErrorInfo | None = None
    result: ResultInfo | None = None
    idempotency_key: str | None = None
    body_digest: str | None = None
    ticket: str = ""
    """Opaque Flight ticket, issued by the backend at submit time and kept for the job's life."""
    batch_key: Hashable | None = None
    """What it must share with the rollouts it runs with (pipeline/batch.py); None: it runs alone."""
    unjournaled: bool = False
    """Its latest state could not be written to the journal; retried until it is."""
    finished_here: bool = False
    """It ended in this process (counted in rollouts_finished_total), not before a restart."""
    released: bool = False
    """What it held was freed (DELETE, Flight release or the TTL). A succeeded job is then expired;
    a failed or cancelled one keeps its status and error, and the reaper does not free it again."""
    release_on_end: bool = False
    """A release came while it ran (a DELETE whose cancel may come too late, a Flight release once
    its trajectory was whole): if it succeeds, it is released as it ends."""

    def __post_init__(self) -> None:
        self._init_run()

    @property
    def job_id(self) -> str:
        return self.id

    @property
    def spec(self) -> RolloutSpec:
        """The spec of a job that runs (never one restored from the journal)."""
        assert self.request is not None, f"job {self.id} was restored from the journal and never runs"
        return self.request

    def forget_request(self) -> None:
        """An ended job that no worker holds lets go of its request: the prompts (up to
        --max-prompts x --max-prompt-chars a record) stay in its journal row and its trajectory's
        metadata, not in memory for each of --max-records ended rollouts."""
        assert not self.state.active, f"job {self.id} is {self.state}"
        self.request = None
        self.spec_json = None

    @property
    def samples(self) -> int:
        return self.request.num_samples if self.request is not None else 1

    def move(self, new: RolloutState, *, error: ErrorInfo | None = None, result: ResultInfo | None = None,
             keep_time: bool = False) -> None:
        """The one way a job changes state (InvalidTransition for a change the table forbids)."""
        if new not in TRANSITIONS[self.state]:
            raise InvalidTransition(self.id, self.state, new)
        self.state, self.error, self.result = new, error, result
        if new is RolloutState.RUNNING:
            self.started_at = time.time()
        elif not keep_time or self.finished_at is None:
            self.finished_at = time.time()

    def view(self) -> JobView:
        return JobView(
            id=self.id, model=self.model, status=self.state, steps_done=self.steps_done,
            steps_total=self.steps_total, created_at=self.created_at, started_at=self.started_at,
            finished_at=self.finished_at, error=self.error, result=self.result, ticket=self.ticket,
            streams=self.streams,
        )

    def to_record(self) -> dict[str, Any]:
        """Its journal row (journal.py)."""
        return {
            "id": self.id,
            "model": self.model,
            "spec": self.spec_json,
            "streams": list(self.streams),
            "steps_total": self.steps_total,
            "steps_done": self.steps_done,
            "created_at": self.created_at,
            "status": str(self.state),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": [self.error.type, self.error.message] if self.error else None,
            "result": self.result.to_json() if self.result else None,
            "idempotency_key": self.idempotency_key,
            "body_digest": self.body_digest,
            "ticket": self.ticket,
            "released": self.released,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Job:
        return cls(
            id=rec["id"],
            model=rec["model"],
            request=None,
            spec_json=rec["spec"],
            streams=tuple(rec["streams"]),
            steps_total=rec["steps_total"],
            steps_done=rec["steps_done"],
            created_at=rec["created_at"],
            state=RolloutState(rec["status"]),
            started_at=rec["started_at"],
            finished_at=rec["finished_at"],
            error=ErrorInfo(type=rec["error"][0], message=rec["error"][1]) if rec["error"] else None,
            result=ResultInfo.from_json(rec["result"]) if rec["result"] else None,
            idempotency_key=rec["idempotency_key"],
            body_digest=rec["body_digest"],
            ticket=rec["ticket"],
            released=bool(rec.get("released", False)),  # rows written before it was kept: not known, not released
        )


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")
