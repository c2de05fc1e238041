"""The contract's error body, `{"error": {"type", "message", "details"}}`, for every 4xx/5xx."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class HttpError(Exception):
    """Raised by a route; the app's exception handler turns it into the error body."""

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
    """A 422 naming one field: `loc` starts with "body" or "query"."""
    return HttpError(422, "validation_error", f"{'.'.join(map(str, loc[1:])) or loc[0]}: {msg}", [
        {"loc": loc, "msg": msg, "type": type_}
    ])
