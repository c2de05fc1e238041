"""Helpers for end-to-end tests: the real server process (sigmaflight/launcher.py) and polling."""

from __future__ import annotations

import time

import httpx

from sigmaflight.launcher import ServerProcess

__all__ = ["ServerProcess", "wait_for_status"]


def wait_for_status(client: httpx.Client, rollout_id: str, statuses: set[str], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/rollouts/{rollout_id}").json()
        if body["status"] in statuses:
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout {rollout_id} still {body['status']} after {timeout}s: {body}")
        time.sleep(0.02)
