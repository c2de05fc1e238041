"""The store's memory budget: bytes held in memory, and spilling finished ones to files.

Bytes "in memory" are the batches of running rollouts (heap) plus finished trajectories
held in memory, whether on the heap or as shared-memory files (``shm_dir``: tmpfs pages
are memory too). Over the budget, finished trajectories (oldest first) that have a
durable file are served memory-mapped from it instead (zero-copy) and stop counting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable, Iterable

from sigmaflight.dataplane.entry import Entry

from sigmaflight.records import RolloutState

log = logging.getLogger("sigmaflight.dataplane.store")

TRIM_MIN_BYTES = 16 << 20
"""Freeing at least this much gives the heap back to the OS (malloc_trim)."""


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6")
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        return lib
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc keeps it otherwise; field notes)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def trim_if_large(freed: int) -> None:
    if freed >= TRIM_MIN_BYTES:
        malloc_trim()


class MemoryBudget:
    """A byte counter with a limit; ``spill`` brings it back under the limit."""

    def __init__(self, limit_bytes: int, lock: threading.RLock) -> None:
        self.limit_bytes = int(limit_bytes)
        self._lock = lock
        self._used = 0
        self._warned = False

    @property
    def used(self) -> int:
        return self._used

    def add(self, delta: int) -> None:
        with self._lock:
            self._used += delta

    def reset(self) -> None:
        with self._lock:
            self._used = 0

    def spill(self, entries: Iterable[Entry], move_out: Callable[[Entry], bool]) -> None:
        """Move finished in-memory entries (oldest first) out of memory until under the limit.

        ``move_out(entry)`` serves the entry from its durable file and returns False when it
        has none (then nothing more can spill: a warning, once)."""
        freed = 0
        with self._lock:
            if self._used <= self.limit_bytes:
                return
            done = sorted(
                (e for e in entries if e.state is RolloutState.SUCCEEDED and e.in_memory), key=lambda e: e.finished_at or 0.0
            )
            for e in done:
                if self._used <= self.limit_bytes:
                    break
                nbytes = e.num_bytes + e.extra_bytes  # the extra streams spill with it
                if not move_out(e):
                    if not self._warned:
                        log.warning("store over its budget, with no data_dir to spill to",
                                    extra={"bytes": self._used, "budget_bytes": self.limit_bytes})
                        self._warned = True
                    break
                self._used -= nbytes
                freed += nbytes
                log.info("spilled rollout to its file", extra={"rollout": e.rollout_id, "bytes": nbytes, "path": str(e.path)})
        trim_if_large(freed)
