"""The reaper: frees finished results past their TTL, forgets the oldest records beyond the
cap, and retries journal rows that could not be written, twice a second."""

from __future__ import annotations

import logging
import threading
import time

from sigmaflight.control.jobs.lifecycle import Lifecycle
from sigmaflight.control.jobs.table import JobTable

from sigmaflight.records import RolloutState

log = logging.getLogger("sigmaflight.jobs")


class Reaper:
    def __init__(self, table: JobTable, lifecycle: Lifecycle, ttl_s: float, keep_records: int) -> None:
        self.table = table
        self.lifecycle = lifecycle
        self.ttl_s = ttl_s
        self.keep_records = keep_records

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, name="sigmaflight-reaper", daemon=True)
        thread.start()
        return thread

    def _loop(self) -> None:
        while not self.table.stopped.wait(0.5):
            try:
                self.lifecycle.retry_journal()
                self.reap()
            except Exception:
                log.exception("reaper error")

    def reap(self, now: float | None = None) -> None:
        """Free finished results past their TTL and forget the oldest records beyond the cap."""
        now = time.time() if now is None else now
        table = self.table
        with table.lock:
            for job in list(table.jobs.values()):
                if (job.state.finished and not job.released and job.finished_at is not None
                        and now - job.finished_at > self.ttl_s):
                    # as a DELETE does: a succeeded one becomes expired, a failed or cancelled one
                    # keeps its status and error (the only word a trainer gets of why)
                    self.lifecycle.release(job)
                    log.info("rollout result freed (--ttl-s)", extra={"rollout": job.id, "status": job.state})
            done = [j for j in table.jobs.values() if not j.state.active]
            if len(done) > self.keep_records:
                # the longest ended first: a long rollout that ends after newer ones is not
                # dropped the moment it succeeds
                done.sort(key=lambda j: j.finished_at if j.finished_at is not None else j.created_at)
                for j in done[: len(done) - self.keep_records]:
                    # what the record held goes with it: with no record left, neither the TTL
                    # nor a DELETE could release it, and Flight would serve what REST calls unknown
                    if j.state.finished:
                        self.lifecycle.backend.release(j.id)
                    if j.state is RolloutState.SUCCEEDED and j.finished_here:  # counted as the TTL's and a DELETE's are
                        table.counters["rollouts_expired"] += 1
                    table.forget(j)
                    self.lifecycle.delete_row(j.id)
                    log.info("rollout record dropped (--max-records)", extra={"rollout": j.id, "status": j.state})
