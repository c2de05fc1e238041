"""Jobs: the bounded queue and worker threads (manager.py and its parts) and the durable sqlite
journal (journal.py)."""

from sigmaflight.control.jobs.backend import Backend
from sigmaflight.control.jobs.batching import BATCH_WAIT_ROUNDS
from sigmaflight.control.jobs.job import (
    IdempotencyConflict,
    Job,
    JobView,
    JournalUnavailable,
    NotAccepting,
    NotFinished,
    PlacementFailed,
    QueueFull,
    Unavailable,
    iso,
)
from sigmaflight.control.jobs.manager import JobManager

from sigmaflight.records import STATES, TERMINAL

__all__ = [
    "BATCH_WAIT_ROUNDS", "STATES", "TERMINAL", "Backend", "IdempotencyConflict", "Job", "JobManager", "JobView",
    "JournalUnavailable", "NotAccepting", "NotFinished", "PlacementFailed", "QueueFull", "Unavailable", "iso",
]
