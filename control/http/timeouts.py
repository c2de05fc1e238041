"""uvicorn's httptools HTTP protocol with a header read timeout and a header size bound.

uvicorn times out only an idle kept-alive connection (`timeout_keep_alive`). A connection that
sends nothing, or trickles its request line and headers a byte at a time, is held forever, and
httptools puts no bound on their size. Here the request line and
headers must arrive within `header_timeout_s`: counted from the connection (for the first
request) or from the first byte of the next one on a kept-alive connection. Past it the server
answers 408 with the contract's error body and a new x-request-id (as every response carries
one) and closes the connection. The body has its own
limit in the app (BodyLimitMiddleware, --body-timeout-s).

Passed to uvicorn as `uvicorn.Config(http=header_timeout_protocol(seconds))`. httptools (a
dependency of the server extra) parses a request in a fraction of h11's time: a status GET costs
the server about 0.23 ms of CPU with it against 0.40 ms with h11 (ops/bench_batching.py
--server-cpu polls statuses every 20 ms).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from prometheus_client import Counter as PromCounter
from sigmaflight.control.http.errors import error_body
from sigmaflight.control.http.middleware import new_request_id
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("sigmaflight.http")


def _timed_out(client: tuple[str, int] | None, timeout_s: float) -> tuple[str, bytes]:
    """Log a connection whose headers were too slow; its request id and the 408's error body."""
    request_id = new_request_id()  # as RequestIdMiddleware gives one: the caller's header was never read
    log.info("request headers too slow; connection closed with a 408",
             extra={"client": f"{client[0]}:{client[1]}" if client else None, "timeout_s": timeout_s,
                    "request_id": request_id})
    body = json.dumps(error_body(
        "request_timeout",
        f"the request line and headers did not arrive within {timeout_s:g} s (--header-timeout-s)")).encode()
    return request_id, body


UNKNOWN_METHOD = "unknown"
"""The `method` label of an answer given before the request line's method was read."""


MAX_HEADER_BYTES = 16 * 1024
"""The request line and headers of one request at most (h11's default bound; httptools has none of
its own): past it, 400 and the connection closed."""


class HeaderTimeoutHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that closes a connection whose request headers take longer than
    `header_timeout_s` (from the connection, or from the first byte of the next request) or
    exceed MAX_HEADER_BYTES."""

    header_timeout_s: float = 10.0
    responses: PromCounter | None = None
    """sigmaflight_http_responses{method, code}: what is answered here, below the app's middleware,
    is counted as the app's answers are."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True
        """A request's line and headers are due: the connection's first, or a next one begun on a
        kept-alive connection. Not while a request is handled (its answer may take long: a held
        status read, a weights file staged) nor while the connection is idle between requests
        (uvicorn's keep-alive timeout closes that)."""
        self._oversized: str | None = None
        """The header (lower case; "" for the request line) that crossed MAX_HEADER_BYTES."""
        self._method = UNKNOWN_METHOD
        """The method of the request being read, once its request line has begun."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._awaiting_headers and not self.transport.is_closing():  # a request's headers are not all in
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._awaiting_headers = True
        self._method = UNKNOWN_METHOD

    def on_url(self, url: bytes) -> None:
        self._method = self.parser.get_method().decode("latin-1")
        self._count(len(url), None)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value), name)
        super().on_header(name, value)

    def _count(self, n: int, header: bytes | None) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:  # the parser stops; uvicorn calls send_400_response
            self._oversized = header.decode("latin-1").lower() if header is not None else ""
            raise ValueError(f"request line and headers over {MAX_HEADER_BYTES} bytes")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (its text/plain line, replaced by the
        contract's error body); for headers over MAX_HEADER_BYTES a 431 naming the header that
        crossed the bound."""
        if self._oversized is None:
            body = json.dumps(error_body("bad_request", f"the request is not valid HTTP/1.1 ({msg})")).encode()
            self._answer(b"400 Bad Request", body, new_request_id())
            return
        name, self._oversized = self._oversized, None
        where = f"header {name!r}" if name else "the request line"
        reason = f"the request line and headers are over {MAX_HEADER_BYTES} bytes (at {where})"
        loc = ["header", name] if name else ["url"]
        body = json.dumps(error_body("validation_error", reason,
                                     [{"loc": loc, "msg": reason, "type": "string_too_long"}])).encode()
        self._answer(b"431 Request Header Fields Too Large", body, new_request_id())

    def _answer(self, status: bytes, body: bytes, request_id: str) -> None:
        """Answer here, below the app: the JSON error body, the request id, the connection
        closed, and the answer counted."""
        self.transport.write(b"".join([
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n" % status,
            b"content-length: %d\r\nx-request-id: %s\r\nconnection: close\r\n\r\n" % (len(body), request_id.encode()),
            body]))
        self.transport.close()
        if self.responses is not None:
            self.responses.labels(method=self._method, code=status.split()[0].decode()).inc()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_headers = False  # until the next request's first byte (on_message_begin)

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
        if not self._awaiting_headers or self.transport.is_closing():
            return
        request_id, body = _timed_out(self.client, self.header_timeout_s)
        self._answer(b"408 Request Timeout", body, request_id)


def header_timeout_protocol(seconds: float, responses: PromCounter | None = None) -> type[asyncio.Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with this header timeout, counting what it
    answers itself in `responses`."""
    return type("HeaderTimeoutHttpToolsProtocol", (HeaderTimeoutHttpToolsProtocol,),
                {"header_timeout_s": float(seconds), "responses": responses})
