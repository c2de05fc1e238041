"""Admission: a new rollout is placed by the backend, checked against the queue's bound and its
Idempotency-Key, journaled and queued, or refused leaving nothing behind."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Hashable

from sigmaflight.control.jobs.backend import Backend
from sigmaflight.control.jobs.job import (
    TRAJECTORY,
    IdempotencyConflict,
    Job,
    JobView,
    JournalUnavailable,
    NotAccepting,
    PlacementFailed,
    QueueFull,
)
from sigmaflight.control.jobs.lifecycle import Lifecycle
from sigmaflight.control.jobs.table import JobTable
from sigmaflight.pipeline.spec import RolloutSpec

log = logging.getLogger("sigmaflight.jobs")


class Admission:
    def __init__(self, table: JobTable, lifecycle: Lifecycle, backend: Backend, queue_size: int) -> None:
        self.table = table
        self.lifecycle = lifecycle
        self.backend = backend
        self.queue_size = queue_size

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
        with self.table.lock:
            prior = self._admit(idempotency_key, body_digest)
        if prior is not None:
            return prior.view(), False
        job = Job(
            id=uuid.uuid4().hex,
            model=spec.model,
            request=spec,
            spec_json=spec.to_json(),
            streams=tuple(streams),
            steps_total=spec.num_inference_steps,
            created_at=time.time(),
            idempotency_key=idempotency_key,
            body_digest=body_digest,
            batch_key=batch_key,
        )
        try:
            job.ticket = self.backend.reserve(job.id)
        except Exception as exc:
            log.warning("rollout not placed", extra={"rollout": job.id, "cause": f"{type(exc).__name__}: {exc}"})
            raise PlacementFailed(f"no worker could take the rollout now ({type(exc).__name__}: {exc}); "
                                  "retry later") from None
        try:
            with self.table.lock:
                prior = self._admit(idempotency_key, body_digest)  # the world may have moved meanwhile
                if prior is None:
                    error = self.lifecycle.write(job)
                    if error is not None:
                        raise JournalUnavailable(f"the job journal cannot be written ({error}); "
                                                 "nothing was accepted; retry later")
                    self.table.add(job)
                    self.table.pending.append(job)
                    self.table.work.notify_all()  # an idle worker, or one gathering a batch it may join
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

    def repeated(self, idempotency_key: str | None, body_digest: str | None) -> JobView | None:
        """The first job of a repeated Idempotency-Key with the same body (IdempotencyConflict for
        another body), or None. Asked before a request's checks against the server's state (its
        expected_digest, its parent, a model failed closed), which may have moved since the first
        POST: a retry of a request that was accepted gets its ticket whatever changed."""
        if idempotency_key is None:
            return None
        with self.table.lock:
            prior_id = self.table.idem.get(idempotency_key)
            prior = self.table.jobs.get(prior_id) if prior_id is not None else None
            if prior is None:
                return None
            if prior.body_digest != body_digest:
                raise IdempotencyConflict(idempotency_key)
            return prior.view()

    def _admit(self, idempotency_key: str | None, body_digest: str | None) -> Job | None:
        """Under the lock: the prior job of a repeated key, or None if a new one may be queued
        (raises NotAccepting, IdempotencyConflict or QueueFull otherwise)."""
        if not self.table.accepting:
            raise NotAccepting("server shutting down")
        if idempotency_key is not None and idempotency_key in self.table.idem:
            prior = self.table.jobs.get(self.table.idem[idempotency_key])
            if prior is not None:
                if prior.body_digest != body_digest:
                    raise IdempotencyConflict(idempotency_key)
                return prior
        if self.table.queue_depth() >= self.queue_size:
            raise QueueFull(self.queue_size)
        return None

    def _undo_reserve(self, job_id: str, why: str) -> None:
        """Forget a reservation whose job was never registered (its ticket was never handed out)."""
        try:
            self.backend.abandon(job_id, "failed", why)
            self.backend.release(job_id)
        except Exception:
            log.exception("could not undo a reservation", extra={"rollout": job_id})
