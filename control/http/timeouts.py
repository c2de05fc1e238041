"""uvicorn's h11 protocol with a header read timeout.

uvicorn times out only an idle kept-alive connection (`timeout_keep_alive`). A connection that
sends nothing, or trickles its request line and headers a byte at a time, is held forever (h11
only bounds their size, `h11_max_incomplete_event_size`, 16 KiB). Here the request line and
headers must arrive within `header_timeout_s`: counted from the connection (for the first
request) or from the first byte of the next one on a kept-alive connection. Past it the server
answers 408 with the contract's error body and a new x-request-id (as every response carries
one) and closes the connection. The body has its own
limit in the app (BodyLimitMiddleware, --body-timeout-s).

Passed to uvicorn as `uvicorn.Config(http=header_timeout_protocol(seconds))`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import h11
from sigmaflight.control.http.errors import error_body
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("sigmaflight.http")


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers take longer than `header_timeout_s`."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # bytes of a request whose headers are not all in
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # h11 has parsed the request line and headers
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        request_id = uuid.uuid4().hex  # as RequestIdMiddleware gives one: the caller's header was never read
        log.info("request headers too slow; connection closed with a 408",
                 extra={"client": f"{self.client[0]}:{self.client[1]}" if self.client else None,
                        "timeout_s": self.header_timeout_s, "request_id": request_id})
        body = json.dumps(error_body(
            "request_timeout",
            f"the request line and headers did not arrive within {self.header_timeout_s:g} s "
            "(--header-timeout-s)")).encode()
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id.encode()), (b"connection", b"close")])) or b"")
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:  # h11 cannot answer in its state: closing is the answer
            pass
        self.transport.close()


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with this header timeout."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": float(seconds)})
