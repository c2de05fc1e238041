"""The status document a poller reads while a rollout runs: what the wire model says, byte for
byte, and never a stale step (the server renders a status once per change and reuses it)."""

from __future__ import annotations

import json
import time

import httpx

from sigmaflight.wire import RolloutStatus
from tests.servers import InProcessServer

T = 40


def canonical(doc: dict) -> bytes:
    """The body `RolloutStatus` itself gives for `doc`, as Starlette's JSONResponse writes it."""
    dumped = RolloutStatus.model_validate(doc).model_dump(mode="json", by_alias=True)
    return json.dumps(dumped, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def test_a_polled_status_is_the_wire_models_document_and_follows_every_step():
    with InProcessServer() as s, httpx.Client(base_url=s.rest_url, timeout=60) as c:
        r = c.post("/v1/rollouts", json={"prompts": ["a cat", "a dog"], "num_inference_steps": T})
        assert r.status_code == 202, r.text
        path = f"/v1/rollouts/{r.json()['id']}"
        seen: list[int] = []
        statuses: set[str] = set()
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"the status never left {statuses} (steps seen: {sorted(set(seen))})"
            got = c.get(path)
            assert got.status_code == 200
            assert got.headers["content-type"] == "application/json"
            assert got.content == canonical(got.json())
            doc = got.json()
            statuses.add(doc["status"])
            seen.append(doc["progress"]["steps_done"])
            if doc["status"] not in ("queued", "running"):
                break
        assert doc["status"] == "succeeded"
        assert doc["result"] is not None and doc["finished_at"] is not None
        assert seen == sorted(seen) and seen[-1] == T
        assert "running" in statuses and len(set(seen)) > 2  # it was read while it ran, at several steps
        again = c.get(path)  # the same snapshot read again: the same body
        assert again.content == got.content
