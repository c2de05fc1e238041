"""--max-records: past it the oldest ended rollouts' records are dropped, and what they held goes
with them. REST and Flight then agree that the rollout is gone, the store and the data dir no
longer hold it, and a restart does not bring it back. Real server, in process."""

from __future__ import annotations

import pyarrow.flight as flight
import pytest

from tests.servers import InProcessServer, metric, wait_for, wait_for_status

SMALL = {"prompts": ["a"], "num_inference_steps": 2, "seed": 5}


def _served(location: str, ticket: str) -> bool:
    with flight.FlightClient(location) as c:
        try:
            c.do_get(flight.Ticket(ticket.encode())).read_all()
        except flight.FlightError as exc:
            assert "not found" in str(exc), exc  # gone, not failed or stuck
            return False
    return True


@pytest.mark.timeout(120)
def test_records_past_the_cap_are_dropped_with_their_trajectories(tmp_path) -> None:
    data = tmp_path / "data"
    flags = ("--max-records", "2", "--data-dir", str(data), "--workers", "1")
    with InProcessServer(*flags) as server, server.client() as c:
        tickets = []
        for k in range(3):
            t = c.post("/v1/rollouts", json={**SMALL, "seed": k}, headers={"Idempotency-Key": f"key-{k}"}).json()
            assert wait_for_status(c, t["id"], {"succeeded"})["status"] == "succeeded"
            tickets.append(t)
        oldest = tickets[0]
        wait_for(lambda: c.get(f"/v1/rollouts/{oldest['id']}").status_code == 404 or None, "the oldest record dropped")
        assert c.delete(f"/v1/rollouts/{oldest['id']}").status_code == 404
        assert not _served(server.flight_url, oldest["flight"]["ticket"])  # Flight agrees with REST
        assert all(_served(server.flight_url, t["flight"]["ticket"]) for t in tickets[1:])
        assert metric(c.get("/metrics").text, "sigmaflight_store_entries") == 2
        # a succeeded rollout released by the cap is counted as one released by its TTL or a DELETE
        assert 'sigmaflight_rollouts_finished_total{status="expired"} 1.0' in c.get("/metrics").text
        files = {p.name for p in (data / "trajectories").glob("*.arrow")}
        assert files == {f"{t['id']}.arrow" for t in tickets[1:]}
        assert [r["id"] for r in c.get("/v1/rollouts").json()["rollouts"]] == [t["id"] for t in reversed(tickets[1:])]
    with InProcessServer("--data-dir", str(data)) as server, server.client() as c:  # the default cap
        assert c.get(f"/v1/rollouts/{oldest['id']}").status_code == 404
        assert not _served(server.flight_url, oldest["flight"]["ticket"])
        assert metric(c.get("/metrics").text, "sigmaflight_store_entries") == 2


@pytest.mark.timeout(120)
def test_the_records_dropped_are_those_ended_longest_ago_not_those_made_first() -> None:
    """A long rollout that ended after the cap's worth of newer ones was dropped within half a
    second of succeeding (the records were sorted by when they were made): its trainer got 404s,
    and a retry with its key ran it again."""
    with InProcessServer("--max-records", "2", "--workers", "2", "--max-steps", "2000") as server, server.client() as c:
        long = c.post("/v1/rollouts", json={**SMALL, "num_inference_steps": 1500, "seed": 9}).json()
        wait_for(lambda: c.get(f"/v1/rollouts/{long['id']}").json()["progress"]["steps_done"] >= 1 or None,
                 "the long one runs")
        quick = []
        for k in range(2):  # on the other worker, ended while the long one runs
            t = c.post("/v1/rollouts", json={**SMALL, "seed": 20 + k}).json()
            assert wait_for_status(c, t["id"], {"succeeded"})["status"] == "succeeded"
            quick.append(t)
        assert c.get(f"/v1/rollouts/{long['id']}").json()["status"] == "running"
        assert wait_for_status(c, long["id"], {"succeeded"}, timeout=90)["status"] == "succeeded"
        wait_for(lambda: c.get(f"/v1/rollouts/{quick[0]['id']}").status_code == 404 or None,
                 "the first quick one, ended longest ago, dropped")
        assert c.get(f"/v1/rollouts/{long['id']}").json()["status"] == "succeeded"  # before: dropped, 404
        assert _served(server.flight_url, long["flight"]["ticket"])
