"""Trajectories as Arrow IPC files (``.arrow``): the same "trajectory/v1" schema.

Writes are durable and atomic: a temp name in the same directory, fsync, rename, fsync
of the directory. Reads are memory-mapped (zero-copy): the batches point into the map.
Any pyarrow, polars or DuckDB user can read the files without sigmaflight.

Each record batch carries a CRC-32C of its buffers in its message's custom metadata
(``sigmaflight.crc32c``, see ``batch_crc``; hardware CRC32C, several GB/s); ``map_trajectory`` checks them (``checksums=True``)
and ``verify_batches`` checks batches served from a map again. Files without them (written
before checksums existed) are read unchecked.

Every file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (``create_new``): the server never
writes through a name someone else prepared (a symlink planted at the temp name would otherwise
make it overwrite the link's target), and its mode is set on the descriptor (``fchmod``).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import crc32c
import pyarrow as pa
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.schema import FORMAT, KEY_FORMAT, KEY_STEPS, header_from_schema

log = logging.getLogger("sigmaflight.dataplane.store")

TEMP_SUFFIX = ".partial"
"""Suffix of files being written; never served, removed on the next scan."""

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_new(path: Path, *, mode: int | None = None, dir_fd: int | None = None) -> int:
    """A descriptor of a file created here and now at ``path`` (opened for writing).

    ``O_EXCL | O_NOFOLLOW``: an existing entry at the name (a leftover, or a symlink someone
    planted) is never opened or followed; it is removed (logged) and the file created anew, once
    (a name planted again in between fails the write with FileExistsError). ``mode``: set on the
    descriptor (the file is created 0600 until then); None keeps ``0o666 & ~umask``.
    ``dir_fd``: ``path.name`` is taken relative to that open directory, not the path."""
    name: str | Path = path.name if dir_fd is not None else path
    initial = 0o600 if mode is not None else 0o666
    try:
        fd = os.open(name, _NEW_FILE, initial, dir_fd=dir_fd)
    except FileExistsError:
        kind = "a symlink" if os.path.islink(path) else "an entry"
        log.warning(f"removing {kind} found where a file is to be written (never followed)", extra={"path": str(path)})
        os.unlink(name, dir_fd=dir_fd)
        fd = os.open(name, _NEW_FILE, initial, dir_fd=dir_fd)
    if mode is not None:
        os.fchmod(fd, mode)
    return fd


def _fsync_dir(path: Path, dir_fd: int | None = None) -> None:
    if dir_fd is not None:
        os.fsync(dir_fd)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


KEY_CRC = "sigmaflight.crc32c"
"""Custom metadata key of each batch message: the batch's CRC-32C (decimal)."""


def batch_crc(batch: pa.RecordBatch) -> int:
    """CRC-32C over every buffer of every column, as an IPC reader sees them (no validity
    buffer without nulls, offsets 0, buffers cut to their length). Batches read from a file
    are in that form; ``canonical_crc`` brings any batch into it first."""
    crc = 0
    for col in batch.columns:
        for buf in col.buffers():
            if buf is not None and buf.size:
                crc = crc32c.crc32c(memoryview(buf), value=crc)
    return crc


def canonical_crc(batch: pa.RecordBatch) -> int:
    """``batch_crc`` of the batch as it will read back from a file (one IPC round trip)."""
    return batch_crc(pa.ipc.read_record_batch(batch.serialize(), batch.schema))


def verify_batches(path: object, batches: list[pa.RecordBatch], crcs: tuple[int, ...] | None) -> None:
    """Raise CorruptTrajectoryFile naming the first batch whose checksum differs."""
    if crcs is None:
        return
    if len(crcs) != len(batches):
        raise CorruptTrajectoryFile(f"{path}: {len(batches)} batches, {len(crcs)} checksums")
    for i, (b, want) in enumerate(zip(batches, crcs, strict=True)):
        got = batch_crc(b)
        if got != want:
            raise CorruptTrajectoryFile(
                f"{path}: checksum mismatch in batch {i} (crc32c {got:08x}, written {want:08x}): "
                "the file was corrupted or changed after it was written"
            )


class TrajectoryFileWriter:
    """Incremental, atomic writer: batches go to ``<path>.partial`` (a file created new,
    ``create_new``); ``commit()`` makes ``path`` appear complete or not at all (kill -9 leaves
    only the temp name). ``mode`` and ``dir_fd`` as in ``create_new`` (with ``dir_fd``, every
    operation is relative to that directory; ``path`` names it for messages and the caller)."""

    def __init__(
        self, path: Path, schema: pa.Schema, *, footer: Mapping[str, str] | None = None,
        mode: int | None = None, dir_fd: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.temp = self.path.with_name(self.path.name + TEMP_SUFFIX)
        self._dir_fd = dir_fd
        if dir_fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = os.fdopen(create_new(self.temp, mode=mode, dir_fd=dir_fd), "wb", buffering=0)
        self._sink = pa.PythonFile(self._file, mode="w")  # as fast as pa.OSFile here (tmpfs, 4 MiB batches)
        meta = {k.encode(): v.encode() for k, v in (footer or {}).items()}
        self._closed = False
        try:
            self._writer = pa.ipc.new_file(self._sink, schema, metadata=meta or None)
        except BaseException:
            self.abort()
            raise
        self.crcs: list[int] = []

    def write(self, batch: pa.RecordBatch, crc: int | None = None) -> None:
        """Append ``batch`` with its checksum (``canonical_crc`` unless given)."""
        crc = canonical_crc(batch) if crc is None else crc
        self._writer.write_batch(batch, custom_metadata={KEY_CRC: str(crc)})
        self.crcs.append(crc)

    def commit(self, *, fsync: bool = True) -> Path:
        self._writer.close()
        self._sink.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._sink.close()
        self._file.close()
        self._closed = True
        rename_into_place(self.temp, self.path, dir_fd=self._dir_fd)
        if fsync:
            _fsync_dir(self.path.parent, self._dir_fd)
        return self.path

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                if hasattr(self, "_writer"):
                    self._writer.close()
            except (pa.ArrowException, OSError):
                pass
            self._sink.close()
            self._file.close()
        remove(self.temp, dir_fd=self._dir_fd)


def rename_into_place(temp: Path, path: Path, *, dir_fd: int | None = None) -> None:
    """``os.replace(temp, path)`` (relative to ``dir_fd`` when given: both in that directory). A
    symlink at ``path`` is replaced itself, never followed."""
    if dir_fd is None:
        os.replace(temp, path)
    else:
        os.replace(temp.name, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def remove(path: Path, *, dir_fd: int | None = None) -> None:
    """Unlink ``path`` if it is there (relative to ``dir_fd`` when given)."""
    try:
        os.unlink(path.name if dir_fd is not None else path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


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


class FileStamp(NamedTuple):
    """What ``os.stat`` says of a file that a cheap check compares: which inode, its size and
    when its contents or inode last changed (any write, truncation, chmod or new link moves
    ``ctime_ns``)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def same_inode(self, other: FileStamp) -> bool:
        return (self.dev, self.ino) == (other.dev, other.ino)


class MappedTrajectory(NamedTuple):
    schema: pa.Schema
    batches: list[pa.RecordBatch]
    """Batches pointing into the map."""
    footer: dict[str, str]
    base_address: int
    """Address of the file's first byte in the map (buffer address - base = file offset)."""
    size: int
    crcs: tuple[int, ...] | None = None
    """Each batch's checksum as written; None for a file without them."""
    stamp: FileStamp | None = None
    """The mapped inode as it was when opened (before any check of its contents)."""
    verified: bool = False
    """Whether every batch was checked against its checksum after ``stamp`` was taken."""


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_PROC_FD = "/proc/self/fd"
_HAVE_PROC_FD = os.path.isdir(_PROC_FD)


def open_regular(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at ``path`` and its ``fstat``: opened once with
    O_NONBLOCK and O_NOFOLLOW (a FIFO or a device at the name never blocks the open, a symlink
    there is refused), then checked S_ISREG on that descriptor. Read and map through it, not
    through the name again: what was checked is what is read. Raises OSError (the open) or
    CorruptTrajectoryFile (not a regular file)."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a device"
            raise CorruptTrajectoryFile(f"{path}: not a regular file ({kind})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _map_descriptor(fd: int, path: str | os.PathLike[str], st: os.stat_result) -> pa.MemoryMappedFile:
    """Map the file open at ``fd``: through /proc/self/fd (the same open file, never the name
    again), or where there is no /proc, by name with the inode checked to be the same."""
    if _HAVE_PROC_FD:
        return pa.memory_map(f"{_PROC_FD}/{fd}", "r")
    source = pa.memory_map(str(path), "r")
    if not FileStamp.of(os.fstat(source.fileno())).same_inode(FileStamp.of(st)):
        source.close()
        raise CorruptTrajectoryFile(f"{path}: replaced while it was being opened")
    return source


def _map_ipc(
    path: str | os.PathLike[str], fd: int | None = None
) -> tuple[pa.Schema, list[pa.RecordBatch], list[int | None], dict[str, str], pa.Buffer, FileStamp]:
    """Memory-map an Arrow IPC file (opened with ``open_regular``, or the descriptor ``fd`` a
    caller opened so): schema, batches pointing into the map, each batch's checksum as written
    (None where absent), footer metadata, the whole map and the mapped inode's stamp."""
    try:
        own = fd is None
        if fd is None:
            fd, st = open_regular(path)
        else:
            st = os.fstat(fd)
        try:
            source = _map_descriptor(fd, path, st)
        finally:
            if own:
                os.close(fd)  # the map keeps the file
        try:
            whole = source.read_buffer()  # zero-copy: the map itself
            source.seek(0)
            reader = pa.ipc.open_file(source)
            schema = reader.schema
            batches: list[pa.RecordBatch] = []
            crc_list: list[int | None] = []
            for i in range(reader.num_record_batches):
                b, meta = reader.get_batch_with_custom_metadata(i)
                batches.append(b)
                raw = (meta or {}).get(KEY_CRC.encode()) if meta is not None else None
                crc_list.append(int(raw) if raw is not None else None)
            footer = {k.decode(): v.decode() for k, v in (reader.metadata or {}).items()}
        finally:
            source.close()  # its descriptor, now: the buffers keep the mapping itself
    except CorruptTrajectoryFile:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CorruptTrajectoryFile(f"{path}: unreadable Arrow IPC file ({e})") from e
    return schema, batches, crc_list, footer, whole, FileStamp.of(st)


def map_stream(path: str | os.PathLike[str], fmt: str) -> tuple[pa.Table, dict[str, str]]:
    """An extra stream's file (written by ``write_trajectory``): its table, memory-mapped, and
    the footer metadata. Raises CorruptTrajectoryFile if it is unreadable, not of format
    ``fmt`` (e.g. "conditioning/v1"), fails validation or a batch's checksum differs."""
    schema, batches, crc_list, footer, _, _ = _map_ipc(path)
    got = (schema.metadata or {}).get(KEY_FORMAT.encode(), b"").decode(errors="replace")
    if got != json.dumps(fmt):
        raise CorruptTrajectoryFile(f"{path}: schema {KEY_FORMAT} is {got or 'missing'}, not {json.dumps(fmt)}")
    if any(c is None for c in crc_list):
        raise CorruptTrajectoryFile(f"{path}: a batch has no {KEY_CRC}")
    try:
        for b in batches:
            b.validate(full=True)
    except (pa.ArrowException, ValueError) as e:
        raise CorruptTrajectoryFile(f"{path}: invalid contents ({e})") from e
    verify_batches(path, batches, tuple(int(c) for c in crc_list if c is not None))
    return pa.Table.from_batches(batches, schema=schema), footer


def map_ipc(path: str | os.PathLike[str], *, fd: int | None = None) -> MappedTrajectory:
    """Memory-map the Arrow IPC file at ``path`` (or the descriptor ``fd`` from
    ``open_regular``, left open) without looking into its schema: batches pointing into the
    map, the footer, each batch's checksum as written and the mapped inode's stamp. A same-host
    client, which compares the schema with the one the server sent, needs no more. Raises
    CorruptTrajectoryFile for anything that is not a complete IPC file."""
    schema, batches, crc_list, footer, whole, stamp = _map_ipc(path, fd)
    crcs = None if any(c is None for c in crc_list) else tuple(int(c) for c in crc_list if c is not None)
    return MappedTrajectory(schema, batches, footer, whole.address, whole.size, crcs, stamp)


def map_trajectory(
    path: str | os.PathLike[str], *, validate: bool = True, checksums: bool | None = None
) -> MappedTrajectory:
    """Memory-map ``path``: schema, batches pointing into the map, footer metadata, where the
    map starts and the mapped inode's stamp (taken before any check).

    Raises CorruptTrajectoryFile for a truncated file (no footer), a schema that is not
    "trajectory/v1", batches that fail validation, or (``checksums``, default: as
    ``validate``) a batch whose checksum differs from the one written with it.
    """
    m = map_ipc(path)
    schema, batches = m.schema, m.batches
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
        raise CorruptTrajectoryFile(f"{path}: {rows} rows, expected {expected} (B x steps){_off_steps(batches, header)}")
    verified = validate if checksums is None else checksums
    if verified:
        verify_batches(path, batches, m.crcs)
    return m._replace(verified=verified)


def _off_steps(batches: list[pa.RecordBatch], header: TrajectoryHeader) -> str:
    """"; step 3: 0 rows of 4, ..." for the steps whose row count is not B (the first few)."""
    counts: dict[int, int] = {}
    for b in batches:
        for step in b.column("step").to_pylist():
            counts[step] = counts.get(step, 0) + 1
    off = [f"step {s}: {counts.get(s, 0)} rows of {header.num_samples}" for s in header.steps
           if counts.get(s, 0) != header.num_samples]
    off += [f"step {s}: not listed in {KEY_STEPS}" for s in sorted(set(counts) - set(header.steps), key=str)]
    return "; " + ", ".join(off[:5]) + (f" (and {len(off) - 5} more)" if len(off) > 5 else "") if off else ""


def read_trajectory(
    path: str | os.PathLike[str], *, validate: bool = True, checksums: bool | None = None
) -> tuple[pa.Schema, list[pa.RecordBatch], dict[str, str]]:
    """Memory-map ``path``: (schema, batches pointing into the map, footer metadata); see
    map_trajectory for the errors."""
    m = map_trajectory(path, validate=validate, checksums=checksums)
    return m.schema, m.batches, m.footer


def read_table(path: str | os.PathLike[str]) -> pa.Table:
    """The whole trajectory as a memory-mapped pa.Table (zero-copy)."""
    schema, batches, _ = read_trajectory(path)
    return pa.Table.from_batches(batches, schema=schema)
