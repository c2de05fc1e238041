"""Same-host trainers: finished trajectories as Arrow IPC files in a shared-memory directory.

With ``shm_dir`` (e.g. under /dev/shm) the store writes each finished trajectory once as a
"trajectory/v1" file ``<dir>/<id>.arrow`` and serves it memory-mapped from there (Flight
included): the file is the one copy of the data on the host, and it counts against the
memory budget (tmpfs pages are memory). Its FlightInfo endpoint lists, after the grpc
location, ``file://<path>?host=<host id>``; a client with the same host id reads the file
directly (dataplane/client.py).

- With ``data_dir`` too, the file in ``data_dir`` is the durable one (fsync'd, survives
  restarts); the shm file is a copy in memory, dropped when the budget spills it.
- The files live in a private subdirectory ``<dir>/sigmaflight-<uid>/`` that the server creates
  and checks: a real directory (not a symlink), owned by the server's user, mode 0700 (0711
  without tokens, so others may open a 0644 file they were given a location for, never list or
  create one). ``<dir>`` may be shared and world-writable (/dev/shm, 1777): nobody else can put
  a name into the private one, and every file is created ``O_EXCL | O_NOFOLLOW`` through the
  directory's descriptor (dataplane/files.py ``create_new``), so a planted symlink is never
  followed. A private directory that is not the server's refuses the start (ShmDirUnsafe).
  A ``<dir>`` writable by others is reported at start: at info with the sticky bit (others
  cannot rename the private directory), as a warning without it.
- A private directory holds the files of one live store: it takes an exclusive ``flock`` on
  ``sigmaflight-<uid>/.sigmaflight.lock`` (released by the kernel when the process dies, kill -9
  included); another server on the same directory refuses to start. Files found there
  belong to a dead process and are removed; with ``data_dir``, the restart scan then
  writes the durable trajectories back into the directory (within the budget; a copy that
  does not fit leaves the rollout served from its durable file).
- ``private=True`` (tokens configured): files are mode 0600, readable by the server's user
  only (any process of that user on the host can read them).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import stat
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pyarrow as pa
from sigmaflight.dataplane.budget import MemoryBudget, trim_if_large
from sigmaflight.dataplane.durable import open_writer
from sigmaflight.dataplane.entry import Entry
from sigmaflight.dataplane.files import (
    TEMP_SUFFIX,
    MappedTrajectory,
    create_new,
    map_trajectory,
    remove,
    rename_into_place,
)

log = logging.getLogger("sigmaflight.dataplane.store")

LOCK_NAME = ".sigmaflight.lock"


class ShmDirUnsafe(RuntimeError):
    """The private subdirectory exists but is not the server's own (a symlink, not a directory,
    another user's): the store refuses to use it."""


def private_dir_name() -> str:
    """The private subdirectory's name: ``sigmaflight-<effective uid>``."""
    return f"sigmaflight-{os.geteuid()}"


def _report_shared_root(root: Path, private: Path) -> None:
    """One log line when others may write ``root``: info with the sticky bit (they cannot rename
    or remove the private directory), else a warning."""
    st = os.stat(root)
    others_write = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    foreign = st.st_uid not in (0, os.geteuid())
    if not others_write and not foreign:
        return
    mode = f"{stat.S_IMODE(st.st_mode) | (st.st_mode & stat.S_ISVTX):o}"
    if others_write and st.st_mode & stat.S_ISVTX and not foreign:
        log.info("shm_dir is writable by others (sticky): the trajectory files go to a private directory in it, "
                 "which only this user can write", extra={"shm_dir": str(root), "mode": mode, "private": str(private)})
        return
    why = f"belongs to uid {st.st_uid}" if foreign else "is writable by others without the sticky bit"
    log.warning(f"shm_dir {why}: the trajectory files stay in a private directory in it, which nobody else can "
                "write, but they can rename it and put their own in its place, and same-host clients would then look "
                "there; use a directory that only this user (or root) can write, or set the sticky bit (chmod +t)",
                extra={"shm_dir": str(root), "mode": mode, "private": str(private)})


def open_private_dir(path: Path, mode: int) -> int:
    """A descriptor of the directory ``path``, made here if missing; refuses (ShmDirUnsafe) one
    that is a symlink, not a directory or not owned by this user; sets ``mode`` on it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        what = ("a symlink" if os.path.islink(path) else
                "not a directory" if exc.errno in (errno.ENOTDIR, errno.ELOOP) else f"unusable ({exc})")
        raise ShmDirUnsafe(f"shm_dir: {path} is {what}; refusing to use it (the server makes this directory itself: "
                           "remove what is there, or choose another --shm-dir)") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise ShmDirUnsafe(f"shm_dir: {path} belongs to uid {st.st_uid}, not to this server's uid {os.geteuid()}; "
                           "refusing to use it (someone else made it: remove it, or choose another --shm-dir)")
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)
    return fd


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
    """The private directory of shared-memory trajectory files of one live store:
    ``<root>/sigmaflight-<uid>/`` (``path``)."""

    def __init__(self, root: Path, *, private: bool = False) -> None:
        self.root = Path(root).absolute()
        self.private = private
        self.host = host_id()
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / private_dir_name()
        _report_shared_root(self.root, self.path)
        self._dir_fd = open_private_dir(self.path, 0o700 if private else 0o711)
        try:
            self._lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                    dir_fd=self._dir_fd)
        except OSError as exc:
            os.close(self._dir_fd)
            raise ShmDirUnsafe(f"shm_dir: cannot open {self.path / LOCK_NAME} ({exc})") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            os.close(self._dir_fd)
            raise RuntimeError(f"shm_dir {self.path} is in use by another live server (its lock is held)") from None
        for name in sorted(os.listdir(self._dir_fd)):
            if name.endswith((".arrow", ".arrow" + TEMP_SUFFIX)):
                log.warning("removing stale shared-memory trajectory (left by a dead process)",
                            extra={"path": str(self.path / name)})
                remove(self.path / name, dir_fd=self._dir_fd)

    def adopt(self, e: Entry) -> None:
        """A finishing entry's heap batches become one file here, served memory-mapped (same
        bytes, still counted in the budget); on failure (e.g. /dev/shm full) they stay on the heap."""
        try:
            path = self.write(e.rollout_id, e.schema, e.batches, e.ticket, e.crcs)
            m = self.map(path)
        except (OSError, ValueError) as exc:
            log.warning("rollout stays on the heap: cannot write it to shm_dir",
                        extra={"rollout": e.rollout_id, "reason": str(exc)})
            return
        e.shm_path = path
        # same boundaries: live readers keep their index
        e.replace_batches(m.batches, in_memory=True, source=path, source_size=m.size, crcs=m.crcs, stamp=m.stamp)
        trim_if_large(e.num_bytes)

    def restore(self, entries: list[Entry], budget: MemoryBudget) -> None:
        """After a restart: copy durable trajectories back here, newest first, within the budget.
        A copy that fails (the directory is full: ENOSPC, or any OSError) leaves that rollout
        served memory-mapped from its durable file, as a spilled one is, and start-up goes on."""
        for e in sorted(entries, key=lambda e: -(e.finished_at or 0.0)):
            if e.path is None or budget.used + e.num_bytes > budget.limit_bytes:
                continue
            try:
                path = self.copy_in(e.path)
            except OSError as exc:
                log.warning("rollout served from its durable file: cannot copy it into shm_dir",
                            extra={"rollout": e.rollout_id, "path": str(e.path), "shm_dir": str(self.path),
                                   "reason": str(exc)})
                continue
            try:
                m = self.map(path, checksums=True)  # the copy is what gets served: check it
                if e.crcs is not None and m.crcs != e.crcs:
                    raise ValueError(f"{path}: checksums differ from {e.path}")
            except ValueError as exc:
                log.error("rollout served from its durable file, not its shared-memory copy",
                          extra={"rollout": e.rollout_id, "path": str(e.path), "reason": str(exc)})
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
        w = open_writer(self.file_path(rollout_id), schema, ticket, mode=self._mode, dir_fd=self._dir_fd)
        try:
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
            with open(durable, "rb") as src, \
                    os.fdopen(create_new(tmp, mode=self._mode, dir_fd=self._dir_fd), "wb") as out:
                shutil.copyfileobj(src, out, 16 << 20)
            rename_into_place(tmp, dst, dir_fd=self._dir_fd)
        except BaseException:
            remove(tmp, dir_fd=self._dir_fd)
            raise
        return dst

    @property
    def _mode(self) -> int:
        return 0o600 if self.private else 0o644

    @staticmethod
    def map(path: Path, *, checksums: bool = False) -> MappedTrajectory:
        """The file memory-mapped (what the store serves), its checksums checked if asked."""
        return map_trajectory(path, validate=False, checksums=checksums)

    def close(self) -> None:
        """Release the lock (files of a closed store are removed by the store)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            os.close(self._dir_fd)
            self._lock_fd = self._dir_fd = -1
