"""--ttl-s: past it a finished rollout's result is freed, as a DELETE frees it. A succeeded rollout
becomes expired and its ticket answers not found; a cancelled one stays cancelled, and REST and
Flight still say how it ended. Real server, in process."""

from __future__ import annotations

import pyarrow.flight as flight
import pytest

from tests.faults.conftest import LONG, LONG_FLAGS, SMALL, wait_running
from tests.servers import InProcessServer, wait_for_status


def _flight_error(location: str, ticket: str) -> str:
    with flight.FlightClient(location) as c:
        with pytest.raises(flight.FlightError) as exc:
            c.do_get(flight.Ticket(ticket.encode())).read_all()
    return str(exc.value)


@pytest.mark.timeout(120)
def test_past_the_ttl_a_succeeded_rollout_expires_and_a_cancelled_one_stays_cancelled() -> None:
    with InProcessServer("--ttl-s", "1", "--workers", "1", *LONG_FLAGS) as server, server.client() as c:
        blocker = c.post("/v1/rollouts", json=LONG).json()
        wait_running(c, blocker["id"], steps=1)
        queued = c.post("/v1/rollouts", json=SMALL).json()
        assert c.delete(f"/v1/rollouts/{queued['id']}").json()["status"] == "cancelled"
        c.delete(f"/v1/rollouts/{blocker['id']}")
        assert wait_for_status(c, blocker["id"], {"cancelled", "failed", "succeeded"})["status"] == "cancelled"
        done = c.post("/v1/rollouts", json=SMALL).json()
        assert wait_for_status(c, done["id"], {"succeeded", "failed"})["status"] == "succeeded"
        # it ended last: once it has expired, the reaper has passed the cancelled ones' TTL too
        wait_for_status(c, done["id"], {"expired"}, timeout=30)
        assert "not found" in _flight_error(server.flight_url, done["flight"]["ticket"])
        for cancelled in (queued, blocker):
            body = c.get(f"/v1/rollouts/{cancelled['id']}").json()
            assert body["status"] == "cancelled", body
            error = _flight_error(server.flight_url, cancelled["flight"]["ticket"])
            assert "not found (cancelled: " in error, error  # as after a DELETE: how it ended, not "released"
        listed = {r["id"]: r["status"] for r in c.get("/v1/rollouts").json()["rollouts"]}
        assert listed == {done["id"]: "expired", queued["id"]: "cancelled", blocker["id"]: "cancelled"}
