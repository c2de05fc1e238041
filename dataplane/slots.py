"""The Flight server's stream slots: at most ``max_concurrent_streams`` open do_get streams,
and the counters its metrics report (streams open, streams and bytes served).

A do_get takes a slot before it looks its ticket up (a consumer waiting for a queued rollout
holds one too) and gives it back when the stream ends: when gRPC says the call is over
(``CallSlot``, the server's "slots" middleware: one Python call per stream, none per batch),
or when the slot is dropped (``weakref.finalize``), whichever comes first.
"""

from __future__ import annotations

import threading
import weakref

import pyarrow.flight as flight
from sigmaflight.dataplane.errors import flight_error


class StreamSlots:
    """The slots of one server and what they served; safe to call from any gRPC thread."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self._lock = threading.Lock()
        self.active = 0
        self.streams_served = 0
        self.bytes_served = 0

    def take(self) -> StreamSlot:
        """A slot for a new stream, or a "too_many_streams" Flight error (the client retries later)."""
        with self._lock:
            if self.active >= self.limit:
                raise flight_error("too_many_streams",
                    f"too many concurrent streams ({self.active} of max_concurrent_streams="
                    f"{self.limit}); retry later"
                )
            self.active += 1
            self.streams_served += 1
        return StreamSlot(self)

    def returned(self) -> None:
        with self._lock:
            self.active -= 1

    def count_bytes(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_served += nbytes

    def metrics(self) -> dict[str, int]:
        with self._lock:
            return {
                "active_streams": self.active,
                "bytes_served": self.bytes_served,
                "streams_served": self.streams_served,
            }


class StreamSlot:
    """Holds one of the slots; freed once, when the stream ends or is dropped."""

    def __init__(self, slots: StreamSlots) -> None:
        self._fin = weakref.finalize(self, slots.returned)

    def free(self) -> None:
        self._fin()


class CallSlot(flight.ServerMiddleware):
    """Frees a do_get's stream slot when gRPC says the call is over (finished, failed or the
    client went away): one Python call per stream, none per batch. A whole table handed to C++
    (`whole`: its slots, bytes and the call's context) is counted as served once the call ends
    neither failed nor cancelled, that is once the server wrote it all to gRPC (Arrow ends a
    cancelled call without an error; its context, still alive here, says it was cancelled). A
    table gRPC buffered whole for a consumer that then stopped reading counts: it was sent."""

    def __init__(self) -> None:
        self.slot: StreamSlot | None = None
        self.whole: tuple[StreamSlots, int, flight.ServerCallContext] | None = None

    def call_completed(self, exception: BaseException | None) -> None:
        whole, self.whole = self.whole, None  # the context is not touched after its call
        if whole is not None and exception is None:
            slots, nbytes, context = whole
            if not context.is_cancelled():
                slots.count_bytes(nbytes)
        if self.slot is not None:
            self.slot.free()


class CallSlotFactory(flight.ServerMiddlewareFactory):
    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> CallSlot | None:
        return CallSlot() if info.method == flight.FlightMethod.DO_GET else None
