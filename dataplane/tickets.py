"""Tickets: the one place that mints them, and the registry that looks them up.

A ticket is opaque to every client: a random string, looked up here, never parsed. The
registry knows announced (reserved) rollouts, live and finished ones, partition tickets
and, for a while, why a ticket or id is gone ("released", "expired", "cancelled: ...").
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import NamedTuple

from sigmaflight.records import RolloutState

_PREFIX = "sft1_"
"""Starts every minted ticket, so that `is_minted` can check that a file's footer holds one;
clients never test for it (a ticket is opaque to them)."""
_MAX_GONE = 4096


def mint_ticket() -> str:
    """A new ticket: 144 random bits, URL-safe."""
    return _PREFIX + secrets.token_urlsafe(18)


STREAM_SEP = ":"
"""Joins a rollout's ticket and an extra stream's name (never in a minted ticket or a rollout id)."""


def stream_ticket(ticket: str, stream: str) -> str:
    """The ticket of one extra stream ("outputs", "conditioning") of the rollout ``ticket`` names.

    Whoever holds the rollout's ticket may read all its streams; the store looks the rollout
    part up like any ticket (so release and expiry end the extra streams with it)."""
    return f"{ticket}{STREAM_SEP}{stream}"


def split_stream_ticket(key: str, streams: tuple[str, ...]) -> tuple[str, str | None]:
    """(rollout ticket or id, stream name) of an extra stream's ticket; (key, None) for any other."""
    base, sep, name = key.rpartition(STREAM_SEP)
    if sep and base and name in streams:
        return base, name
    return key, None


def is_minted(ticket: str) -> bool:
    """Whether ``ticket`` has the shape mint_ticket gives (used to check a file footer)."""
    return ticket.startswith(_PREFIX) and len(ticket) > len(_PREFIX)


class TicketNotFound(KeyError):
    """Unknown, released or expired ticket / rollout id. ``str()`` names it and why."""

    def __init__(self, what: str, reason: str = "unknown", ended: RolloutState | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.reason = reason
        self.ended = ended
        """How the rollout ended, when the store still remembers it (cancelled while queued, released)."""

    def __str__(self) -> str:
        return f"{self.what} not found ({self.reason})"


class Gone(NamedTuple):
    """Why a ticket or rollout id names nothing (any more): how it ended, if known, and in words."""

    ended: RolloutState | None
    reason: str


UNKNOWN = Gone(None, "unknown")


class Resolved(NamedTuple):
    rollout_id: str
    start: int
    stride: int


class TicketRegistry:
    """ticket -> rollout id (plus partitions, reservations and why things are gone).

    Shares the store's lock so that a lookup and the entry table change together.
    """

    def __init__(self, lock: threading.RLock) -> None:
        self._tickets: dict[str, str] = {}  # ticket -> rollout id
        self._partitions: dict[str, Resolved] = {}
        self._gone: dict[str, Gone] = {}  # ticket or id -> why it is gone
        self._reserved: dict[str, str] = {}  # announced, not started: id -> ticket
        self._cond = threading.Condition(lock)

    def reserve(self, rollout_id: str) -> str:
        ticket = mint_ticket()
        self._reserved[rollout_id] = ticket
        self._tickets[ticket] = rollout_id
        self._gone.pop(rollout_id, None)
        return ticket

    def is_reserved(self, rollout_id: str) -> bool:
        return rollout_id in self._reserved

    def reserved_ticket(self, rollout_id: str) -> str | None:
        return self._reserved.get(rollout_id)

    def abandon(self, rollout_id: str, ended: RolloutState, message: str) -> bool:
        ticket = self._reserved.pop(rollout_id, None)
        if ticket is None:
            return False
        self._tickets.pop(ticket, None)
        self._gone[ticket] = self._gone[rollout_id] = Gone(ended, f"{ended}: {message}")
        self._cond.notify_all()
        return True

    def bind(self, rollout_id: str, ticket: str | None = None) -> str:
        """Register a started (or restored) rollout under its reserved, given or a new ticket."""
        ticket = self._reserved.pop(rollout_id, None) or ticket or mint_ticket()
        self._tickets[ticket] = rollout_id
        self._gone.pop(rollout_id, None)
        self._cond.notify_all()
        return ticket

    def partitions(self, rollout_id: str, ticket: str, n: int) -> list[str]:
        out = []
        for k in range(n):
            t = f"{ticket}.{n}.{k}"  # registry key; looked up, never parsed
            self._partitions[t] = Resolved(rollout_id, k, n)
            out.append(t)
        return out

    def resolve(
        self, key: str, known: Callable[[str], bool], should_stop: Callable[[], str | None]
    ) -> Resolved | Gone:
        """What ``key`` (a ticket, partition ticket or rollout id) names, or why it is not found.

        Waits while it names a reserved rollout (until ``create`` or ``abandon``, or until
        ``should_stop()`` names a reason: it is re-checked every 0.2 s, so a cancelled call
        or a stopping server ends the wait). The caller holds the lock; ``known(id)`` says
        whether the store has that entry.
        """
        rid = self._tickets.get(key) or (key if key in self._reserved or known(key) else None)
        while rid is not None and rid in self._reserved:
            why = should_stop()
            if why is not None:
                return Gone(None, why)
            self._cond.wait(timeout=0.2)
            rid = self._tickets.get(key) or (key if key in self._reserved or known(key) else None)
        if rid is not None and known(rid):
            return Resolved(rid, 0, 1)
        part = self._partitions.get(key)
        if part is not None and known(part.rollout_id):
            return part
        return self._gone.get(key, UNKNOWN)

    def rollout_of(self, ticket: str) -> str | None:
        """The rollout a whole-rollout ticket names (no waiting, no partitions)."""
        return self._tickets.get(ticket)

    def gone(self, key: str) -> Gone:
        return self._gone.get(key, UNKNOWN)

    def forget(self, rollout_id: str, ticket: str, ended: RolloutState, message: str | None = None) -> None:
        self._tickets.pop(ticket, None)
        for t in [t for t, p in self._partitions.items() if p.rollout_id == rollout_id]:
            del self._partitions[t]
        self._gone[ticket] = self._gone[rollout_id] = Gone(ended, f"{ended}: {message}" if message else str(ended))
        while len(self._gone) > _MAX_GONE:
            self._gone.pop(next(iter(self._gone)))

    def wake(self) -> None:
        """Wake every consumer waiting on a reserved ticket (they re-check should_stop)."""
        self._cond.notify_all()

    def clear(self) -> None:
        self._tickets.clear()
        self._partitions.clear()
        self._reserved.clear()
        self._cond.notify_all()
