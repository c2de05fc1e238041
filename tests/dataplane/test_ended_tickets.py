"""Flight names how a rollout ended as REST does, also for rollouts the store no longer knows: after
a restart on the same --data-dir a failed, cancelled or expired rollout's ticket and id answer
not_found with `ended` and the reason (they answered "unknown"), a queued rollout's own ticket
says "queued" as its id does, and a failed rollout's FlightInfo and schema are its failure (they
were a FlightInfo with -1 totals, as for a running one). Real server, in process, plain pyarrow.flight."""

from __future__ import annotations

import json

import pyarrow.flight as flight
import pytest

from tests.servers import BLOCKER, InProcessServer, wait_for_status

SMALL = {"prompts": ["a"], "num_inference_steps": 2, "seed": 3}


def _refusal(location: str, key: str) -> tuple[str, dict]:
    with flight.FlightClient(location) as c, pytest.raises(flight.FlightError) as caught:
        c.do_get(flight.Ticket(key.encode())).read_all()
    return str(caught.value), json.loads(caught.value.extra_info)


def _info_refusal(location: str, key: str) -> str:
    with flight.FlightClient(location) as c, pytest.raises(flight.FlightError) as caught:
        c.get_flight_info(flight.FlightDescriptor.for_path("rollouts", key))
    return str(caught.value)


@pytest.mark.timeout(180)
def test_ended_rollouts_tickets_name_how_they_ended_after_a_restart(tmp_path) -> None:
    data = str(tmp_path / "data")
    with InProcessServer("--data-dir", data, "--workers", "1", "--max-batch-samples", "1") as server, \
            server.client() as c:
        failed = c.post("/v1/rollouts", json={**SMALL, "sampler": {"type": "sde", "noise_level": 1e30}}).json()
        assert wait_for_status(c, failed["id"], {"succeeded", "failed"})["status"] == "failed"
        with flight.FlightClient(server.flight_url) as fc:  # not a FlightInfo whose -1 totals read "running"
            for path in [("rollouts", failed["id"]), ("rollouts", failed["id"], "partitions", "2")]:
                with pytest.raises(flight.FlightError) as caught:
                    fc.get_flight_info(flight.FlightDescriptor.for_path(*path))
                assert json.loads(caught.value.extra_info)["type"] == "failed", caught.value
                assert "non-finite" in str(caught.value)
            with pytest.raises(Exception, match="non-finite"):  # get_schema's errors come as ArrowException
                fc.get_schema(flight.FlightDescriptor.for_path("rollouts", failed["id"]))
        released = c.post("/v1/rollouts", json=SMALL).json()
        wait_for_status(c, released["id"], {"succeeded"})
        assert c.delete(f"/v1/rollouts/{released['id']}").json()["status"] == "expired"
        blocker = c.post("/v1/rollouts", json=BLOCKER).json()
        queued = c.post("/v1/rollouts", json=SMALL).json()
        wait_for_status(c, blocker["id"], {"running"})
        # a queued rollout's own ticket: "queued", as by its id (it said "unknown")
        assert "queued: not started yet" in _info_refusal(server.flight_url, queued["flight"]["ticket"])
        assert c.delete(f"/v1/rollouts/{queued['id']}").json()["status"] == "cancelled"
        c.delete(f"/v1/rollouts/{blocker['id']}")
        wait_for_status(c, blocker["id"], {"cancelled"})
    with InProcessServer("--data-dir", data) as server, server.client() as c:
        for ticket, ended, words in [(failed, "failed", "non-finite"), (queued, "cancelled", "cancelled"),
                                     (released, "expired", "expired")]:
            status = c.get(f"/v1/rollouts/{ticket['id']}").json()
            assert status["status"] == ended, status
            for key in (ticket["flight"]["ticket"], ticket["id"]):
                message, info = _refusal(server.flight_url, key)
                assert info["type"] == "not_found" and info["ended"] == ended, (key, info)
                assert words in message, message
                if status["error"] is not None:  # the reason REST gives, word for word
                    assert status["error"]["message"] in info["reason"], (info, status)
