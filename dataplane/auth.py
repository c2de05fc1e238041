"""Bearer tokens, shared by both planes: parse the header (RFC 6750) and compare in constant time.

The REST middleware (control/) and the Flight middleware (dataplane/server.py) both call
these, so the two planes accept exactly the same headers; the clients (dataplane/client.py,
sigmaflight/client.py) send the one ``bearer_header`` makes.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

__all__ = ["TokenSet", "bearer_header", "bearer_token"]


def bearer_header(token: str | None) -> dict[str, str]:
    """The header a client sends with ``token``: ``{"authorization": "Bearer <token>"}``, or
    ``{}`` without one (a server without tokens)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def bearer_token(header: str | bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` value, or None when it is not one.

    The scheme is case-insensitive (RFC 6750 section 2.1); surrounding blanks are stripped.
    """
    if header is None:
        return None
    raw = header.encode("latin-1") if isinstance(header, str) else header
    scheme, _, token = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


class TokenSet:
    """The configured tokens; `matches` compares against every one (no early exit, never logged).

    `replace` swaps them for a reload (one reference assignment: a request checks against the
    old set or the new one, never a mix). It refuses an empty set: a reload never turns auth off."""

    def __init__(self, tokens: Collection[str]) -> None:
        self._tokens = [t.encode() for t in tokens if t]

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def replace(self, tokens: Collection[str]) -> None:
        new = [t.encode() for t in tokens if t]
        if not new:
            raise ValueError("no token in the new set; keeping the old one (a reload never turns auth off)")
        if not self._tokens:
            raise ValueError("auth is off on this server; restart it with tokens to turn it on")
        self._tokens = new

    def matches(self, header: str | bytes | None) -> bool:
        given = bearer_token(header)
        if given is None:
            return False
        ok = False
        for token in self._tokens:  # no early exit: the time does not tell which token nearly matched
            ok |= hmac.compare_digest(given, token)
        return ok
