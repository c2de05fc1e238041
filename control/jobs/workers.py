"""The worker threads, and the one place the manager meets the backend's run: each batch's jobs
(each a `RunContext`: progress and settle call back here) go to `backend.run` together."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from sigmaflight.control.jobs.backend import Backend, Outcome, RunContext
from sigmaflight.control.jobs.batching import BatchFormer
from sigmaflight.control.jobs.job import Job
from sigmaflight.control.jobs.lifecycle import Lifecycle
from sigmaflight.control.jobs.table import JobTable

from sigmaflight.records import RolloutState

log = logging.getLogger("sigmaflight.jobs")


class Workers:
    def __init__(self, table: JobTable, lifecycle: Lifecycle, former: BatchFormer, backend: Backend,
                 on_batch: Callable[[int, int], None] | None) -> None:
        self.table = table
        self.lifecycle = lifecycle
        self.former = former
        self.backend = backend
        self.on_batch = on_batch
        """Called with (samples, rollouts) of each model call that ran, once it has ended, as its
        `batch` metadata counts them: members refused before it took no rows (the /metrics histograms)."""

    def start(self, n: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._worker, name=f"sigmaflight-worker-{k}", daemon=True) for k in range(n)]
        for t in threads:
            t.start()
        return threads

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
        """The next batch's jobs, marked running (None once stopped). A job whose running state the
        journal cannot record does not run: it fails at once."""
        with self.table.lock:
            while True:
                jobs = self.former.take()
                if jobs is None:
                    return None
                started = [job for job in jobs if self._start(job)]
                if started:
                    return started

    def _start(self, job: Job) -> bool:
        """Under the lock: queued -> running with the context its backend runs it with."""
        assert job.request is not None
        if self.lifecycle.start(job) is not None:
            return False
        job.on_progress, job.on_settle = self._progress, self._settle
        return True

    def _progress(self, runs: Sequence[RunContext], done: int, total: int) -> None:
        """`done` of `total` steps finished by each of `runs` (one model call): one lock for them all."""
        with self.table.lock:
            for job in runs:
                assert isinstance(job, Job)
                if job.state is RolloutState.RUNNING:
                    job.steps_done, job.steps_total = done, total
                    self.table.counters["steps"] += 1
                    self.table.publish(job)

    def _settle(self, job: RunContext, outcome: Outcome) -> None:
        """A running job's end, as soon as its backend knows it (other members of its batch may run on)."""
        assert isinstance(job, Job)
        with self.table.lock:
            if not job.state.active:  # given up by a shutdown whose wait its step outlasted (JobManager.stop)
                return
            self.lifecycle.change(job, outcome.state, error=outcome.error, result=outcome.result)
            if job.release_on_end and job.state is RolloutState.SUCCEEDED:  # released while it ended
                self.lifecycle.release(job)
            view = job.view()
        duration = round((view.finished_at or 0) - (view.started_at or 0), 4)
        if outcome.state is RolloutState.SUCCEEDED:
            assert outcome.result is not None
            log.info("rollout succeeded", extra={"rollout": job.id, "duration_s": duration,
                                                 "bytes": outcome.result.num_bytes, "rows": outcome.result.num_rows})
        elif outcome.state is RolloutState.FAILED:
            assert outcome.error is not None
            log.error("rollout failed", extra={"rollout": job.id, "type": outcome.error.type,
                                               "reason": outcome.error.message, "steps_done": view.steps_done})
        else:
            log.info("rollout cancelled", extra={"rollout": job.id, "steps_done": view.steps_done})

    def _run(self, runs: Sequence[Job]) -> None:
        batch = [r.job_id for r in runs]
        for r in runs:  # a line each, with its `rollout` (and its batch's, when co-batched)
            log.info("rollout started", extra={"rollout": r.job_id, "model": r.model, "samples": r.spec.num_samples,
                                               **({"batch": batch} if len(runs) > 1 else {})})
        size = None
        try:
            size = self.backend.run(runs)
        except Exception as exc:  # a failing backend must never take the server down
            log.exception("backend run failed", extra={"rollouts": [r.job_id for r in runs]})
            for run in runs:
                run.settle_error(exc)
        if size is not None and self.on_batch is not None:
            self.on_batch(*size)
        for run in runs:
            if run.outcome is None:
                run.settle(Outcome.failure("internal_error", "the backend returned without the rollout's outcome"))
        with self.table.lock:
            for run in runs:
                if not run.state.active:  # ended, and no worker holds it any more
                    run.forget_request()
