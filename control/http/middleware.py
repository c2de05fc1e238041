"""Pure ASGI middleware: request ids, bearer-token auth, request body limit."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections import Counter
from collections.abc import Collection, Sequence

from sigmaflight.control.http.errors import error_body
from sigmaflight.dataplane.auth import TokenSet
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("sigmaflight.http")


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
    """Gives every request an id (or keeps the caller's X-Request-ID), echoes it, counts responses.

    A client that leaves before its body arrived (ClientDisconnect while a route reads it) is
    logged at info and answered with nothing: no one is left to read a response, and it is no
    server error (nothing counted, nothing reaches the 500 handler)."""

    def __init__(self, app: ASGIApp, counts: Counter[str] | None = None) -> None:
        self.app = app
        self.counts = counts if counts is not None else Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                rid = v.decode("latin-1")[:128]
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                self.counts[f'{scope["method"]},{message["status"]}'] += 1
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            log.info(
                "client disconnected before its request body arrived",
                extra={"method": scope["method"], "path": scope["path"], "request_id": rid},
            )


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


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` with 413, by Content-Length up front or while streaming.

    `path_limits`: (method, path regex, limit, flag) that give matching routes their own limit
    (the weights upload gets --max-weights-bytes); the first match wins. The 413 message names
    the flag that raises the limit (`flag`: --max-body-bytes for the rest).
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: Sequence[tuple[str, str, int, str]] = (),
        flag: str = "--max-body-bytes",
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.flag = flag
        self.path_limits = [(m, re.compile(p), n, f) for m, p, n, f in path_limits]

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
        started = False

        class TooLarge(Exception):
            pass

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except TooLarge:
            if not started:
                await send_error(send, 413, "body_too_large", self._message(seen, max_bytes, flag))

    def _message(self, size: int, limit: int, flag: str) -> str:
        return f"request body of {size} bytes or more exceeds the limit of {limit} bytes ({flag})"
