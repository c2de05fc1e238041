"""The job queue: rollouts wait in a bounded queue and run on worker threads.

A job moves through the states of control/jobs/states.py (queued -> running -> succeeded |
failed | cancelled, and a finished one becomes expired when its result's TTL passes or it is
released), each change checked against the transition table and published as an immutable
`JobView`. The manager owns statuses, idempotency keys, TTL and the durable journal; a
backend (local pipeline + result store, or remote workers) does the actual run, reached
through the `Backend` protocol with one `RunContext` per rollout (control/jobs/backend.py).
"""

from __future__ import annotations

import collections
import functools
import logging
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sigmaflight.control.jobs.backend import Backend, Outcome, RunContext
from sigmaflight.control.jobs.journal import Journal
from sigmaflight.control.jobs.states import (
    TRANSITIONS,
    ErrorInfo,
    InvalidTransition,
    JobState,
    JobView,
    ResultInfo,
)
from sigmaflight.dataplane.tickets import stream_ticket
from sigmaflight.pipeline.spec import RolloutSpec

log = logging.getLogger("sigmaflight.jobs")

TRAJECTORY = "trajectory"
"""The stream every rollout has (sigmaflight.dataplane.streams.TRAJECTORY; the journal's default)."""


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


@dataclass(eq=False, kw_only=True)
class Job:
    """The manager's record of one rollout: mutable, changed only under the manager's lock and
    only through `move`; readers get `view()` snapshots."""

    id: str
    model: str
    spec: RolloutSpec | None
    """None for a job restored from the journal (it never runs again)."""
    spec_json: dict[str, Any]
    streams: tuple[str, ...]
    steps_total: int
    created_at: float
    state: JobState = JobState.QUEUED
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
    run: RunContext | None = None
    """While running: the context its backend runs it with."""
    unjournaled: bool = False
    """Its latest state could not be written to the journal; retried until it is."""

    def move(self, new: JobState, *, error: ErrorInfo | None = None, result: ResultInfo | None = None,
             keep_time: bool = False) -> None:
        """The one way a job changes state (InvalidTransition for a change the table forbids)."""
        if new not in TRANSITIONS[self.state]:
            raise InvalidTransition(self.id, self.state, new)
        self.state, self.error, self.result = new, error, result
        if new is JobState.RUNNING:
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
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Job:
        streams = rec.get("streams")
        if streams is None:  # a journal of a version before "streams": its wire request's return flags
            ret = (rec.get("request") or {}).get("return") or {}
            streams = [TRAJECTORY] + [n for n in ("outputs", "conditioning") if ret.get(n)]
        return cls(
            id=rec["id"],
            model=rec["model"],
            spec=None,
            spec_json=rec.get("spec") or rec.get("request") or {},
            streams=tuple(streams),
            steps_total=rec["steps_total"],
            steps_done=rec["steps_done"],
            created_at=rec["created_at"],
            state=JobState(rec["status"]),
            started_at=rec["started_at"],
            finished_at=rec["finished_at"],
            error=ErrorInfo(type=rec["error"][0], message=rec["error"][1]) if rec["error"] else None,
            result=ResultInfo.from_json(rec["result"]) if rec["result"] else None,
            idempotency_key=rec["idempotency_key"],
            body_digest=rec["body_digest"],
            ticket=rec.get("ticket", ""),
        )


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


def recover_jobs(journal: Journal, backend: Backend) -> list[Job]:
    """The restart scan: every journaled job, with what a restart changed written back.

    A rollout that was running when the process died is failed ("server_restarted"), unless the
    backend holds its finished, valid trajectory: the process died between the file's rename
    into place and the journal's "succeeded" row (or that row could not be written), so it is a
    succeeded rollout. A queued one is failed too. A succeeded one whose trajectory the backend
    no longer holds is expired. A row that cannot be written back now is written later (the
    manager retries it)."""
    jobs = []
    for rec in journal.load():
        job = Job.from_record(rec)
        was = job.state
        result = backend.result_info(job.id) if was is JobState.RUNNING else None
        if result is not None:
            job.move(JobState.SUCCEEDED, result=result)
            job.steps_done = job.steps_total
            _put_later(journal, job)
            log.warning("rollout found finished after restart; marked succeeded", extra={"rollout": job.id, "was": was})
        elif was.active:
            job.move(JobState.FAILED, error=ErrorInfo(type="server_restarted",
                                                      message=f"server restarted while the rollout was {was}"))
            _put_later(journal, job)
            log.warning("rollout marked failed after restart", extra={"rollout": job.id, "was": was})
        elif was is JobState.SUCCEEDED and backend.result_info(job.id) is None:
            job.move(JobState.EXPIRED, keep_time=True)
            _put_later(journal, job)
            log.warning("finished rollout has no stored trajectory; marked expired", extra={"rollout": job.id})
        jobs.append(job)
    return jobs


def _put_later(journal: Journal, job: Job) -> None:
    try:
        journal.put(job.id, job.to_record())
    except sqlite3.Error:
        job.unjournaled = True  # the manager writes it once the journal can be written


BATCH_WAIT_ROUNDS = 8
"""A forming batch waits at most this many --batch-wait-ms in all, however long requests keep
joining it (each join restarts the wait for the next one)."""


@dataclass(eq=False)
class _Forming:
    """A batch a worker is gathering: its jobs (queued still), their key and placement group."""

    jobs: list[Job]
    key: Hashable | None
    group: Hashable

    def takes(self, job: Job, group: Hashable) -> bool:
        return self.key is not None and job.batch_key == self.key and group == self.group


def _samples(job: Job) -> int:
    return job.spec.num_samples if job.spec is not None else 1


def _tickets(view: JobView) -> set[str]:
    """The Flight tickets of a job: its rollout's, and each extra stream's it publishes."""
    return {view.ticket} | {stream_ticket(view.ticket, name) for name in view.streams if name != TRAJECTORY}


class JobManager:
    """Statuses, idempotency keys, the bounded queue, worker threads and the TTL reaper.

    Long for a reason: one re-entrant lock guards every job's state, and each public method is
    one transition of that state machine under it (submit, cancel, release, settle, the
    journal's failure and recovery, a lost result); spreading the transitions over several
    classes would spread the lock. Each change publishes the job's new `JobView`, which `get`
    and `list` hand out without taking the lock (a status read never waits on a journal fsync).
    The states and their table (states.py), the backend protocol (backend.py), the restart scan
    (`recover_jobs`) and the journal (journal.py) live outside."""

    def __init__(
        self,
        backend: Backend,
        *,
        workers: int = 1,
        queue_size: int = 64,
        ttl_s: float = 3600.0,
        data_dir: Path | None = None,
        keep_records: int = 10_000,
        max_batch_samples: int = 64,
        batch_wait_s: float = 0.0,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self._backend = backend
        self._max_batch_samples = max_batch_samples
        self._batch_wait_s = batch_wait_s
        self.on_batch = on_batch
        """Called with (samples, rollouts) of each batch as it starts (the /metrics histograms)."""
        self._workers_n = workers
        self._queue_size = queue_size
        self._ttl_s = ttl_s
        self._keep_records = keep_records
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        """Signalled when a job is queued and when the manager stops."""
        self._pending: collections.deque[Job] = collections.deque()
        """Queued jobs no worker has taken yet, oldest first."""
        self._forming: list[_Forming] = []
        """Batches a worker is gathering (with --batch-wait-ms): their jobs are queued still."""
        self._jobs: dict[str, Job] = {}
        self._views: dict[str, JobView] = {}
        """The latest published snapshot of each job (replaced whole, read without the lock)."""
        self._idem: dict[str, str] = {}
        self._threads: list[threading.Thread] = []
        self._accepting = True
        self._stopped = threading.Event()
        self._journal = Journal(data_dir / "jobs.sqlite3") if data_dir is not None else None
        self._journal_error: str | None = None
        """Why the last journal write failed; None while the journal is writable."""
        self._unjournaled_deletes: set[str] = set()
        self.counters: Counter[str] = Counter()  # rollouts finished by status, steps done
        self._recover()

    # ---- lifecycle --------------------------------------------------------------------------

    def _recover(self) -> None:
        if self._journal is None:
            return
        for job in recover_jobs(self._journal, self._backend):
            self._add(job)
            if job.unjournaled:
                self._journal_error = self._journal_error or "journal write failed during the restart scan"

    def start(self) -> None:
        for n in range(self._workers_n):
            t = threading.Thread(target=self._worker, name=f"sigmaflight-worker-{n}", daemon=True)
            t.start()
            self._threads.append(t)
        reaper = threading.Thread(target=self._reaper, name="sigmaflight-reaper", daemon=True)
        reaper.start()
        self._threads.append(reaper)

    def stop(self, reason: str = "server shutting down", timeout: float = 20.0) -> None:
        """Stop taking rollouts; end queued and running ones as failed with `reason`."""
        with self._lock:
            self._accepting = False
            for job in list(self._jobs.values()):
                if job.state is JobState.QUEUED:
                    self._end_queued(job, JobState.FAILED, ErrorInfo(type="shutdown", message=reason))
                elif job.run is not None:
                    job.run.stop(reason)
            self._stopped.set()
            self._work.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()

    # ---- API ----------------------------------------------------------------------------------

    def submit(
        self,
        spec: RolloutSpec,
        *,
        streams: tuple[str, ...] = (TRAJECTORY,),
        batch_key: Hashable | None = None,
        idempotency_key: str | None = None,
        body_digest: str | None = None,
    ) -> tuple[JobView, bool]:
        """Enqueue; returns (the job's view, created). A repeated Idempotency-Key returns the first job.

        `streams`: the streams the rollout publishes (control/streams.py `stream_names`), fixed now.
        `batch_key`: what it must share with rollouts it may run with (`pipeline.batch.batch_key`);
        None runs it alone.
        The backend places the rollout (`reserve`, a remote call with Ray) before anything is
        registered and outside the lock; the job is registered and journaled only once placed.
        Whatever fails leaves nothing behind: a placement failure raises PlacementFailed, a
        journal write failure JournalUnavailable (the reservation is undone), both 503s."""
        with self._lock:
            prior = self._admit(idempotency_key, body_digest)
        if prior is not None:
            return prior.view(), False
        job = Job(
            id=uuid.uuid4().hex,
            model=spec.model,
            spec=spec,
            spec_json=spec.to_json(),
            streams=tuple(streams),
            steps_total=spec.num_inference_steps,
            created_at=time.time(),
            idempotency_key=idempotency_key,
            body_digest=body_digest,
            batch_key=batch_key,
        )
        try:
            job.ticket = self._backend.reserve(job.id)
        except Exception as exc:
            log.warning("rollout not placed", extra={"rollout": job.id, "cause": f"{type(exc).__name__}: {exc}"})
            raise PlacementFailed(f"no worker could take the rollout now ({type(exc).__name__}: {exc}); "
                                  "retry later") from None
        try:
            with self._lock:
                prior = self._admit(idempotency_key, body_digest)  # the world may have moved meanwhile
                if prior is None:
                    error = self._write(job)
                    if error is not None:
                        raise JournalUnavailable(f"the job journal cannot be written ({error}); "
                                                 "nothing was accepted; retry later")
                    self._add(job)
                    self._pending.append(job)
                    self._work.notify_all()  # an idle worker, or one gathering a batch it may join
        except BaseException:
            self._undo_reserve(job.id, "not accepted")
            raise
        if prior is not None:
            self._undo_reserve(job.id, "a concurrent request with the same Idempotency-Key won")
            return prior.view(), False
        log.info(
            "rollout queued",
            extra={"rollout": job.id, "model": job.model, "samples": spec.num_samples, "steps": spec.num_inference_steps},
        )
        return job.view(), True

    def _admit(self, idempotency_key: str | None, body_digest: str | None) -> Job | None:
        """Under the lock: the prior job of a repeated key, or None if a new one may be queued
        (raises NotAccepting, IdempotencyConflict or QueueFull otherwise)."""
        if not self._accepting:
            raise NotAccepting("server shutting down")
        if idempotency_key is not None and idempotency_key in self._idem:
            prior = self._jobs.get(self._idem[idempotency_key])
            if prior is not None:
                if prior.body_digest != body_digest:
                    raise IdempotencyConflict(idempotency_key)
                return prior
        if self.queue_depth() >= self._queue_size:
            raise QueueFull(self._queue_size)
        return None

    def _add(self, job: Job) -> None:
        self._jobs[job.id] = job
        self._views[job.id] = job.view()
        if job.idempotency_key is not None:
            self._idem[job.idempotency_key] = job.id

    def _publish(self, job: Job) -> None:
        """Under the lock, after every change: readers now see the job as it is."""
        self._views[job.id] = job.view()

    def _undo_reserve(self, job_id: str, why: str) -> None:
        """Forget a reservation whose job was never registered (its ticket was never handed out)."""
        try:
            self._backend.abandon(job_id, "failed", why)
            self._backend.release(job_id)
        except Exception:
            log.exception("could not undo a reservation", extra={"rollout": job_id})

    def get(self, job_id: str) -> JobView | None:
        """The job's latest snapshot (no lock taken: it never waits on a journal write)."""
        return self._views.get(job_id)

    def list(self, status: str | None = None, limit: int = 100, ticket: str | None = None) -> list[JobView]:
        """Newest first, optionally of one status, optionally the one job whose Flight ticket is
        `ticket` or the ticket of one of the extra streams it publishes (`stream_ticket`), exactly:
        `<ticket>:<anything else>` is no ticket of it."""
        views = [v for v in list(self._views.values()) if (status is None or v.status == status)
                 and (ticket is None or (v.ticket != "" and ticket in _tickets(v)))]
        views.sort(key=lambda v: v.created_at, reverse=True)
        return views[:limit]

    def cancel(self, job_id: str) -> JobView | None:
        """REST DELETE: cancel a queued/running rollout, or release a finished one's result.

        A released succeeded rollout becomes expired; a failed or cancelled one keeps its
        status (and its error), only what it held is freed."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            if not self._cancel_active(job):
                self._release_finished(job)
            return job.view()

    def result_lost(self, job_id: str, reason: str) -> bool:
        """The store lost a succeeded rollout's trajectory (file truncated or corrupted): it becomes
        failed with error type "result_unavailable", so REST stops saying succeeded. False if the
        rollout is unknown or not succeeded (nothing changes)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state is not JobState.SUCCEEDED:
                return False
            self._change(job, JobState.FAILED, error=ErrorInfo(type="result_unavailable", message=reason),
                         keep_time=True)
            return True

    def cancel_active(self, job_id: str) -> bool:
        """Flight `cancel`: stop a queued or running rollout; False (nothing changed) otherwise."""
        with self._lock:
            job = self._jobs.get(job_id)
            return job is not None and self._cancel_active(job)

    def release(self, job_id: str) -> bool:
        """Flight `release`: free a finished rollout's result (as DELETE does); False if unknown
        or already expired. Raises NotFinished for a queued or running one: cancel it first."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state is JobState.EXPIRED:
                return False
            if job.state.active:
                raise NotFinished(job.id, job.state)
            self._release_finished(job)
            return True

    def _cancel_active(self, job: Job) -> bool:
        if job.state is JobState.QUEUED:
            self._end_queued(job, JobState.CANCELLED)
            return True
        if job.state is JobState.RUNNING:
            assert job.run is not None
            job.run.stop()
            return True
        return False

    def _end_queued(self, job: Job, state: JobState, error: ErrorInfo | None = None) -> None:
        """Under the lock: a queued job that never runs (cancelled, shutdown, journal unwritable)."""
        if job in self._pending:
            self._pending.remove(job)
        for forming in self._forming:
            if job in forming.jobs:
                forming.jobs.remove(job)
        self._change(job, state, error=error)
        self._backend.abandon(job.id, str(state), error.message if error else "cancelled by client")

    def _release_finished(self, job: Job) -> None:
        if job.state.finished:
            self._backend.release(job.id)
        if job.state is JobState.SUCCEEDED:
            self._change(job, JobState.EXPIRED, keep_time=True)

    def queue_depth(self) -> int:  # lock-free like get/list (a /metrics scrape never waits on a journal write)
        return len(self._pending) + sum(len(f.jobs) for f in list(self._forming))

    def status_counts(self) -> Counter[str]:
        return Counter(str(v.status) for v in list(self._views.values()))

    def journal_error(self) -> str | None:
        """Why the journal cannot be written now (readyz answers 503); None while it can."""
        return self._journal_error

    # ---- the journal ----------------------------------------------------------------------------

    def _write(self, job: Job) -> str | None:
        """Write the job's row; the error in words if the journal cannot be written."""
        if self._journal is None:
            return None
        try:
            self._journal.put(job.id, job.to_record())
        except sqlite3.Error as exc:
            self._journal_failed(exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    def _persist(self, job: Job) -> bool:
        """Write the job's row; on failure keep the state in memory, mark the row for a retry
        (the reaper writes it once the journal recovers) and return False. Never raises."""
        if self._write(job) is None:
            job.unjournaled = False
            return True
        job.unjournaled = True
        return False

    def _journal_failed(self, exc: BaseException) -> None:
        if self._journal_error is None:
            log.error("job journal cannot be written; /readyz answers 503 until it can",
                      extra={"cause": f"{type(exc).__name__}: {exc}"})
        self._journal_error = f"{type(exc).__name__}: {exc}"

    def retry_journal(self) -> bool:
        """Write every row that could not be written, then probe; True once the journal is
        writable again (or never failed)."""
        with self._lock:
            journal = self._journal
            if journal is None or self._journal_error is None:
                return True
            try:
                for job in self._jobs.values():
                    if job.unjournaled:
                        journal.put(job.id, job.to_record())
                        job.unjournaled = False
                for job_id in list(self._unjournaled_deletes):
                    journal.delete(job_id)
                    self._unjournaled_deletes.discard(job_id)
                journal.probe()
            except sqlite3.Error as exc:
                self._journal_error = f"{type(exc).__name__}: {exc}"
                return False
            self._journal_error = None
        log.info("job journal writable again")
        return True

    def _change(self, job: Job, state: JobState, *, error: ErrorInfo | None = None,
                result: ResultInfo | None = None, keep_time: bool = False) -> None:
        """Under the lock: move, count, journal, publish."""
        job.move(state, error=error, result=result, keep_time=keep_time)
        if not state.active:
            self.counters[f"rollouts_{state}"] += 1
        self._persist(job)
        self._publish(job)

    # ---- running -------------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:  # a worker thread never dies: it is the only one that runs rollouts
                self._run(batch)
            except Exception:
                log.exception("worker error outside a rollout", extra={"rollouts": [j.id for j in batch]})

    def _take(self) -> Sequence[Job] | None:
        """Wait for queued work; the jobs to run together, marked running (None once stopped).

        Batch formation: the oldest queued job no gathering batch could take heads the batch; every
        queued job with its batch key and placement group joins, oldest first, while the batch holds
        at most --max-batch-samples samples (`_gather`); with --batch-wait-ms W the worker waits up to
        W for the next compatible job while the batch is not full, W again after each one that joins
        (a burst of requests whose POSTs take longer than W in all still lands in one batch), and
        at most BATCH_WAIT_ROUNDS x W in all. So a job waits only for jobs older than it (and at
        most one batch of younger compatible ones that fit beside an older head): the age bound.
        A job whose running state the journal cannot record does not run: it fails at once."""
        with self._lock:
            while True:
                head = self._next_head()
                if head is None:
                    return None
                forming = _Forming([head], head.batch_key, self._backend.group(head.id))
                self._forming.append(forming)
                try:
                    self._gather(forming)
                    now = time.monotonic()
                    deadline = now + self._batch_wait_s
                    longest = now + BATCH_WAIT_ROUNDS * self._batch_wait_s
                    while (forming.jobs and not self._stopped.is_set() and self._room(forming) > 0
                           and (left := deadline - time.monotonic()) > 0):
                        self._work.wait(left)
                        had = len(forming.jobs)
                        self._gather(forming)
                        if len(forming.jobs) > had:  # requests are still arriving: wait for the next one
                            deadline = min(time.monotonic() + self._batch_wait_s, longest)
                finally:
                    self._forming.remove(forming)
                    self._work.notify_all()  # jobs left for this batch are anyone's again
                if self._stopped.is_set():
                    return None
                started = [job for job in forming.jobs if self._start_or_fail(job)]
                if started:
                    if self.on_batch is not None:
                        self.on_batch(sum(j.spec.num_samples for j in started if j.spec is not None), len(started))
                    return started

    def _next_head(self) -> Job | None:
        """Under the lock: the oldest pending job that no gathering batch may take (None once stopped)."""
        while True:
            if self._stopped.is_set():
                return None
            for job in self._pending:
                if not any(f.takes(job, self._backend.group(job.id)) and self._room(f) >= _samples(job)
                           for f in self._forming):
                    self._pending.remove(job)
                    return job
            self._work.wait()

    def _room(self, forming: _Forming) -> int:
        return self._max_batch_samples - sum(_samples(j) for j in forming.jobs)

    def _gather(self, forming: _Forming) -> None:
        """Under the lock: move every pending job that may join `forming` into it, oldest first."""
        if forming.key is None:
            return
        room = self._room(forming)
        for job in list(self._pending):
            if room <= 0:
                break
            if forming.takes(job, self._backend.group(job.id)) and _samples(job) <= room:
                self._pending.remove(job)
                forming.jobs.append(job)
                room -= _samples(job)

    def _start_or_fail(self, job: Job) -> bool:
        """Under the lock: start `job` (True), or fail it when the journal cannot record that (False)."""
        error = self._start(job)
        if error is None:
            return True
        message = f"the job journal cannot be written ({error})"
        self._change(job, JobState.FAILED, error=ErrorInfo(type="journal_unavailable", message=message))
        self._backend.abandon(job.id, "failed", message)
        log.error("rollout failed: journal unwritable", extra={"rollout": job.id})
        return False

    def _start(self, job: Job) -> str | None:
        """Under the lock: queued -> running, the running row journaled first (the error in words,
        and the job still queued, when the journal cannot record it)."""
        assert job.spec is not None
        if self._journal is not None:
            try:
                self._journal.put(job.id, {**job.to_record(), "status": str(JobState.RUNNING), "started_at": time.time()})
            except sqlite3.Error as exc:
                self._journal_failed(exc)
                return f"{type(exc).__name__}: {exc}"
        job.move(JobState.RUNNING)
        job.run = RunContext(job.id, job.spec, on_progress=self._progress,
                             on_settle=functools.partial(self._settle, job))
        self._publish(job)
        return None

    def _progress(self, runs: Sequence[RunContext], done: int, total: int) -> None:
        """`done` of `total` steps finished by each of `runs` (one model call): one lock for them all."""
        with self._lock:
            for run in runs:
                job = self._jobs.get(run.job_id)
                if job is not None and job.state is JobState.RUNNING:
                    job.steps_done, job.steps_total = done, total
                    self.counters["steps"] += 1
                    self._publish(job)

    def _settle(self, job: Job, outcome: Outcome) -> None:
        """A running job's end, as soon as its backend knows it (other members of its batch may run on)."""
        with self._lock:
            self._change(job, outcome.state, error=outcome.error, result=outcome.result)
            job.run = None
            view = job.view()
        duration = round((view.finished_at or 0) - (view.started_at or 0), 4)
        if outcome.state is JobState.SUCCEEDED:
            assert outcome.result is not None
            log.info("rollout succeeded", extra={"rollout": job.id, "duration_s": duration,
                                                 "bytes": outcome.result.num_bytes, "rows": outcome.result.num_rows})
        elif outcome.state is JobState.FAILED:
            assert outcome.error is not None
            log.error("rollout failed", extra={"rollout": job.id, "type": outcome.error.type,
                                               "reason": outcome.error.message, "steps_done": view.steps_done})
        else:
            log.info("rollout cancelled", extra={"rollout": job.id, "steps_done": view.steps_done})

    def _run(self, batch: Sequence[Job]) -> None:
        runs = [job.run for job in batch if job.run is not None]
        log.info("rollouts started" if len(runs) > 1 else "rollout started",
                 extra={"rollouts": [r.job_id for r in runs], "model": batch[0].model,
                        "samples": sum(r.spec.num_samples for r in runs)})
        try:
            self._backend.run(runs)
        except Exception as exc:  # a failing backend must never take the server down
            log.exception("backend run failed", extra={"rollouts": [r.job_id for r in runs]})
            for run in runs:
                run.settle_error(exc)
        for run in runs:
            if run.outcome is None:
                run.settle(Outcome.failure("internal_error", "the backend returned without the rollout's outcome"))

    # ---- expiry ---------------------------------------------------------------------------------

    def _reaper(self) -> None:
        while not self._stopped.wait(0.5):
            try:
                self.retry_journal()
                self.reap()
            except Exception:
                log.exception("reaper error")

    def reap(self, now: float | None = None) -> None:
        """Expire finished results past their TTL and forget the oldest records beyond the cap."""
        now = time.time() if now is None else now
        with self._lock:
            for job in list(self._jobs.values()):
                if job.state.finished and job.finished_at is not None and now - job.finished_at > self._ttl_s:
                    self._backend.release(job.id)
                    self._change(job, JobState.EXPIRED, keep_time=True)
                    log.info("rollout expired", extra={"rollout": job.id})
            done = [j for j in self._jobs.values() if not j.state.active]
            if len(done) > self._keep_records:
                done.sort(key=lambda j: j.created_at)
                for j in done[: len(done) - self._keep_records]:
                    del self._jobs[j.id]
                    del self._views[j.id]
                    if j.idempotency_key:
                        self._idem.pop(j.idempotency_key, None)
                    if self._journal is not None:
                        try:
                            self._journal.delete(j.id)
                        except sqlite3.Error as exc:
                            self._journal_failed(exc)
                            self._unjournaled_deletes.add(j.id)
