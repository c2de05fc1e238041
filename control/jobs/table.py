"""The job table: every rollout the manager knows, the queue, and the one lock over them.

The parts of the manager (admission.py, batching.py, lifecycle.py, reaper.py, workers.py) share
one `JobTable`. Its lock guards: each `Job`'s fields, the `jobs` / `views` / `idem` maps, the
queue (`pending`) and the batches being gathered (`forming`), `accepting`, and the counters.
It is re-entrant, and `work` (a Condition over it) is signalled when a job is queued, when a
gathering batch gives jobs back and when the manager stops. Readers (`get`, `list`,
`queue_depth`, `status_counts`) take no lock: each `views` value is replaced whole, so a status
read never waits on a journal write. A reader that waits for a job to end (a held status read)
`watch`es it: its callback is called once the job's published view has ended or the job is
forgotten, under a lock of its own (the table's may wait on a journal write).
"""

from __future__ import annotations

import collections
import threading
from collections import Counter
from collections.abc import Callable, Hashable
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
        self._watchers: dict[str, list[Callable[[], None]]] = {}
        self._watch_lock = threading.Lock()

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
        self._ended(job.id)

    def publish(self, job: Job) -> None:
        """Under the lock, after every change: readers now see the job as it is."""
        view = self.views[job.id] = job.view()
        if not view.status.active:
            self._ended(job.id)

    def watch(self, job_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` (on the thread that publishes, so it must only hand over: e.g.
        `loop.call_soon_threadsafe`) once the job has ended or is forgotten. Register it, then read
        the job's view: a job that ended in between is seen by the read, one that ends later
        calls it back."""
        with self._watch_lock:
            self._watchers.setdefault(job_id, []).append(callback)

    def unwatch(self, job_id: str, callback: Callable[[], None]) -> None:
        with self._watch_lock:
            callbacks = self._watchers.get(job_id)
            if callbacks is not None and callback in callbacks:
                callbacks.remove(callback)
                if not callbacks:
                    del self._watchers[job_id]

    def _ended(self, job_id: str) -> None:
        if not self._watchers:  # no lock: a dict's truth is one read, and a watch made after it reads the view
            return
        with self._watch_lock:
            callbacks = self._watchers.pop(job_id, [])
        for callback in callbacks:
            callback()

    def unqueue(self, job: Job) -> None:
        """Under the lock: take a queued job out of the queue or the batch gathering it."""
        if job in self.pending:
            self.pending.remove(job)
        for forming in self.forming:
            if job in forming.jobs:
                forming.jobs.remove(job)

    def get(self, job_id: str) -> JobView | None:
        return self.views.get(job_id)

    def list(self, status: str | None = None, limit: int = 100, ticket: str | None = None,
             after: str | None = None) -> tuple[list[JobView], bool]:
        """(a page, whether more follow): newest first, optionally of one status, optionally the one
        job whose Flight ticket is `ticket` or the ticket of one of the extra streams it publishes
        (`stream_ticket`), exactly: `<ticket>:<anything else>` is no ticket of it. `after`: only the
        jobs that come after that one in this order; KeyError if there is no such job (any more)."""
        views = list(self.views.values())
        start = None if after is None else self.views[after]
        views = [v for v in views if (status is None or v.status == status)
                 and (ticket is None or (v.ticket != "" and ticket in _tickets(v)))
                 and (start is None or (v.created_at, v.id) < (start.created_at, start.id))]
        views.sort(key=lambda v: (v.created_at, v.id), reverse=True)
        return views[:limit], len(views) > limit

    def queue_depth(self) -> int:
        return len(self.pending) + sum(len(f.jobs) for f in list(self.forming))

    def status_counts(self) -> Counter[str]:
        return Counter(str(v.status) for v in list(self.views.values()))
