"""Durable job records in `<data_dir>/jobs.sqlite3`, so statuses survive a restart.

One row per rollout, written at each state change (never per step). The restart scan
(control/jobs/lifecycle.py `Lifecycle.recover`) reconciles the rows with the trajectories the
backend still holds. A write can fail (full or read-only disk): `put` and `delete` raise
`sqlite3.Error`, the connection stays usable, and `probe` tells when writes work again.

The journal holds the data dir's lock (control/datadir_lock.py) while it is open: the one
`sigmaflight serve`'s preflight took, which it releases when it closes.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from sigmaflight.control.datadir_lock import adopt

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS probe (
    k INTEGER PRIMARY KEY,
    at REAL NOT NULL
)
"""


JOURNAL_NAME = "jobs.sqlite3"


class JournalUnreadable(Exception):
    """An existing journal the restart scan could not read whole (names the row and why)."""


def check_journal(path: Path) -> None:
    """Every row of the journal at `path` (if there is one) read as the restart scan reads them;
    JournalUnreadable naming the first that cannot be, or the file sqlite cannot open. Read-only:
    nothing is changed."""
    from sigmaflight.control.jobs.job import Job

    if not path.exists():
        return
    if not path.is_file():
        raise JournalUnreadable(f"{path} is not a file")
    try:
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)  # as_uri escapes %, ? and #
        try:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            rows = db.execute("SELECT id, record FROM jobs").fetchall() if "jobs" in tables else []
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise JournalUnreadable(f"{path}: {exc}") from None
    for row_id, text in rows:
        try:
            Job.from_record(json.loads(text))
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
            raise JournalUnreadable(f"{path}: row {str(row_id)[:80]!r}: {type(exc).__name__}: {str(exc)[:200]}") from None


class Journal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._dir_lock = adopt(path.parent)  # one live server a data dir, until close (None: no preflight)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except BaseException:
            self._release_dir()
            raise

    def put(self, job_id: str, record: dict[str, Any]) -> None:
        """Write the job's row. A record whose "spec" is None (an ended job that let go of its
        request, `Job.forget_request`) keeps the spec its row already holds."""
        text = json.dumps(record, separators=(",", ":"))
        with self._lock:
            if record.get("spec") is None:
                self._db.execute("INSERT INTO jobs (id, record) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET "
                                 "record = json_set(excluded.record, '$.spec', json(json_extract(jobs.record, '$.spec')))",
                                 (job_id, text))
            else:
                self._db.execute("INSERT OR REPLACE INTO jobs (id, record) VALUES (?, ?)", (job_id, text))

    def delete(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def probe(self) -> None:
        """One small write (a row of its own table); raises sqlite3.Error while writes fail."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO probe (k, at) VALUES (1, ?)", (time.time(),))

    def load(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT record FROM jobs").fetchall()
        return [json.loads(r[0]) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._release_dir()

    def _release_dir(self) -> None:
        """Let go of the data dir's lock (once: later calls do nothing)."""
        lock, self._dir_lock = self._dir_lock, None
        if lock is not None:
            lock.release()
