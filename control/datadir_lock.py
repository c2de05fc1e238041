"""One live server a --data-dir: an exclusive flock on the directory and on `<data_dir>/.sigmaflight.lock`.

Two servers on one data dir would each take the other's files and rows for a dead process's
leftovers: the second's restart scan deletes the first's half-written trajectory files and marks
its running rollouts failed in the shared journal. So `sigmaflight serve`'s preflight
(control/startup.py) takes this lock before anything in the directory is read or changed and
before the model loads; a second server is refused, naming the flag. The lock is the kernel's
(flock on an open file, close-on-exec): a server that dies, by kill -9 too, leaves the directory
free; the file itself stays and means nothing (deleting it while a server runs does not free the
directory: the directory's own lock holds).

The preflight's lock waits here (`take`) until the server's job journal adopts it (`adopt`,
control/jobs/journal.py), which lets go of it when it closes: a server run in a test's process
frees the directory when it stops. A journal opened without a preflight (a JobManager built
directly) holds no lock. Ray workers keep their files in DIR/worker-N and open no journal: they
never take it.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

__all__ = ["LOCK_NAME", "DataDirInUse", "DataDirLock", "adopt", "take"]

LOCK_NAME = ".sigmaflight.lock"


class DataDirInUse(RuntimeError):
    """Another live server (another process, or another server started in this one) holds the lock."""

    def __init__(self, lock: Path) -> None:
        super().__init__(f"in use by another live server (it holds {lock})")
        self.lock = lock


class DataDirLock:
    """The flocks on `<data_dir>` and `<data_dir>/.sigmaflight.lock`, held until `release` (or the process ends).
    Raises DataDirInUse when it is held, OSError when the file cannot be opened."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / LOCK_NAME
        self._fds: list[int] = []
        # The directory itself is locked too: a lock file someone deleted (or replaced) while a
        # server ran would let a second one lock a new file of the same name.
        for name, flags in ((Path(data_dir), os.O_RDONLY | os.O_DIRECTORY),
                            (self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW)):
            try:
                fd = os.open(name, flags | os.O_CLOEXEC, 0o600)
            except OSError:
                self.release()
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self.release()
                raise DataDirInUse(self.path) from None
            except OSError:
                os.close(fd)
                if name == self.path:
                    self.release()
                    raise
                continue  # a file system that cannot lock a directory (NFS emulates flock with write locks): the file's lock alone
            self._fds.append(fd)

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)  # a flock goes with the last descriptor of its open file


_taken: dict[str, DataDirLock] = {}
"""Locks taken by a preflight, by the data dir's real path, until the server's journal adopts them.
Process-wide, as the locks themselves are."""
_taken_guard = threading.Lock()


def take(data_dir: Path) -> DataDirLock:
    """Lock `data_dir` for the server this process is starting (a second call for the same
    directory, before its journal adopted the first, returns the same lock)."""
    key = os.path.realpath(data_dir)
    with _taken_guard:
        lock = _taken.get(key)
        if lock is None:
            lock = _taken[key] = DataDirLock(data_dir)
        return lock


def adopt(data_dir: Path) -> DataDirLock | None:
    """The lock `take` holds for `data_dir`, now the caller's to release (None when no preflight
    took one: a job manager built in a program's own process, whose directory is its own business)."""
    with _taken_guard:
        return _taken.pop(os.path.realpath(data_dir), None)
