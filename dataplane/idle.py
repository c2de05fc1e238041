"""A Flight stream's record batches, read under an idle timeout: ``flight_batches``.

A pull waits for a running rollout's next step; ``idle_timeout`` bounds that wait (not the
time the consumer spends between batches): ``IdleWatch`` cancels the stream when one read
waits longer, and the pull raises TimeoutError.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as flight
from sigmaflight.dataplane.errors import server_words


def flight_batches(reader: flight.FlightStreamReader, idle_timeout: float | None = None) -> Iterator[pa.RecordBatch]:
    """The stream's record batches (a Flight error on the way carries the server's words alone).
    ``idle_timeout``: seconds to wait for the next batch (the
    time the consumer spends between batches does not count); past it the stream is cancelled
    and TimeoutError raised. None: wait as long as the stream stays open."""
    if idle_timeout is None:
        while True:
            try:
                with server_words():
                    chunk = reader.read_chunk()
            except StopIteration:
                return
            yield chunk.data
    watch = IdleWatch(reader, idle_timeout)
    try:
        while True:
            try:
                with watch, server_words():
                    chunk = reader.read_chunk()
            except StopIteration:
                return
            except (flight.FlightError, pa.ArrowException) as exc:
                if watch.fired:
                    raise TimeoutError(f"no record batch for {idle_timeout:g} s (idle_timeout): the stream was "
                                       "cancelled") from exc
                raise
            yield chunk.data
    finally:
        watch.stop()


class IdleWatch:
    """Cancels ``reader`` when one read (``with watch: reader.read_chunk()``) waits longer than
    ``idle_timeout`` seconds; ``fired`` says it did. One thread per stream, started on first use."""

    def __init__(self, reader: flight.FlightStreamReader, idle_timeout: float) -> None:
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds or None, got {idle_timeout!r}")
        self.reader, self.idle = reader, float(idle_timeout)
        self.fired = False
        self._since: float | None = None
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> IdleWatch:
        self._since = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sigmaflight-idle-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._since = None

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            since = self._since
            left = self.idle if since is None else since + self.idle - time.monotonic()
            if since is not None and left <= 0:
                self.fired = True
                try:
                    self.reader.cancel()
                except (flight.FlightError, OSError):
                    pass
                return
            self._wake.wait(left)

