"""Durable trajectory files under ``<data_dir>/trajectories`` and the restart scan.

Every trajectory is written through to ``<id>.arrow.partial`` as it is produced and
atomically renamed to ``<id>.arrow`` (after fsync) when it finishes, so a finished
trajectory survives kill -9. A new store on the same directory serves it again under the
same id and ticket (kept in the file footer's custom metadata, not in the schema).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pyarrow as pa

from dataplane.entry import Entry
from dataplane.files import TEMP_SUFFIX, CorruptTrajectoryFile, TrajectoryFileWriter, map_trajectory
from dataplane.schema import header_from_schema
from dataplane.tickets import is_minted

log = logging.getLogger("dataplane.store")

FOOTER_TICKET = "sigmaflight.ticket"


def open_writer(path: Path, schema: pa.Schema, ticket: str) -> TrajectoryFileWriter:
    """The file writer for one trajectory, its ticket in the footer."""
    return TrajectoryFileWriter(path, schema, footer={FOOTER_TICKET: ticket})


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
    e.replace_batches(batches, in_memory=False, source=path, source_size=m.size, crcs=m.crcs)
    return e


def serve_from_durable(e: Entry) -> bool:
    """Serve ``e`` memory-mapped from its durable file (dropping any shared-memory copy):
    what spilling does. False if it has no durable file. Raises CorruptTrajectoryFile if
    the file no longer holds what was written (its checksums, or those the writer kept)."""
    if e.path is None:
        return False
    m = map_trajectory(e.path, validate=False, checksums=True)
    if e.crcs is not None and m.crcs is not None and m.crcs != e.crcs:
        raise CorruptTrajectoryFile(f"{e.path}: checksums differ from the ones written")
    # same boundaries as written: live readers keep their index
    e.replace_batches(m.batches, in_memory=False, source=e.path, source_size=m.size, crcs=m.crcs or e.crcs)
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

    def scan(self, ttl_s: float | None) -> list[Entry]:
        """The finished trajectories a previous store left: half-written files are removed,
        corrupt ones renamed ``.corrupt`` (never served), expired ones deleted."""
        now = time.time()
        found = []
        for p in sorted(self.trajectory_dir.iterdir()):
            if p.name.endswith(TEMP_SUFFIX):
                log.warning("discarding half-written trajectory file %s (never finished)", p)
                p.unlink(missing_ok=True)
                continue
            if p.suffix != ".arrow":
                continue
            try:
                e = read_entry(p)
            except CorruptTrajectoryFile as exc:
                bad = p.with_name(p.name + ".corrupt")
                log.error("discarding corrupt trajectory file (moved to %s, never served): %s", bad.name, exc)
                os.replace(p, bad)
                continue
            if ttl_s is not None and (e.finished_at or 0.0) + ttl_s < now:
                log.info("trajectory %s expired while the server was down; deleting %s", e.rollout_id, p)
                p.unlink(missing_ok=True)
                continue
            e.path = p
            found.append(e)
            log.info("serving trajectory %s again from %s", e.rollout_id, p)
        return found
