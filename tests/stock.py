"""The independent reference of the equivalence tests: a stock diffusers pipeline call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler

__all__ = ["stock_scheduler"]


@contextmanager
def stock_scheduler(pipe: Any) -> Iterator[Any]:
    """The same pipeline object, with a fresh stock scheduler from the same config (restored after)."""
    original = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(original.config)
    try:
        yield pipe
    finally:
        pipe.scheduler = original
