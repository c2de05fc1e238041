"""Flight consumers that leave, cancel/release actions that do
more than their name, the parallel client's cleanup, pull by id of a queued rollout."""

from __future__ import annotations

import gc
import json
import threading

import httpx
import pyarrow.flight as flight
import pytest
import torch

from tests.faults.conftest import LONG, LONG_FLAGS, SMALL, Pull, latent_bytes, options, pull, wait_running
from tests.servers import InProcessServer, flight_streams, wait_for, wait_for_status

STREAMS = 8
# 11 captured steps of 16 samples x 64 KiB: 11 batches of 1 MiB; two partitions of ~5.5 MiB each
# are more than gRPC buffers per stream, so a consumer that stops leaves the server blocked.
MANY = {"prompts": [f"m{i}" for i in range(8)], "num_outputs_per_prompt": 2, "num_inference_steps": 10,
        "height": 128, "width": 128, "guidance_scale": 1.0, "seed": 51}


def _server() -> InProcessServer:
    return InProcessServer("--workers", "1", "--max-flight-streams", str(STREAMS), *LONG_FLAGS)


@pytest.fixture(scope="module")
def server():
    """Shared by the tests that leave it as they found it (no stream slot held afterwards)."""
    with _server() as s:
        yield s


def _action(location: str, kind: str, rollout_id: str) -> dict:
    with flight.FlightClient(location) as c:
        results = list(c.do_action(flight.Action(kind, json.dumps({"id": rollout_id}).encode()), options(10)))
    return json.loads(results[0].body.to_pybytes())


@pytest.mark.timeout(120)
def test_consumers_that_leave_a_queued_ticket_free_their_slots(server: InProcessServer) -> None:
    with server.client() as c:
        done = c.post("/v1/rollouts", json=SMALL).json()
        assert wait_for_status(c, done["id"], {"succeeded"})
        blocker = c.post("/v1/rollouts", json=LONG).json()
        wait_running(c, blocker["id"], steps=1)
        queued = c.post("/v1/rollouts", json=SMALL).json()
        waiters = [Pull(server.flight_url, queued["flight"]["ticket"], timeout=1.0) for _ in range(STREAMS)]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join(10)
            assert isinstance(w.error, flight.FlightTimedOutError), w.error  # each left at its 1 s deadline
        try:
            # The server notices that they left and frees their slots while the rollout is still queued.
            def freed() -> bool:
                status = c.get(f"/v1/rollouts/{queued['id']}").json()["status"]
                assert status == "queued", f"the rollout ran ({status}) while its leavers' slots were still held"
                return flight_streams(c) == 0

            wait_for(freed, "the leavers' stream slots are free again")
            _all_slots_serve(server, done["flight"]["ticket"])  # every slot streams an unrelated finished rollout
        finally:  # the queued rollout runs now, which frees the slots on any server
            c.delete(f"/v1/rollouts/{blocker['id']}")
            wait_for_status(c, queued["id"], {"succeeded", "failed"})


def _all_slots_serve(server: InProcessServer, ticket: str) -> None:
    """STREAMS pulls at once, one per stream slot: each streams the whole rollout."""
    pulls = [Pull(server.flight_url, ticket, timeout=10) for _ in range(STREAMS)]
    for p in pulls:
        p.start()
    for p in pulls:
        p.join(15)
    errors = [p.error for p in pulls if p.error is not None]
    assert not errors, errors[0]
    assert all(p.table is not None and p.table.num_rows > 0 for p in pulls)


@pytest.mark.timeout(60)
def test_flight_cancel_of_a_finished_rollout_keeps_it(server: InProcessServer) -> None:
    with server.client() as c:
        done = c.post("/v1/rollouts", json=SMALL).json()
        assert wait_for_status(c, done["id"], {"succeeded"})
        before = latent_bytes(pull(server.flight_url, done["flight"]["ticket"]))
        answer = _action(server.flight_url, "cancel", done["id"])  # a defensive cancel after the pull
        assert answer == {"id": done["id"], "cancelled": False}
        assert c.get(f"/v1/rollouts/{done['id']}").json()["status"] == "succeeded"
        assert latent_bytes(pull(server.flight_url, done["flight"]["ticket"])) == before


@pytest.mark.timeout(120)
def test_flight_release_of_a_running_rollout_is_refused(server: InProcessServer) -> None:
    mid = {"prompts": ["mid"], "num_inference_steps": 1500, "seed": 52, "return": {"steps": [0, 1500]}}
    with server.client() as c:
        running = c.post("/v1/rollouts", json=mid).json()
        wait_running(c, running["id"], steps=2)
        with pytest.raises(flight.FlightError) as info:
            _action(server.flight_url, "release", running["id"])
        assert not isinstance(info.value, flight.FlightTimedOutError)
        assert "running" in str(info.value), str(info.value)
        status = wait_for_status(c, running["id"], {"succeeded", "failed", "cancelled"}, timeout=60)
        assert status["status"] == "succeeded", status
        assert pull(server.flight_url, running["flight"]["ticket"]).num_rows == 2


def _queued_behind_a_blocker(c: httpx.Client) -> dict:
    """A small rollout's ticket, queued behind a running one of 1500 steps (that ends by itself)."""
    mid = {"prompts": ["mid"], "num_inference_steps": 1500, "seed": 53, "return": {"steps": [0, 1500]}}
    blocker = c.post("/v1/rollouts", json=mid).json()
    wait_running(c, blocker["id"], steps=1)
    queued = c.post("/v1/rollouts", json=SMALL).json()
    assert c.get(f"/v1/rollouts/{queued['id']}").json()["status"] == "queued"
    return queued


@pytest.mark.timeout(120)
def test_pull_by_id_of_a_queued_rollout_waits_for_it(server: InProcessServer) -> None:
    from sigmaflight.dataplane.client import TrajectoryClient

    with server.client() as c:
        queued = _queued_behind_a_blocker(c)
        with TrajectoryClient(server.flight_url) as tc:
            trajectory = tc.pull(queued["id"])
        assert trajectory.rollout_id == queued["id"]
        assert wait_for_status(c, queued["id"], {"succeeded"})


@pytest.mark.timeout(120)
def test_iter_steps_parallel_of_a_queued_rollout_waits_for_it(server: InProcessServer) -> None:
    """As pull and iter_steps do; it answered "not found (queued: not started yet)", also in the
    moment after REST said running and before the rollout's first step was stored."""
    from sigmaflight.dataplane.client import TrajectoryClient

    with server.client() as c:
        queued = _queued_behind_a_blocker(c)
        with TrajectoryClient(server.flight_url) as tc:
            steps = list(tc.iter_steps_parallel(queued["id"], streams=2))
            alone = list(tc.iter_steps(queued["id"]))
        assert [s.step for s in steps] == [s.step for s in alone] and steps
        assert all(torch.equal(a.latent, b.latent) for a, b in zip(steps, alone, strict=True))
        assert wait_for_status(c, queued["id"], {"succeeded"})
        assert flight_streams(c) == 0  # the wait's own stream is closed


@pytest.mark.timeout(120)
def test_iter_steps_parallel_stopped_early_frees_its_streams() -> None:
    """Its own server: today the leaked pumps hold their stream slots for good."""
    from sigmaflight.dataplane.client import TrajectoryClient

    with _server() as server:
        with server.client() as c:
            many = c.post("/v1/rollouts", json=MANY).json()
            assert wait_for_status(c, many["id"], {"succeeded"})
        baseline = threading.active_count()
        with TrajectoryClient(server.flight_url) as tc:
            for merge in (False, True, False, True):  # 4 x 2 streams = every slot
                it = tc.iter_steps_parallel(many["id"], streams=2, prefetch=1, merge_steps=merge)
                if merge:
                    next(it)  # the consumer takes one step, then stops (its pumps are pulling)
                else:  # it takes all but the last batch: a pump that has read its last one waits to say "done"
                    for _ in range(10):
                        next(it)
                del it
                never = tc.iter_steps_parallel(many["id"], streams=2, prefetch=1, merge_steps=merge)
                del never  # one that never starts holds nothing either
            gc.collect()
            # The pumps end and their streams close (the server frees the slots), then every slot streams.
            wait_for(lambda: threading.active_count() <= baseline, "the pump threads end")
            with server.client() as c:
                wait_for(lambda: flight_streams(c) == 0, "the stopped iterators' stream slots are free again")
            _all_slots_serve(server, many["flight"]["ticket"])
            assert threading.active_count() <= baseline, "pump threads outlived the consumer"
