"""What a `Client` (and `AsyncClient`, and the command line through them) is made with, checked
when it is made: each refusal a `SettingError` naming the setting, before any request."""

from __future__ import annotations

import math
import numbers

import httpx

from sigmaflight.errors import Picklable

__all__ = ["SettingError", "check_timeout", "check_token", "check_url"]


class SettingError(Picklable, ValueError):
    """A Client setting that cannot work, refused when the Client is made: `.name` ("url",
    "token" or "timeout") and `.reason` (the `sigmaflight` command names its flag with them).
    A token is never shown."""

    def __init__(self, name: str, reason: str, shown: str | None = None) -> None:
        super().__init__(f"{name} {shown}: {reason}" if shown is not None else f"{name}: {reason}")
        self.name, self.reason, self.shown = name, reason, shown


def check_url(url: str) -> str:
    """The REST URL without its trailing slash; SettingError when httpx cannot parse it or it is
    not http(s)://."""
    if not isinstance(url, str):
        raise SettingError("url", f"must be a string, got {type(url).__name__}")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise SettingError("url", f"not a URL ({exc})", shown=url) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SettingError("url", "the REST URL is http://HOST:PORT or https://HOST:PORT", shown=url)
    if parsed.port is not None and not 0 < parsed.port < 65536:  # httpx takes any number; a socket does not
        raise SettingError("url", f"port {parsed.port} is not a TCP port (1..65535)", shown=url)
    return url.rstrip("/")


def check_token(token: str | None) -> str | None:
    """The bearer token to send, without the blanks around it (a token read from a file keeps its
    newline; the server strips its token file's lines too); SettingError when what is left cannot
    be an HTTP header's value (empty, not printable ASCII, or holding a blank)."""
    if token is None:
        return None
    if not isinstance(token, str):
        raise SettingError("token", f"must be a string, got {type(token).__name__}")
    token = token.strip()
    if not token:
        raise SettingError("token", "empty (None sends none)")
    if not all(" " < c <= "~" for c in token):
        raise SettingError("token", "must be printable ASCII without blanks (an HTTP header's value)")
    return token


def check_timeout(timeout: float | None) -> float | None:
    """A REST timeout in seconds: a positive number, or None or inf for no limit (None then)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise SettingError("timeout", f"must be a positive number of seconds, or None for no limit, got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)
