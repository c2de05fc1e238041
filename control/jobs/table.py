"""The job table: every rollout the manager knows, the queue, and the one lock over them.

The parts of the manager (admission.py, batching.py, lifecycle.py, reaper.py, workers.py) share
one `JobTable`. Its lock guards: each `Job`'s fields, the `jobs` / `views` / `idem` maps, the
queue (`pending`) and the batches being gathered (`forming`), `accepting`, and the counters.
It is re-entrant, and `work` (a Condition over it) is signalled when a job is queued, when a
gathering batch gives jobs back and when the manager stops. Readers (`get`, `list`,
`queue_depth`, `status_counts`) take no lock: each `views` value is replaced whole, so a status
read never waits on a journal write.
"""

from __future__ import annotations

import collections
import threading
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

from sigmaflight.control.jobs.job import TRAJECTORY, Job, JobView
from sigmaflight.dataplane.tickets import stream_ticket


@dataclass(eq=False)
class Forming:
    """A batch a worker is gathering: its jobs (queued still), their key and placement group."""

    jobs: list[Job]
    key: Hashable | None
    group: Hashable

    def takes(self, job: Job, group: Hashable) -> bool:
        return self.key is not None and job.batch_key == self.key and group == self.group

    def samples(self) -> int:
        return sum(j.samples for j in self.jobs)


def _tickets(view: JobView) -> set[str]:
    """The Flight tickets of a job: its rollout's, and each extra stream's it publishes."""
    return {view.ticket} | {stream_ticket(view.ticket, name) for name in view.streams if name != TRAJECTORY}


class JobTable:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.work = threading.Condition(self.lock)
        self.jobs: dict[str, Job] = {}
        self.views: dict[str, JobView] = {}
        """The latest published snapshot of each job (replaced whole, read without the lock)."""
        self.idem: dict[str, str] = {}
        """Idempotency-Key -> the id of the job it created."""
        self.pending: collections.deque[Job] = collections.deque()
        """Queued jobs no worker has taken yet, oldest first."""
        self.forming: list[Forming] = []
        """Batches a worker is gathering (with --batch-wait-ms): their jobs are queued still."""
        self.accepting = True
        self.stopped = threading.Event()
        self.counters: Counter[str] = Counter()
        """Rollouts finished by status ("rollouts_<status>") and steps done ("steps")."""

    def add(self, job: Job) -> None:
        """Under the lock: register a job (new, or restored from the journal)."""
        self.jobs[job.id] = job
        self.views[job.id] = job.view()
        if job.idempotency_key is not None:
            self.idem[job.idempotency_key] = job.id

    def forget(self, job: Job) -> None:
        """Under the lock: drop a finished job's record and its key."""
        del self.jobs[job.id]
        del self.views[job.id]
        if job.idempotency_key:
            self.idem.pop(job.idempotency_key, None)

    def publish(self, job: Job) -> None:
        """Under the lock, after every change: readers now see the job as it is."""
        self.views[job.id] = job.view()

    def unqueue(self, job: Job) -> None:
        """Under the lock: take a queued job out of the queue or the batch gathering it."""
        if job in self.pending:
            self.pending.remove(job)
        for forming in self.forming:
            if job in forming.jobs:
                forming.jobs.remove(job)

    def get(self, job_id: str) -> JobView | None:
        return self.views.get(job_id)

    def list(self, status: str | None = None, limit: int = 100, ticket: str | None = None) -> list[JobView]:
        """Newest first, optionally of one status, optionally the one job whose Flight ticket is
        `ticket` or the ticket of one of the extra streams it publishes (`stream_ticket`), exactly:
        `<ticket>:<anything else>` is no ticket of it."""
        views = [v for v in list(self.views.values()) if (status is None or v.status == status)
                 and (ticket is None or (v.ticket != "" and ticket in _tickets(v)))]
        views.sort(key=lambda v: v.created_at, reverse=True)
        return views[:limit]

    def queue_depth(self) -> int:
        return len(self.pending) + sum(len(f.jobs) for f in list(self.forming))

    def status_counts(self) -> Counter[str]:
        return Counter(str(v.status) for v in list(self.views.values()))
