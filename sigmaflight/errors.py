"""Typed client errors: what `sigmaflight.Client` raises, REST or Flight alike.

Each carries the server's own message (`.message`) and nothing of the transport's debug
text (no "gRPC client debug context"), so `str(exc)` is fit to show a user:

- `ApiError`: any refusal: `.status` (HTTP status; None for a Flight-only error), `.type`
  (the contract's error type), `.message`, `.details`.
- `NotFound` (404 / unknown ticket) and `Unauthorized` (401 / Flight unauthenticated) are
  ApiErrors.
- `ServerUnreachable`: no answer at the REST URL (connection refused, DNS, TLS, a time-out, or
  something there that does not speak HTTP, such as the Flight port); an ApiError with
  `.status` None and `.type` "unreachable".
- `RolloutFailed`: the rollout ended failed or expired (`wait`, `pull`); `.rollout` is its last
  RolloutStatus when known. `RolloutCancelled` is the RolloutFailed of a cancelled rollout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sigmaflight.wire import RolloutStatus

__all__ = [
    "ApiError", "NotFound", "RolloutCancelled", "RolloutFailed", "ServerUnreachable", "Unauthorized",
    "WeightsMismatch",
]


def rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An error as it was pickled, made without its `__init__` (see `Picklable`)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class Picklable:
    """Pickles an exception whose `__init__` takes other arguments than the message it passes on:
    BaseException's own pickling calls `cls(*args)` (a trainer's process pool hands what its
    workers raise to the parent pickled)."""

    def __reduce__(self) -> tuple[Any, ...]:
        assert isinstance(self, BaseException)
        return rebuilt, (type(self), self.args, self.__dict__)


class ApiError(Picklable, RuntimeError):
    """A refusal from the server: `status`, and the contract's error body's `type`, `message`, `details`."""

    def __init__(self, status: int | None, type_: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {type_}: {message}" if status is not None else f"{type_}: {message}")
        self.status, self.type, self.message, self.details = status, type_, message, details


class NotFound(ApiError):
    """No such rollout, ticket or model (HTTP 404, or a Flight ticket the server does not know)."""


class Unauthorized(ApiError):
    """Missing or wrong bearer token (HTTP 401, or Flight unauthenticated)."""


class ServerUnreachable(ApiError):
    """The REST URL gave no HTTP answer (refused, unresolvable, TLS failure, time-out, not HTTP).

    Raised by `Client` in place of httpx's transport errors; the original is its `__cause__`."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(None, "unreachable", f"cannot reach {url}: {reason}")
        self.url = url

    def __str__(self) -> str:
        return self.message


class RolloutFailed(ApiError):
    """The rollout ended other than succeeded; `.rollout` is its last RolloutStatus (None if unknown)."""

    def __init__(self, message: str, rollout: RolloutStatus | None = None, type_: str = "rollout_failed") -> None:
        super().__init__(None, type_, message)
        self.rollout = rollout

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_status(cls, status: RolloutStatus, server_message: str | None = None) -> RolloutFailed:
        """The right class (RolloutCancelled for a cancelled rollout) with the server's reason: the
        status's error, else `server_message` (what the Flight server said), else the status alone."""
        kind = RolloutCancelled if status.status == "cancelled" else RolloutFailed
        if status.error:
            message = f"rollout {status.id} {status.status}: {status.error.type}: {status.error.message}"
        else:
            message = server_message or f"rollout {status.id} {status.status}"
        return kind(message, rollout=status)


class RolloutCancelled(RolloutFailed):
    """The rollout was cancelled (by a client, or stopped by the server) before it finished."""

    def __init__(self, message: str, rollout: RolloutStatus | None = None, type_: str = "rollout_cancelled") -> None:
        super().__init__(message, rollout, type_)


class WeightsMismatch(UserWarning):
    """`replay_log_probs` on a trajectory made with other weights than the replaying model's."""
