"""What the job manager asks of a backend, and the small context a backend runs a rollout with.

Two backends implement `Backend`: the local one (control/backends/local.py: the pipeline and
this process's result store) and the Ray one (control/backends/ray.py: worker actors with their
own stores). The manager hands a backend `RunContext`s, never its own mutable `Job`: a context
carries the rollout's id and spec, tells it to stop, and is settled once with the rollout's
`Outcome`, as soon as that is known. Progress is reported for a whole model call at once
(`report_progress`: one call of the manager's progress hook a step, not one per rollout).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import torch
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.tickets import Gone
from sigmaflight.pipeline.spec import RolloutCancelled, RolloutInputError, RolloutSpec

from sigmaflight.records import ERROR_TYPES, ErrorInfo, ResultInfo, RolloutState, error_type

__all__ = ["Backend", "CallSize", "Outcome", "ParentTrajectory", "Progress", "RunContext", "outcome_of", "report_progress"]


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """How one rollout ended: succeeded (with its result), failed (with why) or cancelled."""

    state: RolloutState
    result: ResultInfo | None = None
    error: ErrorInfo | None = None

    def __post_init__(self) -> None:
        if self.state not in (RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.CANCELLED):
            raise ValueError(f"an outcome is succeeded, failed or cancelled, not {self.state}")
        if (self.state is RolloutState.SUCCEEDED) != (self.result is not None):
            raise ValueError("a succeeded outcome, and only that, carries a result")
        if (self.state is RolloutState.FAILED) != (self.error is not None):
            raise ValueError("a failed outcome, and only that, carries an error")
        if self.error is not None and self.error.type not in ERROR_TYPES:
            raise ValueError(f"error type {self.error.type!r} is not one of the contract's words (ERROR_TYPES)")

    @classmethod
    def success(cls, result: ResultInfo) -> Outcome:
        return cls(state=RolloutState.SUCCEEDED, result=result)

    @classmethod
    def failure(cls, type_: str, message: str) -> Outcome:
        return cls(state=RolloutState.FAILED, error=ErrorInfo(type=type_, message=message))

    @classmethod
    def cancel(cls) -> Outcome:
        return cls(state=RolloutState.CANCELLED)

    @property
    def kind(self) -> RolloutState:
        """How the data plane ends the streams of a rollout that did not succeed."""
        return RolloutState.CANCELLED if self.state is RolloutState.CANCELLED else RolloutState.FAILED

    @property
    def message(self) -> str:
        return self.error.message if self.error is not None else "cancelled by client"


def outcome_of(exc: BaseException, stop_reason: str | None) -> Outcome:
    """The outcome of a rollout that raised `exc`. A stop asked with a reason (shutdown) is a
    failure "shutdown" with that reason, a stop without one (the client's) a cancel; any other
    error fails with its `error_type` when that is one of the contract's words (RolloutNonFinite
    "non_finite", StalePolicy "stale_policy", ...), "validation_error" for a request found invalid
    only when it ran, and "internal_error" otherwise, the message then naming the exception's class."""
    if stop_reason is not None:
        return Outcome.failure("shutdown", stop_reason)
    if isinstance(exc, RolloutCancelled):
        return Outcome.cancel()
    word = "validation_error" if isinstance(exc, RolloutInputError) else error_type(getattr(exc, "error_type", None))
    message = str(exc) or repr(exc)
    if word == "internal_error":
        message = f"{type(exc).__name__}: {message}"
    return Outcome.failure(word, message)


Progress = Callable[[Sequence["RunContext"], int, int], None]
"""A progress hook: `done` of `total` steps finished by each of these rollouts (one model call)."""

CallSize = tuple[int, int]
"""A model call's (samples, members): the `batch` metadata's `samples` and `requests`."""


def report_progress(batch: Sequence[RunContext], done: int, total: int) -> None:
    """`done` of `total` steps finished by every rollout of `batch`: one call of each distinct hook
    (the manager's is one for all its contexts) with the contexts that share it."""
    hooks: dict[Progress, list[RunContext]] = {}
    for ctx in batch:
        if ctx.on_progress is not None:
            hooks.setdefault(ctx.on_progress, []).append(ctx)
    for hook, contexts in hooks.items():
        hook(contexts, done, total)


class RunContext:
    """One rollout as a backend runs it: id, spec, progress, stop, and its outcome (settled once).

    The job manager's record of a rollout (`Job`, control/jobs/job.py) is one: the queue's record
    is what the backend gets. The Ray worker makes plain ones for the rollouts it runs. `settle`
    is called by whoever learns the outcome first (the backend, or the manager for a backend that
    returned without settling); later calls are ignored. `on_settle(context, outcome)` and
    `on_progress` are the owner's hooks, set before the run."""

    on_progress: Progress | None = None
    on_settle: Callable[[RunContext, Outcome], None] | None = None

    def __init__(
        self,
        job_id: str,
        spec: RolloutSpec,
        *,
        on_progress: Progress | None = None,
        on_settle: Callable[[RunContext, Outcome], None] | None = None,
    ) -> None:
        self._job_id, self._spec = job_id, spec
        self.on_progress, self.on_settle = on_progress, on_settle
        self._init_run()

    def _init_run(self) -> None:
        """The run's own state: not stopped, no outcome (a subclass's constructor calls this)."""
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._lock = threading.Lock()
        self._outcome: Outcome | None = None
        self._finishing = False
        """Past the engine's last stop check (or settled): a stop can no longer take effect."""

    @property
    def job_id(self) -> str:
        return self._job_id

    @property
    def spec(self) -> RolloutSpec:
        return self._spec

    def __repr__(self) -> str:
        return f"RunContext({self.job_id!r}, outcome={self._outcome})"

    def progress(self, done: int, total: int) -> None:
        """`done` of `total` denoising steps finished (of this rollout alone: `report_progress`)."""
        if self.on_progress is not None:
            self.on_progress([self], done, total)

    def stop(self, reason: str | None = None) -> bool:
        """Ask the rollout to stop at its next step: cancelled (no reason) or failed with `reason`.
        False (nothing asked) once it is past the engine's last stop check or has ended: it ends as
        it was going to, so an answer of "cancelled" would be wrong."""
        with self._lock:
            if self._finishing or self._outcome is not None:
                return False
            if reason is not None or not self._stop.is_set():
                self._stop_reason = reason
            self._stop.set()
            return True

    def should_stop(self) -> bool:
        return self._stop.is_set()

    def last_stop_check(self) -> bool:
        """The engine's check after the last step: True stops it; False, and from now on `stop`
        refuses (the rollout finishes)."""
        with self._lock:
            self._finishing = not self._stop.is_set()
            return not self._finishing

    @property
    def stop_reason(self) -> str | None:
        """Why it was stopped when the stop is a failure (e.g. "server shutting down"); None for a
        client's cancel or when not stopped."""
        return self._stop_reason

    def settle(self, outcome: Outcome) -> bool:
        """Record how the rollout ended; True the first time, False (nothing changes) after."""
        with self._lock:
            if self._outcome is not None:
                return False
            self._outcome = outcome
        if self.on_settle is not None:
            self.on_settle(self, outcome)
        return True

    def settle_error(self, exc: BaseException) -> bool:
        """`settle(outcome_of(exc, self.stop_reason))`."""
        return self.settle(outcome_of(exc, self.stop_reason))

    @property
    def outcome(self) -> Outcome | None:
        return self._outcome


@dataclass(frozen=True)
class ParentTrajectory:
    """A succeeded rollout's trajectory, as a branch reads it: header, batches and, when it
    published one and it is still held, its "conditioning/v1" table."""

    header: TrajectoryHeader
    batches: list[pa.RecordBatch]
    conditioning: pa.Table | None


class Backend(Protocol):
    """Runs rollouts and holds their results for Flight: everything the manager and the
    service ask of the local and the Ray backend."""

    def reserve(self, job_id: str) -> str:
        """Place a rollout before it runs and return its Flight ticket (consumers may wait on it)."""
        ...

    def run(self, batch: Sequence[RunContext]) -> CallSize | None:
        """Run the rollouts of `batch` (one batch key, one group) as one model call, to their ends,
        settling each context as soon as its outcome is known. A context left unsettled when this
        returns (or raises) is failed by the manager. Returns the call's size, as its members'
        `batch` metadata says it (members refused before it ran take no rows); None when no model
        call ran."""
        ...

    def group(self, job_id: str) -> Hashable:
        """Where a reserved rollout will run: rollouts share a batch only within one group (the
        local backend has one; with Ray, the worker the rollout was placed on)."""
        ...

    def abandon(self, job_id: str, kind: str, message: str) -> None:
        """End a reserved rollout that never ran (cancelled while queued, shutdown)."""
        ...

    def release(self, job_id: str, *, aside: bool = False) -> None:
        """Drop a finished rollout's result and delete its files (`aside`: rename its durable files
        `.orphan` instead, the restart scan's way with a trajectory no journal row names)."""
        ...

    def result_info(self, job_id: str) -> ResultInfo | None:
        """The result of a finished, valid trajectory held here; None if none is held."""
        ...

    def stored_ids(self) -> list[str]:
        """Every rollout whose trajectory is held here (the restart scan frees those the journal
        has no row for)."""
        ...

    def locations_for(self, job_id: str) -> list[str]:
        """Flight URIs where the rollout's streams are served."""
        ...

    def can_place(self) -> bool:
        """Whether a rollout could be placed now (with Ray: a live worker; /readyz says so)."""
        ...

    def parent(self, rollout_id: str) -> ParentTrajectory | None:
        """A succeeded rollout's trajectory for a branch; None when none is held here. Raises
        RolloutInputError ("branch_from.rollout") when it is held but cannot be read now."""
        ...

    def load_weights(self, model_id: str, state: Mapping[str, torch.Tensor], *, expected_base: str | None = None,
                     expected_digest: str | None = None) -> list[str]:
        """Make every worker of this backend run on new transformer weights (checked by the caller
        in the service's registry), on all or on none; the digests the workers now have (none for
        the local backend, whose registry is the service's). `expected_base`: the base digest each
        worker must serve now; `expected_digest`: the digest each must end with (the service's)."""
        ...

    def load_lora(self, model_id: str, tensors: Mapping[str, torch.Tensor], lora_config: dict[str, Any]) -> list[str]:
        """The same for a LoRA adapter (replacing any)."""
        ...

    def unload_lora(self, model_id: str) -> list[str]:
        """The same for removing the adapter."""
        ...

    def set_tokens(self, tokens: Sequence[str]) -> None:
        """The bearer tokens every Flight server of this backend accepts from now on."""
        ...

    def on_result_lost(self, callback: Callable[[str, str], None]) -> None:
        """Call `callback(rollout_id, reason)` when a held trajectory is found lost (file truncated or
        corrupted), so REST stops saying succeeded."""
        ...

    def on_result_released(self, callback: Callable[[str], None]) -> None:
        """Call `callback(rollout_id)` when a finished trajectory is released where the control plane
        did not ask for it (a Flight `release` at a Ray worker), so REST and the metrics follow."""
        ...

    def on_unknown_ticket(self, callback: Callable[[str], Gone | None]) -> None:
        """Ask `callback(ticket_or_id)` how a rollout ended when the Flight plane no longer knows
        its ticket (ended before a restart, or forgotten), so Flight names the reason REST gives."""
        ...

    def close(self) -> None:
        """Stop the backend's workers and servers (finished results on disk stay)."""
        ...
