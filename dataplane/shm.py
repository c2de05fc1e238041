"""Same-host trainers: finished trajectories as Arrow IPC files in a shared-memory directory.

With ``shm_dir`` (e.g. under /dev/shm) the store writes each finished trajectory once as a
"trajectory/v1" file ``<dir>/<id>.arrow`` and serves it memory-mapped from there (Flight
included): the file is the one copy of the data on the host, and it counts against the
memory budget (tmpfs pages are memory). Its FlightInfo endpoint lists, after the grpc
location, ``file://<path>?host=<host id>``; a client with the same host id reads the file
directly (dataplane/client.py).

- With ``data_dir`` too, the file in ``data_dir`` is the durable one (fsync'd, survives
  restarts); the shm file is a copy in memory, dropped when the budget spills it.
- A directory holds the files of one live store: it takes an exclusive ``flock`` on
  ``<dir>/.sigmaflight.lock`` (released by the kernel when the process dies, kill -9
  included); another server on the same directory refuses to start. Files found there
  belong to a dead process and are removed; with ``data_dir``, the restart scan then
  writes the durable trajectories back into the directory (within the budget).
- ``private=True`` (tokens configured): files are mode 0600, readable by the server's user
  only (any process of that user on the host can read them).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pyarrow as pa
from sigmaflight.dataplane.budget import MemoryBudget, trim_if_large
from sigmaflight.dataplane.durable import open_writer
from sigmaflight.dataplane.entry import Entry
from sigmaflight.dataplane.files import TEMP_SUFFIX, MappedTrajectory, map_trajectory

log = logging.getLogger("sigmaflight.dataplane.store")

LOCK_NAME = ".sigmaflight.lock"


def host_id() -> str:
    """An id equal for two processes exactly when they share a kernel boot and a mount namespace.

    The boot id (/proc/sys/kernel/random/boot_id, random per boot) differs between hosts;
    the mount namespace (/proc/self/ns/mnt) differs between containers on one host, whose
    /dev/shm are usually not the same. Same id: the path in a ``file://`` location names the
    same file for both. (A container that shares the volume but not the namespace falls
    back to gRPC: correct, only slower.)"""
    parts = []
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/mnt")):
        try:
            parts.append(read())
        except OSError:
            parts.append(socket.gethostname())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def file_location(path: Path, host: str) -> str:
    return f"file://{quote(str(path))}?host={host}"


def parse_file_location(uri: str) -> tuple[Path, str] | None:
    """(path, host id) of a ``file://<abs path>?host=<id>`` location; None for other URIs."""
    u = urlsplit(uri)
    if u.scheme != "file" or u.netloc not in ("", "localhost"):
        return None
    host = parse_qs(u.query).get("host", [""])[0]
    return Path(unquote(u.path)), host


class ShmDir:
    """The directory of shared-memory trajectory files of one live store."""

    def __init__(self, path: Path, *, private: bool = False) -> None:
        self.path = Path(path).absolute()
        self.private = private
        self.host = host_id()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise RuntimeError(f"shm_dir {self.path} is in use by another live server (its lock is held)") from None
        for p in sorted(self.path.iterdir()):
            if p.name.endswith((".arrow", ".arrow" + TEMP_SUFFIX)):
                log.warning("removing stale shared-memory trajectory %s (left by a dead process)", p)
                p.unlink(missing_ok=True)

    def adopt(self, e: Entry) -> None:
        """A finishing entry's heap batches become one file here, served memory-mapped (same
        bytes, still counted in the budget); on failure (e.g. /dev/shm full) they stay on the heap."""
        try:
            path = self.write(e.rollout_id, e.schema, e.batches, e.ticket, e.crcs)
            m = self.map(path)
        except (OSError, ValueError) as exc:
            log.warning("rollout %s stays on the heap: cannot write it to shm_dir (%s)", e.rollout_id, exc)
            return
        e.shm_path = path
        # same boundaries: live readers keep their index
        e.replace_batches(m.batches, in_memory=True, source=path, source_size=m.size, crcs=m.crcs, stamp=m.stamp)
        trim_if_large(e.num_bytes)

    def restore(self, entries: list[Entry], budget: MemoryBudget) -> None:
        """After a restart: copy durable trajectories back here, newest first, within the budget."""
        for e in sorted(entries, key=lambda e: -(e.finished_at or 0.0)):
            if e.path is None or budget.used + e.num_bytes > budget.limit_bytes:
                continue
            path = self.copy_in(e.path)
            try:
                m = self.map(path, checksums=True)  # the copy is what gets served: check it
                if e.crcs is not None and m.crcs != e.crcs:
                    raise ValueError(f"{path}: checksums differ from {e.path}")
            except ValueError as exc:
                log.error("rollout %s served from %s, not its shared-memory copy: %s", e.rollout_id, e.path, exc)
                path.unlink(missing_ok=True)
                continue
            e.shm_path = path
            e.replace_batches(m.batches, in_memory=True, source=path, source_size=m.size, crcs=m.crcs, stamp=m.stamp,
                              verified=m.verified)
            budget.add(e.num_bytes)

    def file_path(self, rollout_id: str) -> Path:
        return self.path / f"{rollout_id}.arrow"

    def location(self, path: Path) -> str:
        return file_location(path, self.host)

    def write(
        self,
        rollout_id: str,
        schema: pa.Schema,
        batches: list[pa.RecordBatch],
        ticket: str,
        crcs: tuple[int, ...] | None = None,
    ) -> Path:
        """Write the file (no fsync: memory, not disk); atomic like every trajectory file.
        ``crcs``: the batches' checksums when known (else computed)."""
        w = open_writer(self.file_path(rollout_id), schema, ticket)
        try:
            self._chmod(w.temp)
            for i, b in enumerate(batches):
                w.write(b, crcs[i] if crcs is not None and len(crcs) == len(batches) else None)
            return w.commit(fsync=False)
        except BaseException:
            w.abort()
            raise

    def copy_in(self, durable: Path) -> Path:
        """A copy of a durable trajectory file (same bytes, same footer)."""
        dst = self.file_path(durable.name.removesuffix(".arrow"))
        tmp = dst.with_name(dst.name + TEMP_SUFFIX)
        try:
            with open(durable, "rb") as src, open(tmp, "wb") as out:
                self._chmod(tmp)
                shutil.copyfileobj(src, out, 16 << 20)
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return dst

    def _chmod(self, path: Path) -> None:
        os.chmod(path, 0o600 if self.private else 0o644)

    @staticmethod
    def map(path: Path, *, checksums: bool = False) -> MappedTrajectory:
        """The file memory-mapped (what the store serves), its checksums checked if asked."""
        return map_trajectory(path, validate=False, checksums=checksums)

    def close(self) -> None:
        """Release the lock (files of a closed store are removed by the store)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
