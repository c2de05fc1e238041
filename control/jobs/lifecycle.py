"""A rollout's changes of state after admission, each journaled: start, cancel, release, a lost
result, the end of a run, and the restart scan that reconciles the journal with the backend.

Every change goes through `Lifecycle.change` (move, count, journal, publish) under the table's
lock. A journal write that fails keeps the new state in memory and marks the row for a retry
(`retry_journal`, called by the reaper); /readyz answers 503 until the journal can be written.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

from sigmaflight.control.jobs.backend import Backend
from sigmaflight.control.jobs.job import Job, NotFinished
from sigmaflight.control.jobs.journal import JOURNAL_NAME, Journal
from sigmaflight.control.jobs.table import JobTable

from sigmaflight.records import ErrorInfo, ResultInfo, RolloutState

log = logging.getLogger("sigmaflight.jobs")


def _words(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Lifecycle:
    def __init__(self, table: JobTable, backend: Backend, data_dir: Path | None) -> None:
        self.table = table
        self.backend = backend
        self.journal = Journal(data_dir / JOURNAL_NAME) if data_dir is not None else None
        self.journal_error: str | None = None
        """Why the last journal write failed; None while the journal is writable."""
        self._unjournaled_deletes: set[str] = set()

    # ---- the journal ----------------------------------------------------------------------------

    def write(self, job: Job) -> str | None:
        """Write the job's row; the error in words if the journal cannot be written."""
        if self.journal is None:
            return None
        try:
            self.journal.put(job.id, job.to_record())
        except sqlite3.Error as exc:
            self.journal_failed(exc)
            return _words(exc)
        return None

    def _persist(self, job: Job) -> None:
        """Write the job's row; on failure keep the state in memory and mark the row for a retry
        (the reaper writes it once the journal recovers). Never raises."""
        job.unjournaled = self.write(job) is not None

    def journal_failed(self, exc: BaseException) -> None:
        if self.journal_error is None:
            log.error("job journal cannot be written; /readyz answers 503 until it can", extra={"cause": _words(exc)})
        self.journal_error = _words(exc)

    def delete_row(self, job_id: str) -> None:
        """Under the lock: delete a forgotten job's row (retried later when that fails)."""
        if self.journal is None:
            return
        try:
            self.journal.delete(job_id)
        except sqlite3.Error as exc:
            self.journal_failed(exc)
            self._unjournaled_deletes.add(job_id)

    def retry_journal(self) -> bool:
        """Write every row that could not be written, then probe; True once the journal is
        writable again (or never failed)."""
        with self.table.lock:
            journal = self.journal
            if journal is None or self.journal_error is None:
                return True
            try:
                for job in self.table.jobs.values():
                    if job.unjournaled:
                        journal.put(job.id, job.to_record())
                        job.unjournaled = False
                for job_id in list(self._unjournaled_deletes):
                    journal.delete(job_id)
                    self._unjournaled_deletes.discard(job_id)
                journal.probe()
            except sqlite3.Error as exc:
                self.journal_error = _words(exc)
                return False
            self.journal_error = None
        log.info("job journal writable again")
        return True

    def close(self) -> None:
        with self.table.lock:
            journal, self.journal = self.journal, None
        if journal is not None:
            journal.close()

    # ---- changes ----------------------------------------------------------------------------------

    def change(self, job: Job, state: RolloutState, *, error: ErrorInfo | None = None,
               result: ResultInfo | None = None, keep_time: bool = False) -> None:
        """Under the lock: move, count, journal, publish. A rollout is counted once as it ends (a
        succeeded one that later turns failed, result_unavailable, is not counted again), and once
        more as `expired` when it succeeded in this process (the counters start at the process's
        start: the identity expired <= succeeded holds for each process's counters)."""
        was = job.state
        job.move(state, error=error, result=result, keep_time=keep_time)
        if was.active and not state.active:
            self.table.counters[f"rollouts_{state}"] += 1
            job.finished_here = True
        elif state is RolloutState.EXPIRED and was is RolloutState.SUCCEEDED and job.finished_here:
            self.table.counters["rollouts_expired"] += 1
        self._persist(job)
        self.table.publish(job)

    def start(self, job: Job) -> str | None:
        """Under the lock: queued -> running, the running row journaled first. When the journal
        cannot record it the job fails at once ("journal_unavailable") and the error in words is
        returned."""
        if self.journal is not None:
            try:
                self.journal.put(job.id, {**job.to_record(), "status": str(RolloutState.RUNNING),
                                          "started_at": time.time()})
            except sqlite3.Error as exc:
                self.journal_failed(exc)
                message = f"the job journal cannot be written ({_words(exc)})"
                self.change(job, RolloutState.FAILED, error=ErrorInfo(type="journal_unavailable", message=message))
                job.forget_request()  # it never runs
                self.backend.abandon(job.id, RolloutState.FAILED, message)
                log.error("rollout failed", extra={"rollout": job.id, "type": "journal_unavailable", "reason": message,
                                                   "steps_done": 0, "was": "queued"})
                return message
        job.move(RolloutState.RUNNING)
        self.table.publish(job)
        return None

    def end_queued(self, job: Job, state: RolloutState, error: ErrorInfo | None = None) -> None:
        """Under the lock: a queued job that never runs (cancelled, shutdown)."""
        self.table.unqueue(job)
        self.change(job, state, error=error)
        job.forget_request()  # out of every queue and batch: nothing runs it
        self.backend.abandon(job.id, state, error.message if error else "cancelled by client")
        if error is not None:  # the end line a running rollout gets from its worker (Workers.settle)
            log.error("rollout failed", extra={"rollout": job.id, "type": error.type, "reason": error.message,
                                               "steps_done": 0, "was": "queued"})
        else:
            log.info("rollout cancelled", extra={"rollout": job.id, "steps_done": 0, "was": "queued"})

    def cancel_active(self, job: Job) -> bool:
        """Under the lock: stop a queued or running job; False (nothing changed) otherwise."""
        if job.state is RolloutState.QUEUED:
            self.end_queued(job, RolloutState.CANCELLED)
            return True
        if job.state is RolloutState.RUNNING:
            return job.stop()  # False once it is past its last step: it will succeed
        return False

    def release(self, job: Job) -> None:
        """Under the lock: free what a finished job holds; a succeeded one becomes expired."""
        if job.state.active:
            raise NotFinished(job.id, job.state)
        if job.state.finished:
            self.backend.release(job.id)
            job.released = True
        if job.state is RolloutState.SUCCEEDED:
            self.change(job, RolloutState.EXPIRED, keep_time=True)
        elif job.state.finished:
            self._persist(job)  # a failed or cancelled one keeps its status: its row keeps that it was released

    def result_lost(self, job: Job, reason: str) -> bool:
        """Under the lock: a succeeded job whose trajectory the store lost becomes failed."""
        if job.state is not RolloutState.SUCCEEDED:
            return False
        self.change(job, RolloutState.FAILED, error=ErrorInfo(type="result_unavailable", message=reason),
                    keep_time=True)
        return True

    # ---- the restart scan -------------------------------------------------------------------------

    def recover(self) -> None:
        """Register every journaled job, with what a restart changed written back.

        A rollout that was queued or running when the process died is failed ("server_restarted"),
        unless the backend holds its finished, valid trajectory: the process died between the file's
        rename into place and the journal's "succeeded" row (or that row, and the "running" one
        before it, could not be written), so it is a succeeded rollout. A succeeded one whose
        trajectory the backend no longer holds is expired. An ended one that is not succeeded
        (expired, failed, cancelled) has whatever trajectory the backend still holds of it deleted:
        Flight must not serve what REST does not call succeeded (a file whose delete failed at its
        release; a failed one whose served copy was found changed, result_unavailable). A
        trajectory the journal has no row for is set aside (`.orphan`): REST cannot name it, so
        Flight must not serve it, and it is not ours to delete. A row that cannot be written back
        now is retried later. What the backend holds is asked once (under Ray, a call to every
        worker), not once a row: the journal holds thousands of ended rollouts."""
        if self.journal is None:
            return
        held = set(self.backend.stored_ids())
        journaled = set()
        for rec in self.journal.load():
            job = Job.from_record(rec)
            journaled.add(job.id)
            was = job.state
            result = self.backend.result_info(job.id) if was.active and job.id in held else None
            if result is not None:
                if was is RolloutState.QUEUED:
                    job.move(RolloutState.RUNNING)
                job.move(RolloutState.SUCCEEDED, result=result)
                job.steps_done = job.steps_total
                self._persist(job)
                log.warning("rollout found finished after restart; marked succeeded",
                            extra={"rollout": job.id, "was": was})
            elif was.active:
                job.move(RolloutState.FAILED, error=ErrorInfo(
                    type="server_restarted", message=f"server restarted while the rollout was {was}"))
                self._persist(job)
                log.warning("rollout marked failed after restart", extra={"rollout": job.id, "was": was})
            elif was is RolloutState.SUCCEEDED and job.id not in held:
                job.move(RolloutState.EXPIRED, keep_time=True)
                self._persist(job)
                log.warning("finished rollout has no stored trajectory; marked expired", extra={"rollout": job.id})
            elif was is not RolloutState.SUCCEEDED and job.id in held:
                self.backend.release(job.id)
                job.released = True
                self._persist(job)
                log.warning("trajectory of an ended rollout found after restart; deleted",
                            extra={"rollout": job.id, "status": was})
            job.forget_request()  # restored records never run; the journal keeps their specs
            self.table.add(job)
        for rollout_id in sorted(held - journaled):
            self.backend.release(rollout_id, aside=True)
            log.warning("trajectory with no journal row found after restart; set aside, never served",
                        extra={"rollout": rollout_id})
