"""A trainer that releases a rollout as soon as its pull returns: the Flight stream has ended (the
trajectory is whole) a moment before the control plane records the rollout succeeded. A DELETE or
a Flight `release` in that moment must still free the result (the rollout ends `expired`), not
answer `running` and free nothing (DELETE) or be refused "cancel it first" (Flight): the result
stayed held until --ttl-s. The window is a race between the server's worker thread and a client in
another process (in one process they share the GIL and the worker always wins it), so the server is
a `sigmaflight serve` child, its finished trajectories moved out to their files as they end (a wider
window), and the test makes many rollouts: some of them hit it in every run before the fix."""

from __future__ import annotations

import json

import pyarrow.flight as flight
import pytest

from sigmaflight import Client
from sigmaflight.launcher import ServerProcess
from tests.servers import wait_for

ROUNDS = 80


@pytest.mark.e2e
def test_a_rollout_released_as_its_pull_returns_is_freed(tmp_path) -> None:
    flags = ("--workers", "1", "--data-dir", str(tmp_path / "data"), "--store-budget-bytes", "0")
    with ServerProcess(*flags) as server, Client(server.rest_url) as c, \
            flight.FlightClient(server.flight_url) as fc:
        ids = []
        for k in range(ROUNDS):
            ticket = c.submit(prompts=["a red cube"], num_outputs_per_prompt=4, num_inference_steps=4, seed=k,
                              sampler={"type": "sde", "noise_level": 0.7})
            traj = c.pull(ticket)  # the stream has ended: the whole trajectory is here
            assert traj.latents.shape[:2] == (4, 5)
            if k % 2:
                (answer,) = fc.do_action(flight.Action("release", ticket.id.encode()))
                assert json.loads(answer.body.to_pybytes()) == {"id": ticket.id, "released": True}
            else:
                assert c._http.delete(f"/v1/rollouts/{ticket.id}").status_code == 200
            ids.append(ticket.id)
        # every one ends expired (freed), at once or as the control plane records its end
        wait_for(lambda: all(c.status(i).status == "expired" for i in ids) or None, "every rollout released", 30)
        listed = {f.descriptor.path[0].decode() for f in fc.list_flights()}
        assert not listed & set(ids), listed  # the data plane holds none of them
