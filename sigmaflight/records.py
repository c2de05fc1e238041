"""The records every side of a rollout shares: its state, its error and its result.

One form each, imported by the REST wire models (sigmaflight/wire.py), the job manager
(control/jobs/), the result store (dataplane/) and the Ray workers, so a status, an error word or
a result means the same thing wherever it is read. The standard library only: the data plane and
the GPU run import it where pydantic is absent; the wire models validate these dataclasses as
fields (pydantic reads `__pydantic_config__`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Literal, get_args

__all__ = [
    "ERROR_TYPES", "STATES", "STREAM_ENDS", "TERMINAL", "TRANSITIONS", "ErrorInfo", "InvalidTransition", "ResultInfo",
    "ROLLOUT_ID", "RestStatus", "RolloutState", "error_type",
]

ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""Every rollout id a server gives and takes (`fullmatch`): the store checks the ids it is handed,
Flight actions and the client tell an id from a ticket by it."""


class RolloutState(StrEnum):
    """A rollout's state. The first six, in lifecycle order, are the contract's statuses (REST
    `status`); RELEASED and CLOSED are how the data plane ends a stream whose result was released
    (REST then says expired for a succeeded one, keeps failed or cancelled otherwise) or whose
    store closed (the process stops): Flight error types, never a REST status."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    RELEASED = "released"
    CLOSED = "closed"

    @property
    def active(self) -> bool:
        """Queued or running: it may still change by itself."""
        return self in (RolloutState.QUEUED, RolloutState.RUNNING)

    @property
    def finished(self) -> bool:
        """Succeeded, failed or cancelled: it holds (or held) a result until it expires."""
        return self in (RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.CANCELLED)


RestStatus = Literal[
    RolloutState.QUEUED, RolloutState.RUNNING, RolloutState.SUCCEEDED, RolloutState.FAILED,
    RolloutState.CANCELLED, RolloutState.EXPIRED,
]
"""The wire's `status` field: a RolloutState, and only one of the contract's six (its JSON
schema lists their strings inline)."""
STATES: tuple[RolloutState, ...] = get_args(RestStatus)
"""Every status a rollout can have on REST, in lifecycle order."""
TERMINAL = frozenset(STATES[2:])
STREAM_ENDS: tuple[RolloutState, ...] = (
    RolloutState.FAILED, RolloutState.CANCELLED, RolloutState.RELEASED, RolloutState.EXPIRED, RolloutState.CLOSED,
)
"""How a stream that did not succeed ends (the Flight error type its consumers get)."""

TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    # cancelled while queued; failed: shutdown, journal unwritable, or a stale policy at the start
    RolloutState.QUEUED: frozenset({RolloutState.RUNNING, RolloutState.FAILED, RolloutState.CANCELLED}),
    RolloutState.RUNNING: frozenset({RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.CANCELLED}),
    # released or past its TTL; failed "result_unavailable" when the store loses its trajectory
    RolloutState.SUCCEEDED: frozenset({RolloutState.EXPIRED, RolloutState.FAILED}),
    RolloutState.FAILED: frozenset({RolloutState.EXPIRED}),
    RolloutState.CANCELLED: frozenset({RolloutState.EXPIRED}),
    RolloutState.EXPIRED: frozenset(),
}
"""Which REST status may follow which; anything else is a bug (`InvalidTransition`)."""


class InvalidTransition(RuntimeError):
    """A change of state the table does not allow."""

    def __init__(self, rollout_id: str, old: RolloutState, new: RolloutState) -> None:
        super().__init__(f"rollout {rollout_id}: {old} -> {new} is not a transition of a rollout")
        self.old, self.new = old, new


ERROR_TYPES = frozenset({
    "internal_error",       # anything unexpected; the message names the exception's class
    "shutdown",             # the server stopped while the rollout was queued or running
    "server_restarted",     # the process died while it was queued or running (the restart scan)
    "journal_unavailable",  # its running state could not be written to the job journal
    "result_unavailable",   # the store lost or could not keep its trajectory
    "stale_policy",         # the model's weights changed between POST and the start
    "weights_failed",       # an in-place weights push failed closed before it started
    "non_finite",           # a latent or log-prob became NaN or infinite
    "validation_error",     # a field found invalid only when it ran (a branch's parent unreadable)
    "worker_died",          # the Ray worker running it died (crash, OOM, node lost)
})
"""The contract's words for a failed rollout's `error.type` (docs/control.md, docs/operations.md)."""


def error_type(word: str | None) -> str:
    """`word` when it is one of ERROR_TYPES, else "internal_error"."""
    return word if word in ERROR_TYPES else "internal_error"


@dataclass(frozen=True, kw_only=True)
class ErrorInfo:
    """Why a rollout failed: the contract's `error` object."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid"}  # as a field of the wire models

    type: str
    message: str


@dataclass(frozen=True, kw_only=True)
class ResultInfo:
    """What a succeeded rollout holds: the contract's `result` object."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid"}

    num_rows: int
    num_bytes: int
    steps: list[int]
    """The absolute step indices held, in order (a list, as the wire has always given it)."""

    def to_json(self) -> dict[str, Any]:
        return {"num_rows": self.num_rows, "num_bytes": self.num_bytes, "steps": list(self.steps)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResultInfo:
        return cls(num_rows=int(data["num_rows"]), num_bytes=int(data["num_bytes"]),
                   steps=[int(s) for s in data["steps"]])
