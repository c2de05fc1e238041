"""Helpers for end-to-end tests: the real server process (sigmaflight/launcher.py) and polling.

Tests wait for events the server shows (a status, a /metrics value, a log line) with these
polls and a generous deadline, never with a sleep standing in for the event.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from sigmaflight.launcher import ServerProcess

__all__ = ["ServerProcess", "flight_streams", "metric", "wait_for", "wait_for_log", "wait_for_status"]

T = TypeVar("T")


def wait_for(condition: Callable[[], T | None], what: str, timeout: float = 30.0, every: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail naming `what`
    (and the last value seen) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what} (last seen: {value!r})")
        time.sleep(every)


def wait_for_status(client: httpx.Client, rollout_id: str, statuses: set[str], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/rollouts/{rollout_id}").json()
        if body["status"] in statuses:
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout {rollout_id} still {body['status']} after {timeout}s: {body}")
        time.sleep(0.02)


def wait_for_log(server: ServerProcess, text: str, timeout: float = 30.0, since: int = 0) -> str:
    """The first log line (from index `since` of `server.logs`) that contains `text`, once the
    test process has read it from the server's stderr."""
    return wait_for(lambda: next((line for line in server.logs[since:] if text in line), None),
                    f"a log line with {text!r}", timeout)


def metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text exposition."""
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def flight_streams(client: httpx.Client) -> int:
    """The server's open Flight do_get streams (its stream slots in use), from /metrics."""
    return int(metric(client.get("/metrics").text, "sigmaflight_flight_streams"))
