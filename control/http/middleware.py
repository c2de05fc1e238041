"""Pure ASGI middleware: request ids, bearer-token auth, request body limits (size and time)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections.abc import Collection, Sequence

from prometheus_client import Counter as PromCounter
from sigmaflight.control.http.errors import error_body
from sigmaflight.dataplane.auth import TokenSet
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("sigmaflight.http")


def new_request_id() -> str:
    """A request id for a request that brought none: 32 hex digits, as random as uuid4().hex
    without building a UUID."""
    return secrets.token_hex(16)


async def send_error(
    send: Send, status: int, type_: str, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(error_body(type_, message)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Gives every request an id (or keeps the caller's X-Request-ID), echoes it, counts responses,
    and is the catch-all of errors.

    A client that leaves before its body arrived (ClientDisconnect while a route reads it) is
    logged at info and answered with nothing: no one is left to read a response, and it is no
    server error (nothing counted, nothing reaches the 500 handler).

    An exception nothing mapped to an answer is logged with its traceback and answered 500
    `internal_error`, with the request id and counted, and the connection stays open. (Starlette's
    own catch-all answers and then raises it again, and uvicorn then closes the connection: the
    client's next request on it failed as if the server were gone.) Here, not in a middleware of
    its own: this one already sees the response start, and every request pays for each layer."""

    def __init__(self, app: ASGIApp, responses: PromCounter | None = None) -> None:
        self.app = app
        self.responses = responses
        """sigmaflight_http_responses{method, code}, counted as each response starts."""
        self._children: dict[tuple[str, int], PromCounter] = {}

    def _counter(self, method: str, status: int) -> PromCounter:
        """The counter of (method, status), looked up once (`labels` checks and locks each time)."""
        child = self._children.get((method, status))
        if child is None:
            assert self.responses is not None
            child = self._children[(method, status)] = self.responses.labels(method=method, code=str(status))
        return child

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                rid = v.decode("latin-1")[:128]
        rid = rid or new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                if self.responses is not None:
                    self._counter(scope["method"], message["status"]).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            log.info(
                "client disconnected before its request body arrived",
                extra={"method": scope["method"], "path": scope["path"], "request_id": rid},
            )
        except Exception as exc:
            log.exception("unhandled error", extra={"method": scope["method"], "path": scope["path"], "request_id": rid})
            if started:  # half an answer is out: only closing the connection ends it
                raise
            await send_error(send_with_id, 500, "internal_error", f"{type(exc).__name__}: {exc}")


class _TrackedSend:
    """An ASGI `send` that notes whether the response has started (after that, an error can only
    close the connection)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)


class BearerAuthMiddleware:
    """Every route but the open ones needs `Authorization: Bearer <token>`; compared in constant time."""

    def __init__(
        self, app: ASGIApp, tokens: TokenSet | Collection[str], open_paths: Collection[str] = ("/healthz",)
    ) -> None:
        self.app = app
        self.tokens = tokens if isinstance(tokens, TokenSet) else TokenSet(tokens)  # a TokenSet: reloadable
        self.open_paths = set(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tokens or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if not self.tokens.matches(header):
            reason = "missing bearer token" if header is None else "invalid bearer token"
            await send_error(send, 401, "unauthorized", reason, [(b"www-authenticate", b'Bearer realm="sigmaflight"')])
            return
        await self.app(scope, receive, send)


class _TooLarge(Exception):
    """The request body went over its limit."""


class _TooSlow(Exception):
    """The request body did not arrive in time."""


class BodyLimitMiddleware:
    """Bounds what a request body may hold: its size and how long it takes to arrive.

    Size: over `max_bytes`, 413, by Content-Length up front or while streaming. `path_limits`:
    (method, path regex, limit, flag) that give matching routes their own limit (the weights
    upload gets --max-weights-bytes); the first match wins. The 413 message names the flag that
    raises the limit (`flag`: --max-body-bytes for the rest).

    Time: with `timeout_s`, the whole body must have arrived `timeout_s` seconds after the request's
    headers did (uvicorn itself has no body read timeout: a client trickling one byte a
    second would hold its request forever); past it, 408 `request_timeout` (the route is left
    where it waited; the connection closes, as its body was not read to the end).
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: Sequence[tuple[str, str, int, str]] = (),
        flag: str = "--max-body-bytes", timeout_s: float | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.flag = flag
        self.path_limits = [(m, re.compile(p), n, f) for m, p, n, f in path_limits]
        self.timeout_s = timeout_s

    def _limit(self, scope: Scope) -> tuple[int, str]:
        for method, pattern, limit, flag in self.path_limits:
            if scope["method"] == method and pattern.fullmatch(scope["path"]):
                return limit, flag
        return self.max_bytes, self.flag

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, flag = self._limit(scope)
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    await send_error(send, 400, "bad_request", "Content-Length is not a number")
                    return
                if declared > max_bytes:
                    await send_error(send, 413, "body_too_large", self._message(declared, max_bytes, flag))
                    return
        seen = 0
        complete = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s if self.timeout_s is not None else None

        async def limited_receive() -> Message:
            nonlocal seen, complete
            if complete or deadline is None:  # after the body: only the disconnect is left to wait for
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise _TooSlow from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > max_bytes:
                    raise _TooLarge
            return message

        tracked = _TrackedSend(send)
        try:
            await self.app(scope, limited_receive, tracked)
        except _TooLarge:
            if not tracked.started:
                await send_error(send, 413, "body_too_large", self._message(seen, max_bytes, flag))
        except _TooSlow:
            log.info("request body too slow; answered 408",
                     extra={"method": scope["method"], "path": scope["path"], "bytes": seen,
                            "request_id": scope.get("state", {}).get("request_id")})
            if not tracked.started:
                await send_error(send, 408, "request_timeout",
                                 f"the request body did not arrive within {self.timeout_s:g} s "
                                 f"({seen} bytes came); send it faster or raise --body-timeout-s",
                                 [(b"connection", b"close")])

    def _message(self, size: int, limit: int, flag: str) -> str:
        return f"request body of {size} bytes or more exceeds the limit of {limit} bytes ({flag})"
