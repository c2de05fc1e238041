"""Jobs: the bounded queue and worker threads (manager.py) and the durable sqlite journal (journal.py)."""

from sigmaflight.control.jobs.manager import (
    Backend,
    IdempotencyConflict,
    Job,
    JobManager,
    NotAccepting,
    QueueFull,
    iso,
)

from sigmaflight.wire import STATES, TERMINAL

__all__ = [
    "STATES", "TERMINAL", "Backend", "IdempotencyConflict", "Job", "JobManager", "NotAccepting", "QueueFull", "iso",
]
