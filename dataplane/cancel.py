"""Cancelling a pull that runs on another thread: ``PullScope``.

``AsyncClient``'s pulls run the blocking client in a thread (``asyncio.to_thread``). Cancelling the
task that awaits one must end its Flight stream too, or the thread keeps reading and the server
keeps the stream (one of its ``--max-flight-streams`` slots) until the rollout ends. The task sets
a scope for the call (``pull_scope``); the thread inherits it (``to_thread`` copies the context),
and every Flight stream the pull opens is registered there; ``cancel`` cancels them, and one opened
after it is cancelled as it opens.

What no scope can cut short: a ``do_get`` returns only once the server starts the stream (a queued
rollout's trajectory once it runs, the outputs once it has ended), and pyarrow's client call cannot
be interrupted; ``AsyncClient`` waits for that over REST first, where a cancel reaches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import pyarrow.flight as flight

_SCOPE: ContextVar[PullScope | None] = ContextVar("sigmaflight_pull_scope", default=None)


class PullScope:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: list[flight.FlightStreamReader] = []
        self.cancelled = False

    def add(self, reader: flight.FlightStreamReader) -> None:
        with self._lock:
            if not self.cancelled:
                self._readers.append(reader)
                return
        _cancel(reader)

    def cancel(self) -> None:
        """Cancel every stream opened in this scope, and any opened from now on."""
        with self._lock:
            self.cancelled = True
            readers, self._readers = self._readers, []
        for reader in readers:
            _cancel(reader)


@contextmanager
def pull_scope(scope: PullScope) -> Iterator[PullScope]:
    """``scope`` is the current context's inside the block; threads started with this context
    (``asyncio.to_thread``) see it."""
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def tracked(reader: flight.FlightStreamReader) -> flight.FlightStreamReader:
    """``reader``, registered with the current scope, if there is one."""
    scope = _SCOPE.get()
    if scope is not None:
        scope.add(reader)
    return reader


def cancelled() -> bool:
    """Whether the current scope was cancelled: a stream error in it is the cancel, nothing to
    look into."""
    scope = _SCOPE.get()
    return scope is not None and scope.cancelled


def _cancel(reader: flight.FlightStreamReader) -> None:
    try:
        reader.cancel()
    except (flight.FlightError, OSError):  # the stream ended already
        pass
