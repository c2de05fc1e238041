"""The contract's error body, `{"error": {"type", "message", "details"}}`, for every 4xx/5xx,
and the app's exception handlers: one per error class, so a route raises what went wrong
(a RolloutInputError, QueueFull, ...) and the mapping to a status lives here once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sigmaflight.control.branches import StaleParent
from sigmaflight.control.jobs import IdempotencyConflict, NotAccepting, QueueFull, Unavailable
from sigmaflight.pipeline.models import LoraNotLoaded, WeightsFailed
from sigmaflight.pipeline.spec import RolloutInputError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger("sigmaflight.http")


class HttpError(Exception):
    """Raised by a route for an answer no error class names; its handler writes the error body."""

    def __init__(
        self, status: int, type_: str, message: str, details: Any = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.details, self.headers = status, type_, message, details, headers


def error_body(type_: str, message: str, details: Any = None) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message, "details": details}}


def error_response(
    status: int, type_: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(type_, message, details), status_code=status, headers=headers
    )


def invalid(loc: list[str | int], msg: str, type_: str = "value_error") -> HttpError:
    """A 422 naming one field: `loc` starts with "body", "query" or "header"."""
    return HttpError(422, "validation_error", f"{'.'.join(map(str, loc[1:])) or loc[0]}: {msg}", [
        {"loc": loc, "msg": msg, "type": type_}
    ])


def _as_http(exc: Exception) -> HttpError:
    """The HttpError each error class stands for."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, RolloutInputError):
        return invalid(["body", *exc.loc], exc.reason)
    if isinstance(exc, QueueFull):
        return HttpError(429, "queue_full", f"the queue holds {exc.args[0]} rollouts already (--queue-size); "
                         "retry later", headers={"Retry-After": "1"})
    if isinstance(exc, IdempotencyConflict):
        return HttpError(409, "idempotency_conflict", "Idempotency-Key was already used with a different request body")
    if isinstance(exc, NotAccepting):
        return HttpError(503, "shutting_down", "the server is shutting down")
    if isinstance(exc, Unavailable):  # journal unwritable, no worker to place it on: nothing was accepted
        return HttpError(503, exc.type, exc.message, headers={"Retry-After": "1"})
    if isinstance(exc, StaleParent):
        return HttpError(409, "stale_parent", str(exc), {"parent": exc.parent, "parent_digest": exc.parent_digest,
                                                         "digest": exc.digest, "weights_version": exc.weights_version})
    if isinstance(exc, WeightsFailed):
        return HttpError(503, "weights_failed", str(exc), {"model": exc.model_id, "reason": exc.reason})
    if isinstance(exc, LoraNotLoaded):
        return HttpError(404, "lora_not_loaded", f"{exc.args[0] if exc.args else exc}; nothing to remove")
    raise TypeError(f"no HTTP mapping for {type(exc).__name__}")


async def on_error(request: Request, exc: Exception) -> Response:
    http = _as_http(exc)
    if http.status >= 500 or http.status in (409, 413, 429):
        log.warning("request refused", extra={"status": http.status, "type": http.type, "reason": http.message})
    return error_response(http.status, http.type, http.message, http.details, http.headers)


async def on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own (no route, method not allowed), in the contract's body."""
    assert isinstance(exc, HTTPException)
    kinds = {404: "not_found", 405: "method_not_allowed"}
    message = exc.detail if isinstance(exc.detail, str) else "error"
    if exc.status_code == 404:
        message = f"no route {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    headers = dict(exc.headers) if exc.headers else None
    return error_response(exc.status_code, kinds.get(exc.status_code, "http_error"), message, None, headers)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", extra={"path": request.url.path})
    return error_response(500, "internal_error", f"{type(exc).__name__}: {exc}")


EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    HttpError: on_error,
    RolloutInputError: on_error,
    QueueFull: on_error,
    IdempotencyConflict: on_error,
    NotAccepting: on_error,
    Unavailable: on_error,
    StaleParent: on_error,
    LoraNotLoaded: on_error,
    WeightsFailed: on_error,
    HTTPException: on_http_error,
    Exception: on_unexpected,
}
"""Starlette's `exception_handlers`: each error class a route may raise, and the catch-all."""
