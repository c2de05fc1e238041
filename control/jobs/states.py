"""A rollout's states, the transitions between them, and the snapshot readers get.

The job manager (manager.py) is the only writer: every change of a job goes through
`Job.move`, which checks this table, and is published as a new frozen `JobView`. Readers
(REST status and list, /metrics) take the latest view without a lock and never see a
half-made change (a "failed" status without its error, say).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sigmaflight.wire import STATES


class JobState(StrEnum):
    """The contract's statuses (`sigmaflight.wire.STATES`, the same strings, in lifecycle order)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def active(self) -> bool:
        """Queued or running: it may still change by itself."""
        return self in (JobState.QUEUED, JobState.RUNNING)

    @property
    def finished(self) -> bool:
        """Succeeded, failed or cancelled: it holds (or held) a result until it expires."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


assert tuple(JobState) == STATES, "JobState must list the wire's statuses in the same order"

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # cancelled while queued; failed: shutdown, journal unwritable, or a stale policy at the start
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    # released or past its TTL; failed "result_unavailable" when the store loses its trajectory
    JobState.SUCCEEDED: frozenset({JobState.EXPIRED, JobState.FAILED}),
    JobState.FAILED: frozenset({JobState.EXPIRED}),
    JobState.CANCELLED: frozenset({JobState.EXPIRED}),
    JobState.EXPIRED: frozenset(),
}
"""Which state may follow which; anything else is a bug (`InvalidTransition`)."""


class InvalidTransition(RuntimeError):
    """A change of state the table does not allow."""

    def __init__(self, job_id: str, old: JobState, new: JobState) -> None:
        super().__init__(f"rollout {job_id}: {old} -> {new} is not a transition of a rollout")
        self.old, self.new = old, new


@dataclass(frozen=True, kw_only=True)
class ResultInfo:
    """What a succeeded rollout holds: the contract's `result` object."""

    num_rows: int
    num_bytes: int
    steps: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"num_rows": self.num_rows, "num_bytes": self.num_bytes, "steps": list(self.steps)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResultInfo:
        return cls(num_rows=int(data["num_rows"]), num_bytes=int(data["num_bytes"]),
                   steps=tuple(int(s) for s in data["steps"]))


@dataclass(frozen=True, kw_only=True)
class ErrorInfo:
    """Why a rollout failed: the contract's `error` object ({"type", "message"})."""

    type: str
    message: str


@dataclass(frozen=True, kw_only=True)
class JobView:
    """One rollout as readers see it: a consistent, immutable snapshot."""

    id: str
    model: str
    status: JobState
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
