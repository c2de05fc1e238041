"""TrajectoryWriter: what the producer holds. ``append`` each step (ascending), then
``finish`` or ``fail``; the store hears about each through its public hooks."""

from __future__ import annotations

from typing import Protocol

import pyarrow as pa
from sigmaflight.dataplane.codec import HeaderColumns, encode_step_sized
from sigmaflight.dataplane.durable import DurableDir
from sigmaflight.dataplane.entry import Entry
from sigmaflight.dataplane.files import TrajectoryFileWriter
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader

from sigmaflight.records import ResultInfo, RolloutState


class StoreHooks(Protocol):
    """What a writer tells its store (ResultStore implements it)."""

    max_batch_bytes: int

    def appended(self, entry: Entry, nbytes: int) -> None: ...
    def finished(self, entry: Entry) -> None: ...
    def failed(self, entry: Entry, freed: int) -> None: ...


class TrajectoryWriter:
    def __init__(
        self, store: StoreHooks, entry: Entry, file: TrajectoryFileWriter | None, *, fsync: bool,
        durable: DurableDir | None = None,
    ) -> None:
        """``durable``: where ``publish`` writes each extra stream's file (with ``file``, data_dir)."""
        self._store = store
        self._entry = entry
        self._file = file
        self._durable = durable
        self._fsync = fsync
        self._pending = list(entry.header.steps)
        self._columns = HeaderColumns(entry.header)
        """What every step's batches share, made once."""

    @property
    def rollout_id(self) -> str:
        return self._entry.rollout_id

    @property
    def ticket(self) -> str:
        return self._entry.ticket

    @property
    def header(self) -> TrajectoryHeader:
        return self._entry.header

    @property
    def schema(self) -> pa.Schema:
        return self._entry.schema

    def append(self, batch: StepBatch) -> None:
        """Step `batch.step` (the next one due) of this trajectory, from its own tensors."""
        e = self._entry
        self._check(batch.step)
        self._add(batch.step, encode_step_sized(e.header, batch, max_batch_bytes=self._store.max_batch_bytes,
                                                schema=e.schema, columns=self._columns))

    def append_encoded(self, step: int, sized: list[tuple[pa.RecordBatch, int]]) -> None:
        """Step `step` (the next one due) as record batches of this trajectory's schema made
        already, each with its bytes (`CallWriters`: a co-batched call's step, encoded once)."""
        self._check(step)
        self._add(step, sized)

    def _check(self, step: int) -> None:
        e = self._entry
        if e.state is not RolloutState.RUNNING:
            raise RuntimeError(f"rollout {e.rollout_id} is {e.state}; cannot append")
        if not self._pending or step != self._pending[0]:
            raise ValueError(
                f"rollout {e.rollout_id}: step {step} out of order; expected "
                f"{self._pending[0] if self._pending else 'nothing (all steps appended)'}"
            )

    def _add(self, step: int, sized: list[tuple[pa.RecordBatch, int]]) -> None:
        e = self._entry
        batches = [b for b, _ in sized]
        if self._file is not None:
            for b in batches:
                self._file.write(b)
        self._pending.pop(0)
        self._store.appended(e, e.append(step, batches, sum(n for _, n in sized)))

    def publish(self, name: str, table: pa.Table) -> None:
        """Add one extra stream of the rollout (whole table; see dataplane/streams.py), before
        ``finish``. Its consumers, waiting since the rollout was reserved, get it at once.
        With a data dir its file is written first (durable before the trajectory's rename);
        a failed write raises OSError naming the stream, and the producer fails the rollout."""
        e = self._entry
        if self._durable is not None:
            e.check_publish(name)  # before the file: a refused stream leaves none behind
            try:
                path = self._durable.write_stream(e.rollout_id, name, table, e.ticket)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot write the {name!r} stream file: {exc}") from exc
            e.stream_paths[name] = path
        self._store.appended(e, e.publish(name, table))

    def finish(self) -> ResultInfo | None:
        """End the trajectory; what the store now holds of it (None when the store found it lost
        as it moved it out of memory)."""
        e = self._entry
        if self._pending:
            raise ValueError(f"rollout {e.rollout_id}: steps {self._pending} were never appended")
        if e.state is not RolloutState.RUNNING:
            raise RuntimeError(f"rollout {e.rollout_id} is {e.state}; cannot finish")
        try:
            if self._file is not None:
                e.crcs = tuple(self._file.crcs)
                e.path = self._file.commit(fsync=self._fsync)
                self._file = None
            self._store.finished(e)
        except BaseException as exc:
            # e.g. the rename fails (read-only or full data dir): consumers get the reason
            e.path = None
            self.fail(RolloutState.FAILED, f"cannot finish the trajectory file: {type(exc).__name__}: {exc}")
            raise
        return e.result()

    def abort_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.abort()

    def fail(self, kind: RolloutState | str, message: str) -> None:
        """End the rollout's streams as `kind`: failed or cancelled."""
        if kind not in (RolloutState.FAILED, RolloutState.CANCELLED):
            raise ValueError(f"kind must be 'failed' or 'cancelled', got {kind!r}")
        e = self._entry
        try:
            self.abort_file()
            for path in e.stream_paths.values():  # a failed rollout keeps no files
                path.unlink(missing_ok=True)
        except OSError:  # a read-only directory cannot lose the temp file: the next scan does
            pass
        if e.state is not RolloutState.RUNNING:
            return
        freed = e.num_bytes + e.extra_bytes
        e.end(RolloutState(kind), message)
        self._store.failed(e, freed)
