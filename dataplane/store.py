"""ResultStore: trajectories by rollout id, live streams, byte budget, spill, durability.

- A rollout is created live (``create``); its writer appends record batches that any
  number of consumers follow (``Entry.iter_batches``: a Condition, no busy-wait). All
  consumers share the same batches (no copy per consumer).
- With ``data_dir``, every trajectory is written through to
  ``<data_dir>/trajectories/<id>.arrow.partial`` as it is produced and atomically renamed
  to ``<id>.arrow`` (after fsync) when it finishes, so a finished trajectory survives
  kill -9. A new store on the same directory serves it again under the same id and
  ticket (kept in the file footer's custom metadata, not in the schema).
- When bytes in memory exceed ``memory_budget_bytes``, finished trajectories (oldest
  first) are dropped from memory and served memory-mapped from their file (zero-copy).
- TTL: finished entries older than ``ttl_s`` are dropped (lazily and by ``expire_now``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, NamedTuple

import pyarrow as pa

from dataplane.codec import DEFAULT_MAX_BATCH_BYTES, encode_step
from dataplane.files import TEMP_SUFFIX, CorruptTrajectoryFile, TrajectoryFileWriter, read_trajectory
from dataplane.record import StepBatch, TrajectoryHeader
from dataplane.schema import header_from_schema, trajectory_schema

log = logging.getLogger(__name__)

State = Literal["running", "succeeded", "failed", "cancelled"]
EndedState = Literal["failed", "cancelled", "released", "expired", "closed"]

TICKET_PREFIX = "sft1_"
_FOOTER_TICKET = "sigmaflight.ticket"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TRIM_MIN_BYTES = 16 << 20
_MAX_GONE = 4096


def malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc keeps it otherwise; field notes)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6")
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        return lib
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


class TicketNotFound(KeyError):
    """Unknown, released or expired ticket / rollout id. ``str()`` names it and why."""

    def __init__(self, what: str, reason: str = "unknown") -> None:
        super().__init__(what)
        self.what = what
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.what} not found ({self.reason})"


class RolloutEnded(Exception):
    """A stream cannot go on: the rollout failed, was cancelled, released or expired."""

    def __init__(self, rollout_id: str, state: str, message: str) -> None:
        super().__init__(f"rollout {rollout_id} {state}: {message}")
        self.rollout_id = rollout_id
        self.state = state
        self.message = message


class EntryInfo(NamedTuple):
    state: str
    num_rows: int
    num_bytes: int
    steps: tuple[int, ...]


class Entry:
    """One rollout in the store. Batches are append-only while running."""

    def __init__(self, header: TrajectoryHeader, schema: pa.Schema, ticket: str) -> None:
        self.header = header
        self.rollout_id = header.rollout_id
        self.schema = schema
        self.ticket = ticket
        self.batches: list[pa.RecordBatch] = []
        self.steps_done: list[int] = []
        self.state: str = "running"
        self.message = ""
        self.num_rows = 0
        self.num_bytes = 0
        self.path: Path | None = None
        self.in_memory = True
        self.finished_at: float | None = None
        self.file: TrajectoryFileWriter | None = None
        self.cond = threading.Condition()

    def abort_file(self) -> None:
        f, self.file = self.file, None
        if f is not None:
            f.abort()

    @property
    def total_records(self) -> int:
        """Rows once finished; -1 while running (the total is not known yet)."""
        return self.num_rows if self.state == "succeeded" else -1

    @property
    def total_bytes(self) -> int:
        return self.num_bytes if self.state == "succeeded" else -1

    def info(self) -> EntryInfo:
        with self.cond:
            return EntryInfo(self.state, self.num_rows, self.num_bytes, tuple(self.steps_done))

    def iter_batches(
        self, start: int = 0, stride: int = 1, *, stop: threading.Event | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Batches already produced, then the rest as they come; ends after x_T.

        Raises RolloutEnded if the rollout fails, is cancelled, released or expired, or
        ``stop`` is set while waiting. Yields the stored batches themselves (no copy),
        one at a time: a slow consumer holds no more than the batch it reads.
        """
        idx = start
        while True:
            with self.cond:
                while idx >= len(self.batches) and self.state == "running":
                    if stop is not None and stop.is_set():
                        raise RolloutEnded(self.rollout_id, "closed", "server shutting down")
                    self.cond.wait(timeout=1.0)
                if self.state not in ("running", "succeeded"):
                    raise RolloutEnded(self.rollout_id, self.state, self.message or self.state)
                if idx >= len(self.batches):
                    return
                batch = self.batches[idx]
            yield batch
            idx += stride

    def _end(self, state: str, message: str) -> None:
        with self.cond:
            self.state = state
            self.message = message
            self.batches = []
            self.in_memory = False
            self.cond.notify_all()


class TrajectoryWriter:
    """What the producer holds: ``append`` each step (ascending), then ``finish`` or ``fail``."""

    def __init__(self, store: ResultStore, entry: Entry) -> None:
        self._store = store
        self._entry = entry
        self._pending = list(entry.header.steps)
        self._max_batch_bytes = store.max_batch_bytes

    @property
    def rollout_id(self) -> str:
        return self._entry.rollout_id

    @property
    def ticket(self) -> str:
        return self._entry.ticket

    def append(self, batch: StepBatch) -> None:
        e = self._entry
        if e.state != "running":
            raise RuntimeError(f"rollout {e.rollout_id} is {e.state}; cannot append")
        if not self._pending or batch.step != self._pending[0]:
            raise ValueError(
                f"rollout {e.rollout_id}: step {batch.step} out of order; expected "
                f"{self._pending[0] if self._pending else 'nothing (all steps appended)'}"
            )
        batches = encode_step(e.header, batch, max_batch_bytes=self._max_batch_bytes, schema=e.schema)
        if e.file is not None:
            for b in batches:
                e.file.write(b)
        self._pending.pop(0)
        nbytes = sum(b.nbytes for b in batches)
        with e.cond:
            e.batches.extend(batches)
            e.steps_done.append(int(batch.step))
            e.num_rows += sum(b.num_rows for b in batches)
            e.num_bytes += nbytes
            e.cond.notify_all()
        self._store._account(nbytes)

    def finish(self) -> None:
        e = self._entry
        if self._pending:
            raise ValueError(f"rollout {e.rollout_id}: steps {self._pending} were never appended")
        if e.state != "running":
            raise RuntimeError(f"rollout {e.rollout_id} is {e.state}; cannot finish")
        if e.file is not None:
            e.path = e.file.commit(fsync=self._store._fsync)
            e.file = None
        with e.cond:
            e.state = "succeeded"
            e.finished_at = time.time()
            e.cond.notify_all()
        self._store._after_finish()

    def fail(self, kind: Literal["failed", "cancelled"], message: str) -> None:
        if kind not in ("failed", "cancelled"):
            raise ValueError(f"kind must be 'failed' or 'cancelled', got {kind!r}")
        e = self._entry
        e.abort_file()
        if e.state != "running":
            return
        freed = e.num_bytes
        e._end(kind, message)
        e.finished_at = time.time()
        self._store._account(-freed)
        if freed >= _TRIM_MIN_BYTES:
            malloc_trim()


class ResultStore:
    def __init__(
        self,
        *,
        memory_budget_bytes: int,
        data_dir: Path | None = None,
        ttl_s: float | None = None,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        fsync: bool = True,
    ) -> None:
        self.memory_budget_bytes = int(memory_budget_bytes)
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.ttl_s = ttl_s
        self.max_batch_bytes = int(max_batch_bytes)
        self._fsync = fsync
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._tickets: dict[str, str] = {}  # ticket -> rollout id
        self._partitions: dict[str, tuple[str, int, int]] = {}  # ticket -> (id, k, n)
        self._gone: dict[str, str] = {}  # ticket or id -> "released" / "expired"
        # Rollouts announced (ticket issued) but not started yet: id -> ticket.
        self._reserved: dict[str, str] = {}
        self._reserved_cond = threading.Condition(self._lock)
        self._bytes_in_memory = 0
        self._warned_budget = False
        self._closed = False
        self.stop_event = threading.Event()
        if self.data_dir is not None:
            self.trajectory_dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    # -- paths ---------------------------------------------------------------------------
    @property
    def trajectory_dir(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir / "trajectories"

    def _path(self, rollout_id: str) -> Path:
        return self.trajectory_dir / f"{rollout_id}.arrow"

    # -- producer side --------------------------------------------------------------------
    def reserve(self, rollout_id: str) -> str:
        """Announce a rollout before it runs and issue its ticket.

        A do_get on the ticket waits until ``create`` registers the rollout (then follows it
        live) or ``abandon`` ends it (then fails naming why).
        """
        if not _ID_RE.match(rollout_id):
            raise ValueError(f"rollout id {rollout_id!r} must match {_ID_RE.pattern}")
        with self._lock:
            if self._closed:
                raise RuntimeError("store is closed")
            if rollout_id in self._entries or rollout_id in self._reserved:
                raise ValueError(f"rollout {rollout_id} already exists")
            ticket = TICKET_PREFIX + secrets.token_urlsafe(18)
            self._reserved[rollout_id] = ticket
            self._tickets[ticket] = rollout_id
            self._gone.pop(rollout_id, None)
            return ticket

    def abandon(self, rollout_id: str, kind: str, message: str) -> bool:
        """End a reserved rollout that never started (cancelled while queued, shutdown)."""
        with self._lock:
            ticket = self._reserved.pop(rollout_id, None)
            if ticket is None:
                return False
            self._tickets.pop(ticket, None)
            self._gone[ticket] = self._gone[rollout_id] = f"{kind}: {message}"
            self._reserved_cond.notify_all()
        return True

    def create(self, header: TrajectoryHeader) -> TrajectoryWriter:
        """Register a live rollout; its ticket works at once (streams follow it live)."""
        if not _ID_RE.match(header.rollout_id):
            raise ValueError(f"rollout id {header.rollout_id!r} must match {_ID_RE.pattern}")
        schema = trajectory_schema(header)
        self.expire_now()
        with self._lock:
            if self._closed:
                raise RuntimeError("store is closed")
            if header.rollout_id in self._entries:
                raise ValueError(f"rollout {header.rollout_id} already exists")
            ticket = self._reserved.pop(header.rollout_id, None) or TICKET_PREFIX + secrets.token_urlsafe(18)
            entry = Entry(header, schema, ticket)
            self._entries[header.rollout_id] = entry
            self._tickets[ticket] = header.rollout_id
            self._gone.pop(header.rollout_id, None)
            self._reserved_cond.notify_all()
        file = None
        if self.data_dir is not None:
            file = TrajectoryFileWriter(self._path(header.rollout_id), schema, footer={_FOOTER_TICKET: ticket})
            entry.file = file
        return TrajectoryWriter(self, entry)

    def _account(self, delta: int) -> None:
        with self._lock:
            self._bytes_in_memory += delta

    def _after_finish(self) -> None:
        self.expire_now()
        self._enforce_budget()

    def _enforce_budget(self) -> None:
        freed = 0
        with self._lock:
            if self._bytes_in_memory <= self.memory_budget_bytes:
                return
            done = sorted(
                (e for e in self._entries.values() if e.state == "succeeded" and e.in_memory),
                key=lambda e: e.finished_at or 0.0,
            )
            for e in done:
                if self._bytes_in_memory <= self.memory_budget_bytes:
                    break
                if e.path is None:
                    if not self._warned_budget:
                        log.warning(
                            "store holds %d bytes, over its budget of %d, and has no data_dir to spill to",
                            self._bytes_in_memory,
                            self.memory_budget_bytes,
                        )
                        self._warned_budget = True
                    break
                _, batches, _ = read_trajectory(e.path, validate=False)
                with e.cond:
                    e.batches = batches  # same boundaries as written: live readers keep their index
                    e.in_memory = False
                self._bytes_in_memory -= e.num_bytes
                freed += e.num_bytes
                log.info("spilled rollout %s (%d bytes) to %s", e.rollout_id, e.num_bytes, e.path)
        if freed >= _TRIM_MIN_BYTES:
            malloc_trim()

    # -- restart -------------------------------------------------------------------------
    def _scan(self) -> None:
        now = time.time()
        for p in sorted(self.trajectory_dir.iterdir()):
            if p.name.endswith(TEMP_SUFFIX):
                log.warning("discarding half-written trajectory file %s (never finished)", p)
                p.unlink(missing_ok=True)
                continue
            if p.suffix != ".arrow":
                continue
            try:
                schema, batches, footer = read_trajectory(p)
                header = header_from_schema(schema)
                ticket = footer.get(_FOOTER_TICKET, "")
                if header.rollout_id != p.stem:
                    raise CorruptTrajectoryFile(f"{p}: holds rollout {header.rollout_id!r}, not {p.stem!r}")
                if not ticket.startswith(TICKET_PREFIX):
                    raise CorruptTrajectoryFile(f"{p}: no ticket in the file footer")
            except CorruptTrajectoryFile as exc:
                bad = p.with_name(p.name + ".corrupt")
                log.error("discarding corrupt trajectory file (moved to %s, never served): %s", bad.name, exc)
                os.replace(p, bad)
                continue
            mtime = p.stat().st_mtime
            if self.ttl_s is not None and mtime + self.ttl_s < now:
                log.info("trajectory %s expired while the server was down; deleting %s", p.stem, p)
                p.unlink(missing_ok=True)
                continue
            e = Entry(header, schema, ticket)
            e.batches = batches
            e.steps_done = list(header.steps)
            e.state = "succeeded"
            e.num_rows = sum(b.num_rows for b in batches)
            e.num_bytes = sum(b.nbytes for b in batches)
            e.path = p
            e.in_memory = False
            e.finished_at = mtime
            self._entries[e.rollout_id] = e
            self._tickets[ticket] = e.rollout_id
            log.info("serving trajectory %s again from %s", e.rollout_id, p)

    # -- consumer side -------------------------------------------------------------------
    def ticket_for(self, rollout_id: str) -> str:
        with self._lock:
            reserved = self._reserved.get(rollout_id)
        return reserved if reserved is not None else self.get(rollout_id).ticket

    def partition_tickets(self, rollout_id: str, n: int) -> list[str]:
        """n tickets that together stream the rollout: ticket k gets batches k, k+n, ..."""
        if not 1 <= n <= 64:
            raise ValueError(f"partitions must be in 1..64, got {n}")
        entry = self.get(rollout_id)
        if n == 1:
            return [entry.ticket]
        out = []
        with self._lock:
            for k in range(n):
                t = f"{entry.ticket}.{n}.{k}"  # registry key; looked up, never parsed
                self._partitions[t] = (rollout_id, k, n)
                out.append(t)
        return out

    def lookup_ticket(self, ticket: bytes | str) -> tuple[Entry, int, int]:
        """(entry, start, stride) for a ticket; raises TicketNotFound naming it."""
        self.expire_now()
        key = ticket.decode("utf-8", errors="replace") if isinstance(ticket, bytes) else ticket
        shown = repr(key[:80]) + ("..." if len(key) > 80 else "")
        with self._lock:
            rid = self._tickets.get(key)
            while rid is not None and rid in self._reserved:  # announced, not started: wait for it
                if self.stop_event.is_set():
                    raise TicketNotFound(f"ticket {shown}", "server shutting down")
                self._reserved_cond.wait(timeout=1.0)
                rid = self._tickets.get(key)
            if rid is not None and rid in self._entries:
                return self._entries[rid], 0, 1
            part = self._partitions.get(key)
            if part is not None and part[0] in self._entries:
                return self._entries[part[0]], part[1], part[2]
            reason = self._gone.get(key, "unknown")
        raise TicketNotFound(f"ticket {shown}", reason)

    def get(self, rollout_id: str) -> Entry:
        self.expire_now()
        with self._lock:
            e = self._entries.get(rollout_id)
            if e is None:
                if rollout_id in self._reserved:
                    raise TicketNotFound(f"rollout {rollout_id!r}", "queued: not started yet; do_get on its ticket waits")
                raise TicketNotFound(f"rollout {rollout_id!r}", self._gone.get(rollout_id, "unknown"))
            return e

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def info(self, rollout_id: str) -> EntryInfo:
        return self.get(rollout_id).info()

    def release(self, rollout_id: str) -> bool:
        """Drop a finished (or failed/cancelled) rollout and delete its file; False if
        unknown or still running (cancel it first)."""
        return self._drop(rollout_id, "released")

    def _drop(self, rollout_id: str, reason: str) -> bool:
        with self._lock:
            e = self._entries.get(rollout_id)
            if e is None or e.state == "running":
                return False
            del self._entries[rollout_id]
            self._tickets.pop(e.ticket, None)
            for t in [t for t, p in self._partitions.items() if p[0] == rollout_id]:
                del self._partitions[t]
            self._gone[e.ticket] = reason
            self._gone[rollout_id] = reason
            while len(self._gone) > _MAX_GONE:
                self._gone.pop(next(iter(self._gone)))
            freed = e.num_bytes if e.in_memory else 0
            self._bytes_in_memory -= freed
        e._end(reason, f"rollout was {reason}")
        if e.path is not None:
            e.path.unlink(missing_ok=True)
        if freed >= _TRIM_MIN_BYTES:
            malloc_trim()
        return True

    def expire_now(self) -> list[str]:
        """Drop finished entries older than ttl_s; returns their ids."""
        if self.ttl_s is None:
            return []
        cutoff = time.time() - self.ttl_s
        with self._lock:
            old = [
                rid
                for rid, e in self._entries.items()
                if e.state != "running" and e.finished_at is not None and e.finished_at < cutoff
            ]
        return [rid for rid in old if self._drop(rid, "expired")]

    def stats(self) -> dict[str, int]:
        with self._lock:
            entries = list(self._entries.values())
            mem = self._bytes_in_memory
        on_disk = 0
        for e in entries:
            if e.path is not None:
                try:
                    on_disk += e.path.stat().st_size
                except OSError:
                    pass
        return {
            "bytes_in_memory": mem,
            "bytes_on_disk": on_disk,
            "entries": len(entries),
            "live": sum(1 for e in entries if e.state == "running"),
        }

    def close(self) -> None:
        """Stop waiting streams; running rollouts end as failed ("server shutting down").
        Finished trajectories stay on disk (with data_dir) for the next store."""
        self.stop_event.set()
        with self._lock:
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            self._tickets.clear()
            self._partitions.clear()
            self._reserved.clear()
            self._reserved_cond.notify_all()
            self._bytes_in_memory = 0
        for e in entries:
            if e.state == "running":
                e.abort_file()
                e._end("failed", "server shutting down")
            else:
                e._end("closed", "store closed")
        malloc_trim()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
