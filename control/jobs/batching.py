"""Batch formation: which queued rollouts a worker takes to run as one model call.

The oldest queued job no gathering batch could take heads the batch; every queued job with its
batch key and placement group joins, oldest first, while the batch holds at most
--max-batch-samples samples (`_gather`). With --batch-wait-ms W a batch that is not full waits W
for company from the moment its head is taken; a job that joins less than W/2 before that ends
keeps it open W/2 past its own arrival (`BURST_GAP`), so a burst whose requests follow each other
within W/2 lands in one batch however long it lasts, up to BATCH_WAIT_ROUNDS x W in all. A quick
burst does not wait a whole W past its last request. So a job waits only for jobs older than it
(and at most one batch of younger compatible ones that fit beside an older head): the age bound.
"""

from __future__ import annotations

import time

from sigmaflight.control.jobs.backend import Backend
from sigmaflight.control.jobs.job import Job
from sigmaflight.control.jobs.table import Forming, JobTable

BATCH_WAIT_ROUNDS = 8
"""A forming batch waits at most this many --batch-wait-ms in all, however long a burst keeps
joining it."""

BURST_GAP = 0.5
"""A job that joins keeps its batch open this fraction of --batch-wait-ms past its arrival: the
longest gap between two requests of one burst (a client posting a batch of prompts one request
at a time) that still lands them in one batch."""


class BatchFormer:
    def __init__(self, table: JobTable, backend: Backend, max_batch_samples: int, batch_wait_s: float) -> None:
        self.table = table
        self.backend = backend
        self.max_batch_samples = max_batch_samples
        self.batch_wait_s = batch_wait_s

    def take(self) -> list[Job] | None:
        """Under the lock: wait for queued work and gather a batch; its jobs (queued still, maybe
        none when all were cancelled meanwhile), or None once the manager stopped."""
        table = self.table
        head = self._next_head()
        if head is None:
            return None
        forming = Forming([head], head.batch_key, self.backend.group(head.id))
        table.forming.append(forming)
        try:
            self._gather(forming)
            now = time.monotonic()
            deadline = now + self.batch_wait_s
            longest = now + BATCH_WAIT_ROUNDS * self.batch_wait_s
            while (forming.jobs and not table.stopped.is_set() and self._room(forming) > 0
                   and (left := deadline - time.monotonic()) > 0):
                table.work.wait(left)
                had = len(forming.jobs)
                self._gather(forming)
                if len(forming.jobs) > had:  # a burst still arriving keeps the batch open for its next one
                    deadline = min(max(deadline, time.monotonic() + BURST_GAP * self.batch_wait_s), longest)
        finally:
            table.forming.remove(forming)
            table.work.notify_all()  # jobs left for this batch are anyone's again
        if table.stopped.is_set():
            return None
        return forming.jobs

    def _next_head(self) -> Job | None:
        """Under the lock: the oldest pending job that no gathering batch may take (None once stopped)."""
        table = self.table
        while True:
            if table.stopped.is_set():
                return None
            for job in table.pending:
                if not any(f.takes(job, self.backend.group(job.id)) and self._room(f) >= job.samples
                           for f in table.forming):
                    table.pending.remove(job)
                    return job
            table.work.wait()

    def _room(self, forming: Forming) -> int:
        return self.max_batch_samples - forming.samples()

    def _gather(self, forming: Forming) -> None:
        """Under the lock: move every pending job that may join `forming` into it, oldest first."""
        if forming.key is None:
            return
        room = self._room(forming)
        for job in list(self.table.pending):
            if room <= 0:
                break
            if forming.takes(job, self.backend.group(job.id)) and job.samples <= room:
                self.table.pending.remove(job)
                forming.jobs.append(job)
                room -= job.samples
