"""Durable trajectory files under ``<data_dir>/trajectories`` and the restart scan.

Every trajectory is written through to ``<id>.arrow.partial`` as it is produced and
atomically renamed to ``<id>.arrow`` (after fsync) when it finishes, so a finished
trajectory survives kill -9. A new store on the same directory serves it again under the
same id and ticket (kept in the file footer's custom metadata, not in the schema).

A rollout's extra streams ("outputs", "conditioning") are written whole, when published, to
``<data_dir>/streams/<id>.<stream>.arrow`` (atomic and fsync'd the same way, the ticket in the
footer, a checksum per batch). That happens before the trajectory's own rename, so a finished
trajectory's streams are on disk whenever it is; the restart scan attaches them, memory-mapped.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pyarrow as pa
from sigmaflight.dataplane.entry import Entry
from sigmaflight.dataplane.files import (
    TEMP_SUFFIX,
    CorruptTrajectoryFile,
    TrajectoryFileWriter,
    map_stream,
    map_trajectory,
    write_trajectory,
)
from sigmaflight.dataplane.schema import header_from_schema
from sigmaflight.dataplane.streams import FORMATS
from sigmaflight.dataplane.tickets import is_minted

log = logging.getLogger("sigmaflight.dataplane.store")

ORPHAN_SUFFIX = ".orphan"
"""What a trajectory file (and its stream files) no journal row names is renamed with at the
restart scan: never served, kept for a look (as `.corrupt` ones are)."""


def _remove(path: Path, failed: str, *, aside: bool = False, **fields: str) -> None:
    """Delete `path` (`aside`: rename it `<name>.orphan`); one that cannot be (a directory at its
    name, a read-only or failing disk) is logged as `failed` and left: the caller goes on."""
    try:
        if aside:
            os.replace(path, path.with_name(path.name + ORPHAN_SUFFIX))
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        log.error(failed, extra={**fields, "path": str(path), "reason": exc.strerror or str(exc)})


def _remove_left_over(path: Path) -> None:
    """A file the restart scan does not serve: start-up goes on whether it goes or not."""
    _remove(path, "cannot remove a left-over file in the data dir; left as it is")


def discard_files(rollout_id: str, copies: list[Path | None], *, durable: list[Path | None], aside: bool) -> None:
    """Delete a released rollout's files: its `copies` (shared memory) and its `durable` ones, or,
    `aside`, rename those `<name>.orphan`. A file that cannot be deleted (a read-only or failing
    disk) is logged, not raised: the rollout is released either way and no longer served; its
    journal row says so, and the restart scan deletes the file if it is still there."""
    failed = "released rollout's file could not be deleted (no longer served)"
    for path in copies:
        if path is not None:
            _remove(path, failed, rollout=rollout_id)
    for path in durable:
        if path is not None:
            _remove(path, failed, aside=aside, rollout=rollout_id)

FOOTER_TICKET = "sigmaflight.ticket"


def open_writer(
    path: Path, schema: pa.Schema, ticket: str, *, mode: int | None = None, dir_fd: int | None = None
) -> TrajectoryFileWriter:
    """The file writer for one trajectory, its ticket in the footer (``mode``, ``dir_fd``: as
    TrajectoryFileWriter's)."""
    return TrajectoryFileWriter(path, schema, footer={FOOTER_TICKET: ticket}, mode=mode, dir_fd=dir_fd)


def read_entry(path: Path, *, validate: bool = True) -> Entry:
    """A succeeded Entry over the memory-mapped file at ``path`` (named ``<id>.arrow``).

    Raises CorruptTrajectoryFile if the file is not a complete trajectory of that id
    with a ticket in its footer, or (``validate``) a batch's checksum differs."""
    m = map_trajectory(path, validate=validate)
    schema, batches, footer = m.schema, m.batches, m.footer
    header = header_from_schema(schema)
    ticket = footer.get(FOOTER_TICKET, "")
    rollout_id = path.name.removesuffix(".arrow")
    if header.rollout_id != rollout_id:
        raise CorruptTrajectoryFile(f"{path}: holds rollout {header.rollout_id!r}, not {rollout_id!r}")
    if not is_minted(ticket):
        raise CorruptTrajectoryFile(f"{path}: no ticket in the file footer")
    e = Entry.finished(header, schema, ticket, batches, path.stat().st_mtime)
    e.replace_batches(batches, in_memory=False, source=path, source_size=m.size, crcs=m.crcs, stamp=m.stamp,
                      verified=m.verified)
    return e


def serve_from_durable(e: Entry) -> bool:
    """Serve ``e`` memory-mapped from its durable file (dropping any shared-memory copy), and
    its extra streams from theirs: what spilling does. False if it has no durable file.
    Raises CorruptTrajectoryFile if a file no longer holds what was written (its checksums, or
    those the writer kept)."""
    if e.path is None:
        return False
    m = map_trajectory(e.path, validate=False, checksums=True)
    if e.crcs is not None and m.crcs is not None and m.crcs != e.crcs:
        raise CorruptTrajectoryFile(f"{e.path}: checksums differ from the ones written")
    streams = {name: (map_stream(path, FORMATS[name])[0], path) for name, path in e.stream_paths.items()}
    # same boundaries as written: live readers keep their index
    e.replace_batches(m.batches, in_memory=False, source=e.path, source_size=m.size, crcs=m.crcs or e.crcs,
                      stamp=m.stamp, verified=m.verified)
    e.map_streams(streams)
    shm, e.shm_path = e.shm_path, None
    if shm is not None:
        shm.unlink(missing_ok=True)  # open maps keep their pages until unmapped
    return True


class DurableDir:
    """``<data_dir>/trajectories``: one ``<id>.arrow`` per finished trajectory."""

    def __init__(self, data_dir: Path, *, fsync: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.fsync = fsync
        self.trajectory_dir.mkdir(parents=True, exist_ok=True)

    @property
    def trajectory_dir(self) -> Path:
        return self.data_dir / "trajectories"

    def path(self, rollout_id: str) -> Path:
        return self.trajectory_dir / f"{rollout_id}.arrow"

    def writer(self, rollout_id: str, schema: pa.Schema, ticket: str) -> TrajectoryFileWriter:
        return open_writer(self.path(rollout_id), schema, ticket)

    @property
    def stream_dir(self) -> Path:
        return self.data_dir / "streams"

    def stream_path(self, rollout_id: str, name: str) -> Path:
        return self.stream_dir / f"{rollout_id}.{name}.arrow"

    def write_stream(self, rollout_id: str, name: str, table: pa.Table, ticket: str) -> Path:
        """Write one extra stream whole (atomic, durable); returns its path."""
        return write_trajectory(self.stream_path(rollout_id, name), table.schema, table.to_batches(),
                                footer={FOOTER_TICKET: ticket}, fsync=self.fsync)

    def attach_streams(self, entries: list[Entry]) -> None:
        """After ``scan``: give each entry the stream files written for it (memory-mapped,
        checked), and remove the other ``.arrow`` files: half-written ones and those of rollouts
        that never finished or expired while the server was down (other files are left alone).
        A corrupt stream file is renamed ``.corrupt`` and that stream answers "not held any
        more"; the trajectory is served."""
        self.stream_dir.mkdir(parents=True, exist_ok=True)
        by_id = {e.rollout_id: e for e in entries}
        for p in sorted(self.stream_dir.iterdir()):
            if p.name.endswith(".arrow" + TEMP_SUFFIX):
                log.warning("discarding half-written stream file (never finished)", extra={"path": str(p)})
                _remove_left_over(p)
                continue
            if p.suffix != ".arrow":  # not ours (.corrupt ones are kept for a look)
                continue
            rollout_id, _, name = p.name.removesuffix(".arrow").rpartition(".")
            e = by_id.get(rollout_id)
            if e is None or name not in e.streams_requested:
                log.warning("discarding stream file (no finished rollout of that id asked for it)", extra={"path": str(p)})
                _remove_left_over(p)
                continue
            try:
                table, footer = map_stream(p, FORMATS[name])
                if footer.get(FOOTER_TICKET) != e.ticket:
                    raise CorruptTrajectoryFile(f"{p}: written for another rollout of id {rollout_id}")
            except CorruptTrajectoryFile as exc:
                bad = p.with_name(p.name + ".corrupt")
                log.error("discarding corrupt stream file (moved aside, never served)",
                          extra={"rollout": rollout_id, "stream": name, "path": str(bad), "reason": str(exc)})
                os.replace(p, bad)
                continue
            e.map_streams({name: (table, p)})
            log.info("serving stream again", extra={"rollout": rollout_id, "stream": name, "path": str(p)})

    def scan(self) -> list[Entry]:
        """The finished trajectories a previous store left: half-written files are removed,
        corrupt ones renamed ``.corrupt`` (never served). Their age is the jobs layer's to judge
        (its reaper releases what expired)."""
        found = []
        for p in sorted(self.trajectory_dir.iterdir()):
            if p.name.endswith(TEMP_SUFFIX):
                log.warning("discarding half-written trajectory file (never finished)", extra={"path": str(p)})
                _remove_left_over(p)
                continue
            if p.suffix != ".arrow":
                continue
            try:
                e = read_entry(p)
            except CorruptTrajectoryFile as exc:
                bad = p.with_name(p.name + ".corrupt")
                log.error("discarding corrupt trajectory file (moved aside, never served)",
                          extra={"path": str(bad), "reason": str(exc)})
                os.replace(p, bad)
                continue
            e.path = p
            found.append(e)
            log.info("serving trajectory again", extra={"rollout": e.rollout_id, "path": str(p)})
        return found
