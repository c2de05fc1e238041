"""One rollout in the store: its batches, state and the live stream that follows them.

A rollout's batches are append-only while it runs; any number of consumers follow them
(``Entry.iter_batches``: a Condition, no busy-wait) and all share the same batches (no
copy per consumer).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pyarrow as pa
from sigmaflight.dataplane.files import FileStamp
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.streams import StreamNotFound, requested_streams

from sigmaflight.records import ResultInfo, RolloutState

StopCheck = Callable[[], "str | None"]
"""Why a waiting consumer must stop now (server stopping, call cancelled), or None."""
POLL_S = 0.2
"""How often a waiting consumer re-checks its StopCheck (cancellation is not a notification)."""


class RolloutEnded(Exception):
    """A stream cannot go on: the rollout failed, was cancelled, released or expired."""

    def __init__(self, rollout_id: str, state: RolloutState, message: str) -> None:
        super().__init__(f"rollout {rollout_id} {state}: {message}")
        self.rollout_id = rollout_id
        self.state = state
        self.message = message


class Entry:
    """One rollout in the store. Batches are append-only while running.

    ``path`` is the durable file (``data_dir``), ``shm_path`` the shared-memory copy
    (``shm_dir``); ``in_memory`` says whether ``num_bytes`` count against the budget.
    """

    def __init__(self, header: TrajectoryHeader, schema: pa.Schema, ticket: str) -> None:
        self.header = header
        self.rollout_id = header.rollout_id
        self.schema = schema
        self.ticket = ticket
        self.batches: list[pa.RecordBatch] = []
        self.steps_done: list[int] = []
        self.state = RolloutState.RUNNING
        self.message = ""
        self.num_rows = 0
        self.num_bytes = 0
        self.path: Path | None = None
        self.shm_path: Path | None = None
        self.in_memory = True
        self.finished_at: float | None = None
        self.cond = threading.Condition()
        self.streams_requested = requested_streams(header)
        """Extra streams asked for ("outputs", "conditioning"); each published once, whole."""
        self.extras: dict[str, pa.Table] = {}
        self.extra_bytes = 0
        """Bytes of the published extra streams held on the heap (counted in the budget);
        streams mapped from their files (after a restart or a spill) count 0."""
        self.stream_paths: dict[str, Path] = {}
        """The durable file of each extra stream (data_dir), once written."""
        self._mapped_streams: set[str] = set()
        self.source: Path | None = None
        """The file the batches are memory-mapped from (None: heap), and its size when mapped."""
        self.source_size = 0
        self.source_stamp: FileStamp | None = None
        """The mapped inode as it was when mapped (None: not known)."""
        self.verified_stamp: FileStamp | None = None
        """``os.stat`` of ``source`` when the mapped batches last matched their checksums (taken
        before that check), while the name still held the mapped inode; None: not verified yet."""
        self.crcs: tuple[int, ...] | None = None
        """Checksum of each batch as written (dataplane/files.batch_crc); None if unknown."""
        self._released: list[pa.RecordBatch] | None = None
        """The batches of a succeeded entry when it was released (a DELETE, a Flight release, the
        TTL): the readers that had begun read them to their end; the store no longer holds the
        entry, so they live as long as those readers. None otherwise."""
        self._served: dict[tuple[int, int], tuple[pa.Table, int]] = {}
        """served_table's cache, (start, stride) -> (table, bytes); emptied when the batches change."""

    @classmethod
    def finished(
        cls, header: TrajectoryHeader, schema: pa.Schema, ticket: str, batches: list[pa.RecordBatch], finished_at: float
    ) -> Entry:
        """A succeeded entry over batches read back from a file (not counted in memory)."""
        e = cls(header, schema, ticket)
        e.batches = batches
        e.steps_done = list(header.steps)
        e.state = RolloutState.SUCCEEDED
        e.num_rows = sum(b.num_rows for b in batches)
        e.num_bytes = sum(b.nbytes for b in batches)
        e.in_memory = False
        e.finished_at = finished_at
        return e

    @property
    def total_records(self) -> int:
        """Rows once finished; -1 while running (the total is not known yet)."""
        return self.num_rows if self.state is RolloutState.SUCCEEDED else -1

    @property
    def total_bytes(self) -> int:
        return self.num_bytes if self.state is RolloutState.SUCCEEDED else -1

    def result(self) -> ResultInfo | None:
        """What it holds once succeeded (the contract's `result`); None before or otherwise."""
        with self.cond:
            if self.state is not RolloutState.SUCCEEDED:
                return None
            return ResultInfo(num_rows=self.num_rows, num_bytes=self.num_bytes, steps=list(self.steps_done))

    # -- producer side ---------------------------------------------------------------------
    def append(self, step: int, batches: Sequence[pa.RecordBatch], nbytes: int | None = None) -> int:
        """Add one step's batches and wake the consumers; returns their bytes (``nbytes``: their
        ``RecordBatch.nbytes``, known already)."""
        if nbytes is None:
            nbytes = sum(b.nbytes for b in batches)
        with self.cond:
            self.batches.extend(batches)
            self.steps_done.append(int(step))
            self.num_rows += sum(b.num_rows for b in batches)
            self.num_bytes += nbytes
            self.cond.notify_all()
        return nbytes

    def check_publish(self, name: str) -> None:
        """Raise (ValueError, or RuntimeError when not running) if stream `name` cannot be published now."""
        if name not in self.streams_requested:
            raise ValueError(f"rollout {self.rollout_id}: stream {name!r} was not requested")
        if name in self.extras:
            raise ValueError(f"rollout {self.rollout_id}: stream {name!r} was published already")
        if self.state is not RolloutState.RUNNING:
            raise RuntimeError(f"rollout {self.rollout_id} is {self.state}; cannot publish {name!r}")

    def publish(self, name: str, table: pa.Table) -> int:
        """Add one extra stream (whole) and wake its consumers; returns its bytes."""
        with self.cond:
            self.check_publish(name)
            self.extras[name] = table
            self.extra_bytes += table.nbytes
            self.cond.notify_all()
        return int(table.nbytes)

    def map_streams(self, tables: dict[str, tuple[pa.Table, Path]]) -> None:
        """Serve these extra streams memory-mapped from their files (after a restart, or when
        the entry spills): the heap copies go, and ``extra_bytes`` (what the budget counts)
        keeps only the streams still on the heap."""
        with self.cond:
            for name, (table, path) in tables.items():
                self.extras[name] = table
                self.stream_paths[name] = path
                self._mapped_streams.add(name)
            self.extra_bytes = sum(int(t.nbytes) for n, t in self.extras.items() if n not in self._mapped_streams)

    def stream_table(self, name: str, *, should_stop: StopCheck | None = None) -> pa.Table:
        """An extra stream's table; waits while the rollout runs and has not published it yet
        (re-checking ``should_stop`` every POLL_S, as ``iter_batches`` does).

        Raises StreamNotFound when it was not requested (or is not held any more), RolloutEnded
        when the rollout failed, was cancelled, released or expired, or the wait must stop."""
        if name not in self.streams_requested:
            raise StreamNotFound(self.rollout_id, name, f"not requested: ask for it with return.{name}")
        with self.cond:
            while name not in self.extras and self.state is RolloutState.RUNNING:
                why = should_stop() if should_stop is not None else None
                if why is not None:
                    raise RolloutEnded(self.rollout_id, RolloutState.CLOSED, why)
                self.cond.wait(timeout=POLL_S)
            if self.state not in (RolloutState.RUNNING, RolloutState.SUCCEEDED):
                raise RolloutEnded(self.rollout_id, self.state, self.message or self.state)
            table = self.extras.get(name)
        if table is None:
            raise StreamNotFound(self.rollout_id, name, "not held any more: the server restarted and found "
                                                        "no intact file of it in its data dir")
        return table

    def succeed(self) -> None:
        with self.cond:
            self.state = RolloutState.SUCCEEDED
            self.finished_at = time.time()
            self.cond.notify_all()

    def replace_batches(
        self,
        batches: list[pa.RecordBatch],
        *,
        in_memory: bool,
        source: Path | None = None,
        source_size: int = 0,
        crcs: tuple[int, ...] | None = None,
        stamp: FileStamp | None = None,
        verified: bool = False,
    ) -> None:
        """Serve the same batches from elsewhere (a memory-mapped file ``source`` of
        ``source_size`` bytes; ``stamp``: the mapped inode when mapped; ``verified``: its batches
        were checked against their checksums after that). Boundaries must be the ones written,
        so that live readers keep their index."""
        with self.cond:
            self.batches = batches
            self._served = {}
            self.in_memory = in_memory
            self.source = source
            self.source_size = source_size
            self.source_stamp = stamp
            self.verified_stamp = stamp if verified else None
            if crcs is not None:
                self.crcs = crcs

    def end(self, state: RolloutState, message: str) -> None:
        """Drop the batches. Every consumer (waiting or not) ends with RolloutEnded, but those of a
        succeeded rollout now released, which read to their end the batches it had."""
        with self.cond:
            if self.state is RolloutState.SUCCEEDED and state is RolloutState.RELEASED:
                self._released = self.batches
            self.state = state
            self.message = message
            self.batches = []
            self._served = {}
            self.extras = {}
            self.extra_bytes = 0
            self.in_memory = False
            self.source = None
            if self.finished_at is None:
                self.finished_at = time.time()
            self.cond.notify_all()

    def wake(self) -> None:
        """Wake waiting consumers (they re-check the stop event)."""
        with self.cond:
            self.cond.notify_all()

    # -- consumer side ---------------------------------------------------------------------
    def iter_batches(
        self,
        start: int = 0,
        stride: int = 1,
        *,
        stop: threading.Event | None = None,
        should_stop: StopCheck | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Batches already produced, then the rest as they come; ends after x_T.

        Raises RolloutEnded if the rollout fails, is cancelled, released or expired (once it
        succeeded, a release lets this reader finish: it began before), or
        while waiting ``stop`` is set or ``should_stop()`` names a reason (checked every
        POLL_S). Yields the stored batches themselves (no copy), one at a time: a slow
        consumer holds no more than the batch it reads.
        """
        idx = start
        while True:
            with self.cond:
                while idx >= len(self.batches) and self.state is RolloutState.RUNNING:
                    if stop is not None and stop.is_set():
                        raise RolloutEnded(self.rollout_id, RolloutState.CLOSED, "server shutting down")
                    why = should_stop() if should_stop is not None else None
                    if why is not None:
                        raise RolloutEnded(self.rollout_id, RolloutState.CLOSED, why)
                    self.cond.wait(timeout=POLL_S if should_stop is not None else 1.0)
                batches = self.batches if self._released is None else self._released
                if self.state not in (RolloutState.RUNNING, RolloutState.SUCCEEDED) and self._released is None:
                    raise RolloutEnded(self.rollout_id, self.state, self.message or self.state)
                if idx >= len(batches):
                    return
                batch = batches[idx]
            yield batch
            idx += stride

    def snapshot(self, start: int = 0, stride: int = 1) -> list[pa.RecordBatch] | None:
        """All batches of a succeeded entry (k, k+stride, ...) at once; None if not succeeded."""
        with self.cond:
            if self.state is not RolloutState.SUCCEEDED:
                return None
            return self.batches[start::stride]

    def served_table(self, start: int = 0, stride: int = 1) -> tuple[pa.Table, int] | None:
        """`snapshot` as one table and its bytes, made once per batch list: a finished rollout
        pulled again costs no Python per batch (RecordBatch.nbytes walks every buffer: 260 us
        a call for 9 batches, about 4% of a 16 MiB pull). None if not succeeded."""
        with self.cond:
            if self.state is not RolloutState.SUCCEEDED:
                return None
            hit = self._served.get((start, stride))
            if hit is None:
                part = self.batches[start::stride]
                hit = (pa.Table.from_batches(part, schema=self.schema), sum(b.nbytes for b in part))
                self._served[(start, stride)] = hit
            return hit
