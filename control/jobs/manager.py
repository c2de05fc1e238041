"""The job queue: rollouts wait in a bounded queue and run on worker threads.

A job moves through the states of sigmaflight/records.py (queued -> running -> succeeded |
failed | cancelled, and a finished one becomes expired when its result's TTL passes or it is
released), each change checked against the transition table and published as an immutable
`JobView`. A backend (local pipeline + result store, or remote workers) does the actual run,
reached through the `Backend` protocol, which runs the jobs themselves (a `Job` is a `RunContext`, backend.py).

`JobManager` is the face the service and the HTTP routes use; the work is done by parts that
share one `JobTable` (table.py: the jobs, the queue and the lock over them): admission and
idempotency (admission.py), batch formation (batching.py), changes of state and the journal,
with the restart scan (lifecycle.py), the worker threads and the backend's run (workers.py),
and the reaper (reaper.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from sigmaflight.control.jobs.admission import Admission
from sigmaflight.control.jobs.backend import Backend
from sigmaflight.control.jobs.batching import BatchFormer
from sigmaflight.control.jobs.job import JobView
from sigmaflight.control.jobs.lifecycle import Lifecycle
from sigmaflight.control.jobs.reaper import Reaper
from sigmaflight.control.jobs.table import JobTable
from sigmaflight.control.jobs.workers import Workers

from sigmaflight.records import ErrorInfo, RolloutState

log = logging.getLogger("sigmaflight.jobs")


class JobManager:
    """Statuses, idempotency keys, the bounded queue, worker threads and the TTL reaper."""

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
        self._table = JobTable()
        self._lifecycle = Lifecycle(self._table, backend, data_dir)
        self._admission = Admission(self._table, self._lifecycle, backend, queue_size)
        self.submit = self._admission.submit
        """Enqueue a rollout: (its view, created); `Admission.submit` (admission.py)."""
        self.repeated = self._admission.repeated
        """The first rollout of a repeated Idempotency-Key and body, or None; `Admission.repeated`."""
        self._workers = Workers(self._table, self._lifecycle, BatchFormer(self._table, backend, max_batch_samples,
                                                                          batch_wait_s), backend, on_batch)
        self._reaper = Reaper(self._table, self._lifecycle, ttl_s, keep_records)
        self._workers_n = workers
        self._threads: list[threading.Thread] = []
        self.counters: Counter[str] = self._table.counters
        self._lifecycle.recover()

    @property
    def on_batch(self) -> Callable[[int, int], None] | None:
        return self._workers.on_batch

    @on_batch.setter
    def on_batch(self, callback: Callable[[int, int], None] | None) -> None:
        self._workers.on_batch = callback

    def start(self) -> None:
        self._threads += self._workers.start(self._workers_n)
        self._threads.append(self._reaper.start())

    def refuse_new(self) -> None:
        """Take no more rollouts (503 shutting_down); `stop` ends the ones taken. No lock (a signal
        handler calls it): one flag, read under the lock by admission."""
        self._table.accepting = False

    def stop(self, reason: str = "server shutting down", timeout: float = 15.0) -> None:
        """Stop taking rollouts; end queued and running ones as failed with `reason`; close the
        journal."""
        self.end_all(reason, timeout)
        self._lifecycle.close()

    def end_all(self, reason: str = "server shutting down", timeout: float = 15.0) -> None:
        """Stop taking rollouts and end queued and running ones as failed with `reason`, waiting up
        to `timeout` for the workers. Releases and reads still work (the journal stays open), so the
        server can answer the requests it has with each rollout's end before it stops."""
        table = self._table
        with table.lock:
            table.accepting = False
            for job in list(table.jobs.values()):
                if job.state is RolloutState.QUEUED:
                    self._lifecycle.end_queued(job, RolloutState.FAILED, ErrorInfo(type="shutdown", message=reason))
                elif job.state is RolloutState.RUNNING:
                    job.stop(reason)
            table.stopped.set()
            table.work.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with table.lock:  # a step that outlasts the wait: its end is written now, its worker's never
            for job in list(table.jobs.values()):
                if job.state is RolloutState.RUNNING:
                    message = f"{reason} (its step did not end within the shutdown's {timeout:g} s)"
                    self._lifecycle.change(job, RolloutState.FAILED, error=ErrorInfo(type="shutdown", message=message))
                    log.error("rollout failed", extra={"rollout": job.id, "type": "shutdown", "reason": message,
                                                       "steps_done": job.steps_done, "was": "running"})

    def get(self, job_id: str) -> JobView | None:
        """The job's latest snapshot (no lock taken: it never waits on a journal write)."""
        return self._table.get(job_id)

    def watch(self, job_id: str, callback: Callable[[], None]) -> None:
        """`callback` once the job has ended or is forgotten (`JobTable.watch`, table.py)."""
        self._table.watch(job_id, callback)

    def unwatch(self, job_id: str, callback: Callable[[], None]) -> None:
        self._table.unwatch(job_id, callback)

    def list(self, status: str | None = None, limit: int = 100, ticket: str | None = None,
             after: str | None = None) -> tuple[list[JobView], bool]:
        """A page, newest first, and whether more follow (table.py `JobTable.list`)."""
        return self._table.list(status, limit, ticket, after)

    def cancel(self, job_id: str) -> JobView | None:
        """REST DELETE: cancel a queued/running rollout, or release a finished one's result.

        A released succeeded rollout becomes expired; a failed or cancelled one keeps its
        status (and its error), only what it held is freed."""
        with self._table.lock:
            job = self._table.jobs.get(job_id)
            if job is None:
                return None
            if job.state.active:  # a running one past its last step is not stopped: it succeeds, and is released
                self._lifecycle.cancel_active(job)
                job.release_on_end = job.state is RolloutState.RUNNING
            else:
                self._lifecycle.release(job)
            return job.view()

    def cancel_active(self, job_id: str) -> bool:
        """Flight `cancel`: stop a queued or running rollout; False (nothing changed) otherwise."""
        with self._table.lock:
            job = self._table.jobs.get(job_id)
            return job is not None and self._lifecycle.cancel_active(job)

    def release(self, job_id: str) -> bool:
        """Flight `release`: free a finished rollout's result (as DELETE does); False if unknown,
        expired or already released (nothing is left to free). Raises NotFinished for a queued or
        running one: cancel it first."""
        with self._table.lock:
            job = self._table.jobs.get(job_id)
            if job is None or job.state is RolloutState.EXPIRED or job.released:
                return False
            self._lifecycle.release(job)
            return True

    def release_when_finished(self, job_id: str) -> bool:
        """Flight `release` of a rollout whose trajectory is whole while this record may still say
        running (the stream ends a moment before the backend's report does): released now if it has
        ended, else as it ends. False if unknown, expired or already released."""
        with self._table.lock:
            job = self._table.jobs.get(job_id)
            if job is None or job.state is RolloutState.EXPIRED or job.released:
                return False
            if job.state.active:
                job.release_on_end = True
            else:
                self._lifecycle.release(job)
            return True

    def released_elsewhere(self, job_id: str) -> None:
        """A backend freed a finished rollout's result on its own (a Flight `release` at a Ray
        worker): the record follows as after a DELETE (a succeeded one becomes expired), now or, when
        the worker's report of its end has not come yet, as it ends."""
        self.release_when_finished(job_id)

    def result_lost(self, job_id: str, reason: str) -> bool:
        """The store lost a succeeded rollout's trajectory (file truncated or corrupted): it becomes
        failed with error type "result_unavailable", so REST stops saying succeeded. False if the
        rollout is unknown or not succeeded (nothing changes)."""
        with self._table.lock:
            job = self._table.jobs.get(job_id)
            return job is not None and self._lifecycle.result_lost(job, reason)

    def queue_depth(self) -> int:  # lock-free like get/list (a /metrics scrape never waits on a journal write)
        return self._table.queue_depth()

    def status_counts(self) -> Counter[str]:
        return self._table.status_counts()

    @property
    def journaled(self) -> bool:
        """Whether changes are written to a journal (a data dir): a submit may wait on its write."""
        return self._lifecycle.journal is not None

    def journal_error(self) -> str | None:
        """Why the journal cannot be written now (readyz answers 503); None while it can."""
        return self._lifecycle.journal_error

    def retry_journal(self) -> bool:
        """Write every row that could not be written, then probe; True once writable again."""
        return self._lifecycle.retry_journal()

    def reap(self, now: float | None = None) -> None:
        """Expire finished results past their TTL and forget the oldest records beyond the cap."""
        self._reaper.reap(now)
