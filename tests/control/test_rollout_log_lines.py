"""Every rollout's end is a log line (docs/control.md, "Logs"), also for one that never ran: a
queued rollout cancelled by DELETE, or failed by the server's shutdown. Real server, in process."""

from __future__ import annotations

import json

from tests.servers import InProcessServer, wait_for_status


def _lines(server: InProcessServer, rollout: str) -> list[dict]:
    return [e for e in map(json.loads, server.logs) if e.get("rollout") == rollout]


def test_a_queued_rollout_that_ends_without_running_has_its_end_line() -> None:
    server = InProcessServer("--workers", "1", "--max-steps", "5000")
    with server, server.client() as c:
        blocker = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 4000, "seed": 1,
                                               "return": {"steps": [0]}}).json()
        wait_for_status(c, blocker["id"], {"running"})
        cancelled = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2}).json()
        shut = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2}).json()
        assert c.get(f"/v1/rollouts/{cancelled['id']}").json()["status"] == "queued"
        assert c.delete(f"/v1/rollouts/{cancelled['id']}").status_code == 200
        ends = [e for e in _lines(server, cancelled["id"]) if e["msg"] == "rollout cancelled"]
        assert len(ends) == 1 and ends[0]["level"] == "info" and ends[0]["was"] == "queued", _lines(server, cancelled["id"])
    ends = [e for e in _lines(server, shut["id"]) if e["msg"] == "rollout failed"]
    assert len(ends) == 1 and ends[0]["type"] == "shutdown" and ends[0]["was"] == "queued", _lines(server, shut["id"])
