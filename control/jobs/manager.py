"""The job queue: rollouts wait in a bounded queue and run on worker threads.

A job moves queued -> running -> succeeded | failed | cancelled, and a finished one
becomes expired when its result's TTL passes or it is released. The manager owns
statuses, idempotency keys, TTL and the durable journal; a backend (local pipeline +
result store, or a remote worker) does the actual run.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from sigmaflight.control.jobs.journal import Journal
from sigmaflight.pipeline.spec import RolloutCancelled, RolloutSpec

from sigmaflight.wire import TERMINAL

log = logging.getLogger("sigmaflight.jobs")



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


@dataclass
class Job:
    """Internal record of one rollout (mutable; guarded by the manager's lock)."""

    id: str
    model: str
    spec: RolloutSpec | None
    request: dict[str, Any]
    steps_total: int
    created_at: float
    status: str = "queued"
    steps_done: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    error: tuple[str, str] | None = None
    result: dict[str, Any] | None = None
    idempotency_key: str | None = None
    body_digest: str | None = None
    ticket: str = ""
    """Opaque Flight ticket, issued by the backend at submit time and kept for the job's life."""
    cancel: threading.Event = field(default_factory=threading.Event)
    stop_reason: str | None = None
    unjournaled: bool = False
    """Its latest state could not be written to the journal; retried until it is."""

    def to_record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "request": self.request,
            "steps_total": self.steps_total,
            "steps_done": self.steps_done,
            "created_at": self.created_at,
            "status": self.status,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": list(self.error) if self.error else None,
            "result": self.result,
            "idempotency_key": self.idempotency_key,
            "body_digest": self.body_digest,
            "ticket": self.ticket,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Job:
        return cls(
            id=rec["id"],
            model=rec["model"],
            spec=None,
            request=rec["request"],
            steps_total=rec["steps_total"],
            steps_done=rec["steps_done"],
            created_at=rec["created_at"],
            status=rec["status"],
            started_at=rec["started_at"],
            finished_at=rec["finished_at"],
            error=tuple(rec["error"]) if rec["error"] else None,  # type: ignore[arg-type]
            result=rec["result"],
            idempotency_key=rec["idempotency_key"],
            body_digest=rec["body_digest"],
            ticket=rec.get("ticket", ""),
        )


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


class Backend(Protocol):
    """Runs one rollout and holds its result for Flight."""

    def run(
        self, job: Job, *, on_progress: Callable[[int, int], None], should_stop: Callable[[], bool]
    ) -> dict[str, Any]:
        """Run `job.spec`; return result info {num_rows, num_bytes, steps}. Raise RolloutCancelled when stopped."""
        ...

    def reserve(self, job_id: str) -> str:
        """Announce a rollout before it runs and return its Flight ticket (consumers may wait on it)."""
        ...

    def abandon(self, job_id: str, kind: str, message: str) -> None:
        """End a reserved rollout that never ran (cancelled while queued, shutdown)."""
        ...

    def release(self, job_id: str) -> None:
        """Drop a finished result."""
        ...

    def has_result(self, job_id: str) -> bool: ...

    def result_info(self, job_id: str) -> dict[str, Any] | None:
        """{num_rows, num_bytes, steps} of a finished, valid trajectory held here; None if none."""
        ...

    def locations_for(self, job_id: str) -> list[str]:
        """Flight URIs where the rollout's trajectory is served."""
        ...


def recover_jobs(journal: Journal, backend: Backend) -> list[Job]:
    """The restart scan: every journaled job, with what a restart changed written back.

    A rollout that was queued or running when the process died is failed ("server_restarted"),
    unless the backend holds its finished, valid trajectory: the process died between the
    file's rename into place and the journal's "succeeded" row (or that row could not be
    written), so it is a succeeded rollout. A succeeded one whose trajectory the backend no
    longer holds is expired. A row that cannot be written back now is written later (the
    manager retries it)."""
    jobs = []
    for rec in journal.load():
        job = Job.from_record(rec)
        result = backend.result_info(job.id) if job.status in ("queued", "running") else None
        if result is not None:
            job.status = "succeeded"
            job.error = None
            job.result = result
            job.steps_done = job.steps_total
            job.finished_at = time.time()
            _put_later(journal, job)
            log.warning("rollout found finished after restart; marked succeeded",
                        extra={"rollout": job.id, "was": rec["status"]})
        elif job.status in ("queued", "running"):
            job.status = "failed"
            job.error = ("server_restarted", f"server restarted while the rollout was {rec['status']}")
            job.finished_at = time.time()
            _put_later(journal, job)
            log.warning("rollout marked failed after restart", extra={"rollout": job.id, "was": rec["status"]})
        elif job.status == "succeeded" and not backend.has_result(job.id):
            job.status = "expired"
            job.error = None
            _put_later(journal, job)
            log.warning("finished rollout has no stored trajectory; marked expired", extra={"rollout": job.id})
        jobs.append(job)
    return jobs


def _put_later(journal: Journal, job: Job) -> None:
    try:
        journal.put(job.id, job.to_record())
    except sqlite3.Error:
        job.unjournaled = True  # the manager writes it once the journal can be written


class JobManager:
    """Statuses, idempotency keys, the bounded queue, worker threads and the TTL reaper.

    Long (~400 lines) for a reason: one re-entrant lock guards every job's state, and each
    public method is one transition of that state machine under it (submit, cancel, release,
    the journal's failure and recovery, a lost result); spreading the transitions over several
    classes would spread the lock. The restart scan (`recover_jobs`) and the journal
    (journal.py) live outside. The journal retry and the worker loop are the next candidates
    to move out."""

    def __init__(
        self,
        backend: Backend,
        *,
        workers: int = 1,
        queue_size: int = 64,
        ttl_s: float = 3600.0,
        data_dir: Path | None = None,
        keep_records: int = 10_000,
    ) -> None:
        self._backend = backend
        self._workers_n = workers
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._queue_size = queue_size
        self._ttl_s = ttl_s
        self._keep_records = keep_records
        self._lock = threading.RLock()
        self._jobs: dict[str, Job] = {}
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
            self._jobs[job.id] = job
            if job.idempotency_key:
                self._idem[job.idempotency_key] = job.id
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
            for job in self._jobs.values():
                if job.status in ("queued", "running"):
                    job.stop_reason = reason
                    job.cancel.set()
                    if job.status == "queued":
                        self._finish(job, "failed", error=("shutdown", reason))
                        self._backend.abandon(job.id, "failed", reason)
        self._stopped.set()
        for _ in range(self._workers_n):
            self._queue.put(None)
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
        request: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        body_digest: str | None = None,
    ) -> tuple[Job, bool]:
        """Enqueue; returns (job, created). A repeated Idempotency-Key returns the first job.

        The backend places the rollout (`reserve`, a remote call with Ray) before anything is
        registered and outside the lock; the job is registered and journaled only once placed.
        Whatever fails leaves nothing behind: a placement failure raises PlacementFailed, a
        journal write failure JournalUnavailable (the reservation is undone), both 503s."""
        with self._lock:
            prior = self._admit(idempotency_key, body_digest)
        if prior is not None:
            return prior, False
        job = Job(
            id=uuid.uuid4().hex,
            model=spec.model,
            spec=spec,
            request=request,
            steps_total=spec.num_inference_steps,
            created_at=time.time(),
            idempotency_key=idempotency_key,
            body_digest=body_digest,
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
                    self._jobs[job.id] = job
                    if idempotency_key is not None:
                        self._idem[idempotency_key] = job.id
                    self._queue.put(job)
        except BaseException:
            self._undo_reserve(job.id, "not accepted")
            raise
        if prior is not None:
            self._undo_reserve(job.id, "a concurrent request with the same Idempotency-Key won")
            return prior, False
        log.info(
            "rollout queued",
            extra={"rollout": job.id, "model": job.model, "samples": spec.num_samples, "steps": spec.num_inference_steps},
        )
        return job, True

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

    def _undo_reserve(self, job_id: str, why: str) -> None:
        """Forget a reservation whose job was never registered (its ticket was never handed out)."""
        try:
            self._backend.abandon(job_id, "failed", why)
            self._backend.release(job_id)
        except Exception:
            log.exception("could not undo a reservation", extra={"rollout": job_id})

    # get/list take no lock (issue 12 item 22): a dict lookup and a copy of its values are atomic
    # under the GIL, and a status read must not wait while a worker fsyncs the journal under _lock.
    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def list(self, status: str | None = None, limit: int = 100) -> list[Job]:
        jobs = [j for j in list(self._jobs.values()) if status is None or j.status == status]
        jobs.sort(key=lambda j: j.created_at, reverse=True)
        return jobs[:limit]

    def cancel(self, job_id: str) -> Job | None:
        """REST DELETE: cancel a queued/running rollout, or release a finished one's result.

        A released succeeded rollout becomes expired; a failed or cancelled one keeps its
        status (and its error), only what it held is freed."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            if not self._cancel_active(job):
                self._release_finished(job)
            return job

    def result_lost(self, job_id: str, reason: str) -> bool:
        """The store lost a succeeded rollout's trajectory (file truncated or corrupted): it becomes
        failed with error type "result_unavailable", so REST stops saying succeeded. False if the
        rollout is unknown or not succeeded (nothing changes)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.status != "succeeded":
                return False
            self._finish(job, "failed", error=("result_unavailable", reason), keep_time=True)
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
            if job is None or job.status == "expired":
                return False
            if job.status in ("queued", "running"):
                raise NotFinished(job.id, job.status)
            self._release_finished(job)
            return True

    def _cancel_active(self, job: Job) -> bool:
        if job.status == "queued":
            self._finish(job, "cancelled")
            self._backend.abandon(job.id, "cancelled", "cancelled by client")
            return True
        if job.status == "running":
            job.stop_reason = None
            job.cancel.set()
            return True
        return False

    def _release_finished(self, job: Job) -> None:
        if job.status in ("succeeded", "failed", "cancelled"):
            self._backend.release(job.id)
        if job.status == "succeeded":
            self._finish(job, "expired", keep_time=True)

    def queue_depth(self) -> int:  # lock-free like get/list (a /metrics scrape never waits on a journal write)
        return sum(1 for j in list(self._jobs.values()) if j.status == "queued")

    def status_counts(self) -> Counter[str]:
        return Counter(j.status for j in list(self._jobs.values()))

    def journal_error(self) -> str | None:
        """Why the journal cannot be written now (readyz answers 503); None while it can."""
        return self._journal_error

    # ---- internals ----------------------------------------------------------------------------

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

    def _finish(
        self, job: Job, status: str, *, error: tuple[str, str] | None = None, keep_time: bool = False
    ) -> None:
        job.status = status
        job.error = error
        if not keep_time or job.finished_at is None:
            job.finished_at = time.time()
        self.counters[f"rollouts_{status}"] += 1
        self._persist(job)

    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:  # a worker thread never dies: it is the only one that runs rollouts
                self._take(job)
            except Exception:
                log.exception("worker error outside a rollout", extra={"rollout": job.id})

    def _take(self, job: Job) -> None:
        with self._lock:
            if job.status != "queued":
                return
            job.status = "running"
            job.started_at = time.time()
            error = self._write(job)
            if error is not None:  # a rollout the journal cannot record does not run
                job.status = "queued"
                message = f"the job journal cannot be written ({error})"
                self._finish(job, "failed", error=("journal_unavailable", message))
                self._backend.abandon(job.id, "failed", message)
                log.error("rollout failed: journal unwritable", extra={"rollout": job.id})
                return
        self._run(job)

    def _run(self, job: Job) -> None:
        assert job.spec is not None
        log.info("rollout started", extra={"rollout": job.id, "model": job.model})

        def on_progress(done: int, total: int) -> None:
            with self._lock:
                job.steps_done = done
                job.steps_total = total
                self.counters["steps"] += 1

        try:
            result = self._backend.run(job, on_progress=on_progress, should_stop=job.cancel.is_set)
        except RolloutCancelled:
            with self._lock:
                if job.stop_reason is not None:
                    self._finish(job, "failed", error=("shutdown", job.stop_reason))
                else:
                    self._finish(job, "cancelled")
            log.info("rollout %s", job.status, extra={"rollout": job.id, "steps_done": job.steps_done})
            return
        except Exception as exc:  # a failing rollout must never take the server down
            with self._lock:
                self._finish(job, "failed", error=(getattr(exc, "error_type", type(exc).__name__), str(exc) or repr(exc)))
            log.exception("rollout failed", extra={"rollout": job.id})
            return
        with self._lock:
            job.result = result
            self._finish(job, "succeeded")
            duration = (job.finished_at or 0) - (job.started_at or 0)
        log.info(
            "rollout succeeded",
            extra={
                "rollout": job.id,
                "duration_s": round(duration, 4),
                "bytes": result.get("num_bytes"),
                "rows": result.get("num_rows"),
            },
        )

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
                if (
                    job.status in ("succeeded", "failed", "cancelled")
                    and job.finished_at is not None
                    and now - job.finished_at > self._ttl_s
                ):
                    self._backend.release(job.id)
                    self._finish(job, "expired", keep_time=True)
                    log.info("rollout expired", extra={"rollout": job.id})
            done = [j for j in self._jobs.values() if j.status in TERMINAL]
            if len(done) > self._keep_records:
                done.sort(key=lambda j: j.created_at)
                for j in done[: len(done) - self._keep_records]:
                    del self._jobs[j.id]
                    if j.idempotency_key:
                        self._idem.pop(j.idempotency_key, None)
                    if self._journal is not None:
                        try:
                            self._journal.delete(j.id)
                        except sqlite3.Error as exc:
                            self._journal_failed(exc)
                            self._unjournaled_deletes.add(j.id)
