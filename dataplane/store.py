"""ResultStore: trajectories by rollout id; the facade over entries, tickets, budget and files.

- A rollout is created live (``create``); its writer appends record batches that any
  number of consumers follow (``Entry.iter_batches``, dataplane/entry.py).
- Tickets are minted and looked up in one place (dataplane/tickets.py).
- With ``data_dir``, every trajectory is written through and kept durable
  (dataplane/durable.py): a new store on the same directory serves it again.
- Over ``memory_budget_bytes``, finished trajectories spill to their durable file
  (dataplane/budget.py).
- With ``shm_dir``, each finished trajectory is one shared-memory file that the store
  serves memory-mapped and same-host clients read directly (dataplane/shm.py).
- No TTL of its own: a finished entry stays until it is released (the jobs layer's reaper
  releases what expired, control/jobs/manager.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from sigmaflight.dataplane.budget import MemoryBudget, malloc_trim, trim_if_large
from sigmaflight.dataplane.codec import DEFAULT_MAX_BATCH_BYTES
from sigmaflight.dataplane.durable import DurableDir, discard_files, serve_from_durable
from sigmaflight.dataplane.entry import Entry, RolloutEnded, StopCheck
from sigmaflight.dataplane.files import CorruptTrajectoryFile, FileStamp, verify_batches
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.schema import trajectory_schema
from sigmaflight.dataplane.shm import ShmDir
from sigmaflight.dataplane.streams import EXTRA_STREAMS, StreamNotFound
from sigmaflight.dataplane.tickets import (
    UNKNOWN,
    Gone,
    Resolved,
    TicketNotFound,
    TicketRegistry,
    split_stream_ticket,
)
from sigmaflight.dataplane.writer import TrajectoryWriter

from sigmaflight.records import ROLLOUT_ID, ResultInfo, RolloutState

__all__ = [
    "Entry",
    "ResultStore",
    "RolloutEnded",
    "StreamNotFound",
    "TicketNotFound",
    "TrajectoryWriter",
    "malloc_trim",
]

log = logging.getLogger("sigmaflight.dataplane.store")

def _check_id(rollout_id: str) -> None:
    if not ROLLOUT_ID.fullmatch(rollout_id):
        raise ValueError(f"rollout id {rollout_id!r} must match {ROLLOUT_ID.pattern}")


class ResultStore:
    """The store's one public face (what control/ and the Flight server call).

    Longer than ~200 lines on purpose: it is a facade, each method a few lines that hold
    the store's lock across the entry table and the parts it composes (TicketRegistry,
    MemoryBudget, DurableDir, ShmDir); splitting it further would only forward calls."""

    def __init__(
        self,
        *,
        memory_budget_bytes: int,
        data_dir: Path | None = None,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        fsync: bool = True,
        shm_dir: Path | None = None,
        shm_private: bool = False,
        on_unavailable: Callable[[str, str], None] | None = None,
    ) -> None:
        """``shm_private``: shared-memory files mode 0600 (set it when tokens are configured).

        ``on_unavailable(rollout_id, reason)``: called (outside the store's lock) when a
        succeeded rollout can no longer be served because its file was truncated or
        corrupted; the entry has ended as failed with that reason. Settable later as the
        attribute of the same name (the jobs layer marks the rollout)."""
        self.on_unavailable = on_unavailable
        self.on_unknown: Callable[[str], Gone | None] | None = None
        """Asked (outside the store's lock) why a ticket or rollout id the store does not know
        names nothing: the jobs layer still knows rollouts the store forgot or never held (ended
        before a restart, or more ended ones than the store remembers); None: "unknown"."""
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.max_batch_bytes = int(max_batch_bytes)
        self._fsync = fsync
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._live: dict[str, TrajectoryWriter] = {}
        self._tickets = TicketRegistry(self._lock)
        self.budget = MemoryBudget(memory_budget_bytes, self._lock)
        self._closed = False
        self.stop_event = threading.Event()
        self.shm = ShmDir(shm_dir, private=shm_private) if shm_dir is not None else None
        self.durable = DurableDir(self.data_dir, fsync=fsync) if self.data_dir is not None else None
        if self.durable is not None:
            with self._lock:
                for e in self.durable.scan():
                    self._entries[e.rollout_id] = e
                    self._tickets.bind(e.rollout_id, e.ticket)
                self.durable.attach_streams(list(self._entries.values()))
            if self.shm is not None:
                self.shm.restore(list(self._entries.values()), self.budget)

    @property
    def memory_budget_bytes(self) -> int:
        return self.budget.limit_bytes

    # -- producer side --------------------------------------------------------------------
    def reserve(self, rollout_id: str) -> str:
        """Announce a rollout before it runs and issue its ticket.

        A do_get on the ticket waits until ``create`` registers the rollout (then follows it
        live) or ``abandon`` ends it (then fails naming why).
        """
        _check_id(rollout_id)
        with self._lock:
            if self._closed:
                raise RuntimeError("store is closed")
            if rollout_id in self._entries or self._tickets.is_reserved(rollout_id):
                raise ValueError(f"rollout {rollout_id} already exists")
            return self._tickets.reserve(rollout_id)

    def abandon(self, rollout_id: str, kind: str, message: str) -> bool:
        """End a reserved rollout that never started (cancelled while queued, shutdown); `kind`:
        "failed" or "cancelled" (a RolloutState, or its string from a Ray worker's caller)."""
        with self._lock:
            return self._tickets.abandon(rollout_id, RolloutState(kind), message)

    def create(self, header: TrajectoryHeader) -> TrajectoryWriter:
        """Register a live rollout; its ticket works at once (streams follow it live)."""
        _check_id(header.rollout_id)
        schema = trajectory_schema(header)
        with self._lock:
            if self._closed:
                raise RuntimeError("store is closed")
            if header.rollout_id in self._entries:
                raise ValueError(f"rollout {header.rollout_id} already exists")
            ticket = self._tickets.bind(header.rollout_id)
            entry = Entry(header, schema, ticket)
            self._entries[header.rollout_id] = entry
        try:
            file = self.durable.writer(header.rollout_id, schema, ticket) if self.durable is not None else None
        except BaseException as exc:  # e.g. a read-only data dir: end the entry, never leave it running
            entry.end(RolloutState.FAILED, f"cannot open the trajectory file: {type(exc).__name__}: {exc}")
            raise
        writer = TrajectoryWriter(self, entry, file, fsync=self._fsync, durable=self.durable)
        with self._lock:
            self._live[entry.rollout_id] = writer
        return writer

    # -- hooks the writer calls (StoreHooks) ----------------------------------------------
    def appended(self, entry: Entry, nbytes: int) -> None:
        self.budget.add(nbytes)

    def finished(self, entry: Entry) -> None:
        if self.shm is not None:
            self.shm.adopt(entry)
        entry.succeed()
        with self._lock:
            self._live.pop(entry.rollout_id, None)
        self._spill()

    def failed(self, entry: Entry, freed: int) -> None:
        with self._lock:
            self._live.pop(entry.rollout_id, None)
        self.budget.add(-freed)
        trim_if_large(freed)

    def file_location(self, entry: Entry) -> str | None:
        """The ``file://...?host=`` location of a finished rollout in shm_dir, else None."""
        path = entry.shm_path
        if self.shm is None or path is None or entry.state is not RolloutState.SUCCEEDED:
            return None
        return self.shm.location(path)

    def _spill(self) -> None:
        lost: list[tuple[Entry, str]] = []

        def move_out(e: Entry) -> bool:
            try:
                return serve_from_durable(e)
            except (CorruptTrajectoryFile, OSError) as exc:  # its file changed: never serve other bytes
                lost.append((e, f"trajectory file unusable when spilled back to it: {exc}"))
                e.end(RolloutState.FAILED, lost[-1][1])  # its bytes leave memory (the budget counts them out)
                return True

        with self._lock:
            entries = list(self._entries.values())
        self.budget.spill(entries, move_out)
        for e, reason in lost:
            self._report_unavailable(e, reason)

    # -- served files: checked before each stream -----------------------------------------
    def check_served(self, entry: Entry) -> None:
        """Before serving a finished entry from its memory-mapped file: verified (every batch
        against its checksum) once per mapping, afterwards only ``os.stat`` of the file compared
        with the stamp taken when it was last verified; any move of its inode, size, mtime or
        ctime (a write in place, a truncation, a touch) verifies it again. While the name holds
        another file (or none), the mapping is verified before every stream. A truncated or
        changed file ends the entry as failed naming why, the jobs layer hears of it
        (``on_unavailable``) and RolloutEnded is raised."""
        with entry.cond:
            source, size, crcs, held = entry.source, entry.source_size, entry.crcs, entry.batches
            mapped, verified, state = entry.source_stamp, entry.verified_stamp, entry.state
        if source is None or state is not RolloutState.SUCCEEDED:
            return
        try:
            try:
                now: FileStamp | None = FileStamp.of(os.stat(source))
            except FileNotFoundError:  # renamed or unlinked: the map keeps the pages it had
                now = None
            if now is not None and now == verified:
                return  # the mapped file, unchanged since its batches matched their checksums
            ours = now is not None and (mapped is None or now.same_inode(mapped))
            if ours and now is not None and now.size != size:
                raise CorruptTrajectoryFile(
                    f"{source}: file truncated or changed size ({now.size} bytes, mapped {size})")
            verify_batches(source, list(held), crcs)
        except (CorruptTrajectoryFile, OSError) as exc:
            reason = f"trajectory file unusable: {exc}"
            self.mark_unavailable(entry, reason)
            raise RolloutEnded(entry.rollout_id, RolloutState.FAILED, reason) from None
        if ours:
            with entry.cond:
                if entry.batches is held:  # not re-mapped meanwhile
                    entry.verified_stamp = now

    def mark_unavailable(self, entry: Entry, reason: str) -> None:
        """End a finished entry whose file cannot be served (kept, as failed, for its reason).
        Its shared-memory file goes: same-host readers that remember it must not read it."""
        with self._lock:
            if entry.in_memory:
                self.budget.add(-entry.num_bytes)
        shm, entry.shm_path = entry.shm_path, None
        entry.end(RolloutState.FAILED, reason)
        if shm is not None:
            shm.unlink(missing_ok=True)
        self._report_unavailable(entry, reason)

    def _report_unavailable(self, entry: Entry, reason: str) -> None:
        log.error("rollout no longer available", extra={"rollout": entry.rollout_id, "reason": reason})
        hook = self.on_unavailable
        if hook is not None:
            try:
                hook(entry.rollout_id, reason)
            except Exception:  # the hook's failure must not break serving
                log.exception("on_unavailable hook failed", extra={"rollout": entry.rollout_id})

    # -- consumer side -------------------------------------------------------------------
    def ticket_for(self, rollout_id: str) -> str:
        with self._lock:
            reserved = self._tickets.reserved_ticket(rollout_id)
        return reserved if reserved is not None else self.get(rollout_id).ticket

    def partition_tickets(self, rollout_id: str, n: int) -> list[str]:
        """n tickets that together stream the rollout: ticket k gets batches k, k+n, ..."""
        if not 1 <= n <= 64:
            raise ValueError(f"partitions must be in 1..64, got {n}")
        entry = self.get(rollout_id)
        if n == 1:
            return [entry.ticket]
        with self._lock:
            return self._tickets.partitions(rollout_id, entry.ticket, n)

    def _stopping(self, should_stop: StopCheck | None) -> StopCheck:
        def check() -> str | None:
            if self.stop_event.is_set():
                return "server shutting down"
            return should_stop() if should_stop is not None else None

        return check

    def lookup_ticket(self, ticket: bytes | str, *, should_stop: StopCheck | None = None) -> tuple[Entry, int, int]:
        """(entry, start, stride) for a ticket (or a rollout id); raises TicketNotFound naming it.

        Waits while it names a rollout that is reserved but not started yet, until the store
        closes or ``should_stop()`` names a reason (a cancelled call, a stopping server)."""
        key = ticket.decode("utf-8", errors="replace") if isinstance(ticket, bytes) else ticket
        shown = repr(key[:80]) + ("..." if len(key) > 80 else "")
        with self._lock:
            found = self._tickets.resolve(key, self._entries.__contains__, self._stopping(should_stop))
            if isinstance(found, Resolved):
                return self._entries[found.rollout_id], found.start, found.stride
        raise self._not_found(f"ticket {shown}", key, found)

    def _not_found(self, what: str, key: str, gone: Gone) -> TicketNotFound:
        """TicketNotFound for `key`, with how it ended from `on_unknown` when the store has no idea,
        or knows only that it released it: the jobs layer knows whether it had failed or was
        cancelled (a file served again after a restart, then released, was one the store held as done)."""
        if (gone == UNKNOWN or gone.ended is RolloutState.RELEASED) and self.on_unknown is not None:
            try:
                known = self.on_unknown(key)
            except Exception:  # the hook's failure must not break the answer
                log.exception("on_unknown hook failed", extra={"key": key[:80]})
                known = None
            if known is not None and (gone == UNKNOWN or known.ended in (RolloutState.FAILED, RolloutState.CANCELLED)):
                gone = known
        return TicketNotFound(what, gone.reason, gone.ended)

    def stream_of(self, ticket: bytes | str) -> str | None:
        """The extra stream an extra stream's ticket names ("outputs", ...); None for any other ticket."""
        key = ticket.decode("utf-8", errors="replace") if isinstance(ticket, bytes) else ticket
        return split_stream_ticket(key, EXTRA_STREAMS)[1]

    def lookup_stream(self, ticket: bytes | str, *, should_stop: StopCheck | None = None) -> tuple[Entry, str]:
        """(entry, stream name) for an extra stream's ticket; waits like ``lookup_ticket`` while
        the rollout is reserved. Raises TicketNotFound naming it (partition tickets have no streams)."""
        key = ticket.decode("utf-8", errors="replace") if isinstance(ticket, bytes) else ticket
        base, stream = split_stream_ticket(key, EXTRA_STREAMS)
        if stream is None:
            raise TicketNotFound(f"ticket {key[:80]!r}", "not an extra stream's ticket")
        try:
            entry, start, stride = self.lookup_ticket(base, should_stop=should_stop)
        except TicketNotFound as e:  # named as it was sent, with its stream: not as the trajectory's ticket
            shown = repr(key[:80]) + ("..." if len(key) > 80 else "")
            raise TicketNotFound(f"the {stream!r} stream's ticket {shown}", e.reason, e.ended) from None
        if (start, stride) != (0, 1):
            raise TicketNotFound(f"ticket {key[:80]!r}", "a partition ticket has no extra streams")
        return entry, stream

    def rollout_of(self, ticket: str) -> str | None:
        """The rollout a whole-rollout ticket names (queued, running or finished); None if none."""
        with self._lock:
            return self._tickets.rollout_of(ticket)

    def find(self, ticket_or_id: str) -> Entry:
        """The entry a rollout id or a (whole-rollout) ticket names; never waits."""
        with self._lock:
            e = self._entries.get(ticket_or_id)
            rid = None
            if e is None:
                rid = self._tickets.rollout_of(ticket_or_id)
                e = self._entries.get(rid) if rid is not None else None
        # a queued rollout's ticket names its reservation: "queued", as its id does
        return e if e is not None else self.get(rid if rid is not None else ticket_or_id)

    def get(self, rollout_id: str) -> Entry:
        with self._lock:
            e = self._entries.get(rollout_id)
            if e is not None:
                return e
            if self._tickets.is_reserved(rollout_id):
                raise TicketNotFound(f"rollout {rollout_id!r}", "queued: not started yet; do_get on its ticket waits")
            gone = self._tickets.gone(rollout_id)
        raise self._not_found(f"rollout {rollout_id!r}", rollout_id, gone)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def result(self, rollout_id: str) -> ResultInfo | None:
        """A held rollout's result once succeeded, else None; TicketNotFound (a KeyError) if not held."""
        return self.get(rollout_id).result()

    def wake_all(self) -> None:
        """Wake every waiting consumer (they re-check ``stop_event`` and their stop checks)."""
        with self._lock:
            self._tickets.wake()
            entries = list(self._entries.values())
        for e in entries:
            e.wake()

    # -- end of life ---------------------------------------------------------------------
    def release(self, rollout_id: str, *, aside: bool = False) -> bool:
        """Drop a finished (or failed/cancelled) rollout and delete its files (`aside`: rename its
        durable files `.orphan`, never served, kept for a look); False if unknown or still running
        (cancel it first). A file that cannot be deleted is logged (durable.discard_files)."""
        with self._lock:
            e = self._entries.get(rollout_id)
            if e is None or e.state is RolloutState.RUNNING:
                return False
            del self._entries[rollout_id]
            if e.state is RolloutState.SUCCEEDED:
                self._tickets.forget(rollout_id, e.ticket, RolloutState.RELEASED)
            else:  # a failed or cancelled one still says how it ended, as REST does
                self._tickets.forget(rollout_id, e.ticket, e.state, e.message)
            freed = (e.num_bytes if e.in_memory else 0) + e.extra_bytes
            self.budget.add(-freed)
        stream_files = list(e.stream_paths.values())
        e.end(RolloutState.RELEASED, "rollout was released")
        discard_files(rollout_id, [e.shm_path], durable=[e.path, *stream_files], aside=aside)
        trim_if_large(freed)
        return True

    def stats(self) -> dict[str, int]:
        """bytes_in_memory (what the budget counts, shm files included), bytes_on_disk (durable
        files, extra streams' included), bytes_in_shm (shared-memory files), entries, live."""
        with self._lock:
            entries = list(self._entries.values())
            mem = self.budget.used
        return {
            "bytes_in_memory": mem,
            "bytes_on_disk": sum(_size(e.path) + sum(_size(p) for p in e.stream_paths.values()) for e in entries),
            "bytes_in_shm": sum(_size(e.shm_path) for e in entries),
            "entries": len(entries),
            "live": sum(1 for e in entries if e.state is RolloutState.RUNNING),
        }

    def close(self) -> None:
        """Stop waiting streams; running rollouts end as failed ("server shutting down").
        Finished trajectories stay on disk (with data_dir) for the next store; their
        shared-memory files are removed."""
        self.stop_event.set()
        with self._lock:
            self._closed = True
            entries = list(self._entries.values())
            live = list(self._live.values())
            self._entries.clear()
            self._live.clear()
            self._tickets.clear()
            self.budget.reset()
        for w in live:
            w.abort_file()
        for e in entries:
            if e.state is RolloutState.RUNNING:
                e.end(RolloutState.FAILED, "server shutting down")
            else:
                e.end(RolloutState.CLOSED, "store closed")
            if e.shm_path is not None:
                e.shm_path.unlink(missing_ok=True)
        if self.shm is not None:
            self.shm.close()
        malloc_trim()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0
