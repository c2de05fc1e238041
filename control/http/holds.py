"""Held status reads: `GET /v1/rollouts/{id}?wait_s=S` answers once the rollout has ended, or
after S seconds, whichever comes first.

A client that waits for a rollout (`Client.wait`) then reads its status about once per S seconds
instead of every few tens of milliseconds, and sees the end the moment it happens instead of up
to one poll later. A held read costs the server one asyncio future and a callback on the job
table (`JobTable.watch`), nothing a step: only the job's end wakes it. At most `limit` reads are
held at once (`--max-held-reads`); past it, and while the server shuts down, a read answers at
once, as one without `wait_s` does: the client's next read comes after its own pause. A read whose
client leaves (closes its connection) is let go at once, so a client that gives up does not keep
its place for the rest of its `wait_s`.
"""

from __future__ import annotations

import asyncio

from sigmaflight.control.jobs import JobManager
from starlette.types import Receive


class HeldReads:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: set[asyncio.Future[None]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._held)

    async def until_ended(self, jobs: JobManager, job_id: str, seconds: float, receive: Receive | None = None) -> None:
        """Return once the job has ended (or is gone), after `seconds`, or at once when `limit`
        reads are held already or the server is shutting down. `receive`: the request's ASGI
        receive (its body read or empty): return too once it reports the client gone."""
        if self._closed or len(self._held) >= self.limit:
            return
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # on the thread that published the end
            loop.call_soon_threadsafe(_settle, ended)

        gone: asyncio.Future[None] | None = None
        jobs.watch(job_id, wake)
        self._held.add(ended)
        try:
            view = jobs.get(job_id)  # after `watch`: an end published in between is seen here
            if view is None or not view.status.active:
                return
            if receive is not None:
                gone = asyncio.ensure_future(_disconnected(receive))
            await asyncio.wait([ended] if gone is None else [ended, gone], timeout=seconds,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if gone is not None:
                gone.cancel()
            self._held.discard(ended)
            jobs.unwatch(job_id, wake)

    def close(self) -> None:
        """The server is shutting down: every held read answers now, and no more are held
        (uvicorn waits for open requests before the jobs are stopped)."""
        self._closed = True
        for ended in list(self._held):
            _settle(ended)


async def _disconnected(receive: Receive) -> None:
    """Return once the client has left: ASGI's `http.disconnect` (what is left of the request's
    body, empty for a GET, is skipped), or the request cannot be read any more (e.g. a body over
    its limit: the read is not held for it)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # ends the hold; the answer goes out as for any held read
        return


def _settle(ended: asyncio.Future[None]) -> None:
    if not ended.done():
        ended.set_result(None)
