"""The data plane's error contract: every Flight error the server raises carries a JSON object
in pyarrow's `FlightError.extra_info`, so clients branch on its type, never on message text.

    {"type": "not_found" | "failed" | "cancelled" | "released" | "expired" | "closed"
             | "too_many_streams" | "bad_request" | "unauthenticated"
             | "bad_weights" | "conflict"  (a weights push: dataplane/weights.py),
     "rollout": id or null, ...}  (plus "reason", "stream", "ended" where they apply)

The Flight error class follows the type (FlightInternalError for a failed rollout,
FlightUnavailableError for too many streams, FlightUnauthenticatedError for a refused token,
FlightServerError otherwise; never FlightCancelledError: pyarrow turns an ArrowCancelled
raised inside `reader.read_all()` into a SIGINT, i.e. a KeyboardInterrupt in the trainer).
The message is for people; `error_info` reads the object back on the client side, and
`server_message` the server's own words (pyarrow appends gRPC's debug context to them).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pyarrow.flight as flight
from sigmaflight.dataplane.entry import RolloutEnded
from sigmaflight.dataplane.tickets import TicketNotFound

from sigmaflight.records import STREAM_ENDS

__all__ = ["ERROR_TYPES", "error_info", "flight_error", "not_found", "rollout_ended", "server_message", "server_words"]

ERROR_TYPES = ("not_found", *STREAM_ENDS, "too_many_streams", "bad_request", "unauthenticated", "bad_weights",
               "conflict")

_CLASSES: dict[str, type[flight.FlightError]] = {
    "failed": flight.FlightInternalError,
    "too_many_streams": flight.FlightUnavailableError,
    "unauthenticated": flight.FlightUnauthenticatedError,
}

MAX_MESSAGE = 1000
"""Characters of a message at most: a much longer one (some KiB) makes gRPC drop the status and
the client lose the Flight error type (pyarrow raises a bare OSError instead). Callers clip the
client input they echo far shorter."""


def flight_error(type_: str, message: str, *, rollout: str | None = None, **extra: Any) -> flight.FlightError:
    """The Flight error of kind `type_` (one of ERROR_TYPES), with its JSON in `extra_info`."""
    if type_ not in ERROR_TYPES:
        raise ValueError(f"unknown Flight error type {type_!r}")
    info = {"type": type_, "rollout": rollout, **extra}
    message = clip(message)
    return _CLASSES.get(type_, flight.FlightServerError)(message, extra_info=json.dumps(info).encode())


def rollout_ended(e: RolloutEnded) -> flight.FlightError:
    """A stream that cannot go on: the rollout failed, was cancelled, released or expired."""
    return flight_error(e.state, str(e), rollout=e.rollout_id, reason=clip(e.message, 300))


def not_found(e: TicketNotFound) -> flight.FlightError:
    """An unknown, released or expired ticket or rollout id; "ended" says how, when the store
    still remembers that the rollout ended ("cancelled" for one cancelled while queued, say)."""
    message = f"{clip(e.what, 200)} not found ({clip(e.reason, 300)})"  # the id echoes client input: clipped
    ended = None if e.ended is None else str(e.ended)
    return flight_error("not_found", message, reason=clip(e.reason, 300), ended=ended)


def error_info(exc: BaseException) -> dict[str, Any] | None:
    """The JSON object a sigmaflight Flight server put in `exc.extra_info`; None for any other error."""
    raw = getattr(exc, "extra_info", None)
    if not raw:
        return None
    try:
        info = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("type"), str) else None


_DEBUG_TAILS = (". Detail:", ". gRPC client debug context", "gRPC client debug context", ". Client context:")
_PREFIXES = ("Flight returned internal error, with message: ", "with message: ")


def server_message(exc: BaseException) -> str:
    """The server's own message out of a pyarrow Flight error: what pyarrow adds after it
    ("Detail: ...", "gRPC client debug context: ...", "Client context: ...") and before it
    ("Flight returned ... with message: ") cut off."""
    text = str(exc)
    for cut in _DEBUG_TAILS:
        text = text.split(cut, 1)[0]
    for prefix in _PREFIXES:
        if prefix in text:
            text = text.split(prefix, 1)[1]
    return text.strip()


@contextlib.contextmanager
def server_words() -> Iterator[None]:
    """Re-raise a Flight error raised inside as the same class with the same `extra_info`, its
    message `server_message` (no gRPC debug context): what a data-plane client shows its user."""
    try:
        yield
    except flight.FlightError as exc:
        raise type(exc)(server_message(exc), extra_info=exc.extra_info) from None


def clip(message: str, limit: int = MAX_MESSAGE) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."
