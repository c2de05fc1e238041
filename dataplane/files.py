"""Trajectories as Arrow IPC files (``.arrow``): the same "trajectory/v1" schema.

Writes are durable and atomic: a temp name in the same directory, fsync, rename, fsync
of the directory. Reads are memory-mapped (zero-copy): the batches point into the map.
Any pyarrow, polars or DuckDB user can read the files without sigmaflight.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from dataplane.schema import FORMAT, KEY_FORMAT, header_from_schema

TEMP_SUFFIX = ".partial"
"""Suffix of files being written; never served, removed on the next scan."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TrajectoryFileWriter:
    """Incremental, atomic writer: batches go to ``<path>.partial``; ``commit()`` makes
    ``path`` appear complete or not at all (kill -9 leaves only the temp name)."""

    def __init__(self, path: Path, schema: pa.Schema, *, footer: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self.temp = self.path.with_name(self.path.name + TEMP_SUFFIX)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._sink = pa.OSFile(str(self.temp), "wb")
        meta = {k.encode(): v.encode() for k, v in (footer or {}).items()}
        self._writer = pa.ipc.new_file(self._sink, schema, metadata=meta or None)
        self._closed = False

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)

    def commit(self, *, fsync: bool = True) -> Path:
        self._writer.close()
        self._sink.flush()
        if fsync:
            fd = os.open(self.temp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._sink.close()
        self._closed = True
        os.replace(self.temp, self.path)
        if fsync:
            _fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._writer.close()
            except (pa.ArrowException, OSError):
                pass
            self._sink.close()
        self.temp.unlink(missing_ok=True)


def write_trajectory(
    path: str | os.PathLike[str],
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    *,
    footer: Mapping[str, str] | None = None,
    fsync: bool = True,
) -> Path:
    """Write ``batches`` as one Arrow IPC file at ``path`` (atomic, durable)."""
    w = TrajectoryFileWriter(Path(path), schema, footer=footer)
    try:
        for b in batches:
            w.write(b)
        return w.commit(fsync=fsync)
    except BaseException:
        w.abort()
        raise


class CorruptTrajectoryFile(ValueError):
    """The file is not a complete, valid "trajectory/v1" Arrow IPC file."""


class MappedTrajectory(NamedTuple):
    schema: pa.Schema
    batches: list[pa.RecordBatch]
    """Batches pointing into the map."""
    footer: dict[str, str]
    base_address: int
    """Address of the file's first byte in the map (buffer address - base = file offset)."""
    size: int


def map_trajectory(path: str | os.PathLike[str], *, validate: bool = True) -> MappedTrajectory:
    """Memory-map ``path``: schema, batches pointing into the map, footer metadata, and where
    the map starts.

    Raises CorruptTrajectoryFile for a truncated file (no footer), a schema that is not
    "trajectory/v1", or batches that fail validation.
    """
    try:
        source = pa.memory_map(str(path), "r")
        whole = source.read_buffer()  # zero-copy: the map itself
        source.seek(0)
        reader = pa.ipc.open_file(source)
        schema = reader.schema
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        footer = {k.decode(): v.decode() for k, v in (reader.metadata or {}).items()}
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CorruptTrajectoryFile(f"{path}: unreadable Arrow IPC file ({e})") from e
    if (schema.metadata or {}).get(KEY_FORMAT.encode()) is None:
        raise CorruptTrajectoryFile(f"{path}: schema has no {KEY_FORMAT} (not a {FORMAT} file)")
    try:
        header = header_from_schema(schema)
        if validate:
            for b in batches:
                b.validate(full=True)
    except (pa.ArrowException, ValueError, KeyError) as e:
        raise CorruptTrajectoryFile(f"{path}: invalid contents ({e})") from e
    expected = header.num_samples * len(header.steps)
    rows = sum(b.num_rows for b in batches)
    if header.num_samples and rows != expected:
        raise CorruptTrajectoryFile(f"{path}: {rows} rows, expected {expected} (B x steps)")
    return MappedTrajectory(schema, batches, footer, whole.address, whole.size)


def read_trajectory(
    path: str | os.PathLike[str], *, validate: bool = True
) -> tuple[pa.Schema, list[pa.RecordBatch], dict[str, str]]:
    """Memory-map ``path``: (schema, batches pointing into the map, footer metadata); see
    map_trajectory for the errors."""
    m = map_trajectory(path, validate=validate)
    return m.schema, m.batches, m.footer


def read_table(path: str | os.PathLike[str]) -> pa.Table:
    """The whole trajectory as a memory-mapped pa.Table (zero-copy)."""
    schema, batches, _ = read_trajectory(path)
    return pa.Table.from_batches(batches, schema=schema)
